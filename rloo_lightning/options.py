"""How RLOOModule's option groups (:mod:`rloo_lightning.config`) are checked, built and stored.

The field checks a group runs when it is built (its ``Literal`` choices, a ``[low, high]`` range, an ``on_error``
value), the checks that involve more than one group (:func:`check_options`), a group from a mapping with the closest
field named for a typo (:func:`as_group`), a group as the plain primitives checkpoints hold (:func:`to_primitives`),
and :class:`Options`, the groups as ``module.cfg`` holds them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from typing import Any, Literal

from rloo_lightning.runtime.renamed import renamed_option

__all__ = ["Options", "as_group", "check_choices", "check_learning_rate", "check_options", "check_range",
           "literal_choices", "parse_on_error", "set_field", "to_primitives"]


@functools.cache
def literal_choices(cls: type) -> dict[str, tuple]:
    """The fields of a group typed ``Literal[...]`` (optionally ``| None``) and their allowed values.

    The type is the one spelling of an option's names: those of a registry (``advantages.BASELINES``,
    ``kl.KL_ESTIMATORS``, ``losses.AGGREGATION_MODES``) are built from its keys."""
    hints = typing.get_type_hints(cls)
    found = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        options = [hint] + list(typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType)
                                else [])
        literal = [a for a in options if typing.get_origin(a) is Literal]
        if literal:
            found[f.name] = typing.get_args(literal[0]) + ((None,) if type(None) in typing.get_args(hint) else ())
    return found


def check_choices(group: Any) -> None:
    """Every ``Literal`` field of ``group`` holds one of its values; the error names the option."""
    for name, allowed in literal_choices(type(group)).items():
        value = getattr(group, name)
        if value not in allowed:
            shown = ", ".join(map(repr, [a for a in allowed if a is not None]))
            raise ValueError(f"{group.prefix}.{name} must be one of {shown}; got {value!r}")


def check_range(option: str, value: Any) -> tuple[float, float] | None:
    """A ``[low, high]`` pair with low < high (as a tuple), or None."""
    if value is None:
        return None
    if len(value) != 2 or not value[0] < value[1]:
        raise ValueError(f"{option} must be [low, high] with low < high, got {value!r}")
    return (float(value[0]), float(value[1]))


def parse_on_error(option: str, value: str | float | None) -> tuple[str, float | None]:
    """An ``on_error`` option: ``("raise", None)``, ``("value", None)`` (a missing reward) or ``("value", x)``."""
    if value is None:
        return "value", None
    if isinstance(value, bool):
        raise ValueError(f"{option} must be 'raise', 'none' or a float, got {value!r}")
    if isinstance(value, str) and value.strip().lower() == "raise":
        return "raise", None
    if isinstance(value, str) and value.strip().lower() in ("none", "null", "nan", "missing"):
        return "value", None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{option} must be 'raise', 'none' (missing reward) or a float, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{option} must be finite (use 'none' for a missing reward), got {value!r}")
    return "value", number


def set_field(group: Any, name: str, value: Any) -> None:
    """Normalise a field of a frozen group in its ``__post_init__`` (e.g. a YAML list to a tuple)."""
    object.__setattr__(group, name, value)


class Options:
    """The module's option groups, read as ``module.cfg.kl.beta``."""

    def __init__(self, **groups: Any) -> None:
        self.__dict__.update(groups)

    def __repr__(self) -> str:
        return "Options(" + ", ".join(f"{name}={group!r}" for name, group in self.__dict__.items()) + ")"


def check_options(c: Options) -> None:
    """Checks that involve more than one group, with errors that name each option."""
    if not 0 <= c.shaping.overlong_buffer < c.sampling.max_new_tokens:
        raise ValueError(f"shaping.overlong_buffer must be in [0, sampling.max_new_tokens="
                         f"{c.sampling.max_new_tokens}), got {c.shaping.overlong_buffer}")
    if c.correction.level != "none" and c.kl.placement == "loss":
        raise ValueError("correction.level needs kl.placement 'reward' or 'token_reward': with 'loss' the KL term's "
                         "gradient would stay uncorrected")
    if c.correction.level == "token" and c.update.updates_per_rollout > 1 and c.update.clip_mode == "sequence":
        raise ValueError("correction.level='token' gives token advantages; with update.updates_per_rollout > 1 "
                         "use update.clip_mode='token'")
    if c.update.updates_per_rollout > 1 and c.kl.placement == "token_reward" and c.update.clip_mode == "sequence":
        raise ValueError("kl.placement='token_reward' gives token advantages; with update.updates_per_rollout > 1 "
                         "use update.clip_mode='token'")
    if c.environment.class_path is not None:
        if c.sampling.stop_strings:
            raise ValueError("sampling.stop_strings are not supported with environment.class_path: a policy turn ends "
                             "at an EOS id (sampling.eos_token_ids)")
        if c.shaping.overlong_buffer:
            raise ValueError("shaping.overlong_buffer measures one completion against sampling.max_new_tokens; an "
                             "episode has several turns: set it to 0 with environment.class_path")
    if c.kl.ref_sync_steps and (c.kl.beta == 0 or c.policy.lora):
        raise ValueError("kl.ref_sync_steps needs a reference of its own: kl.beta > 0 and no policy.lora (under "
                         "LoRA the reference is the frozen base, which cannot move)")


def check_learning_rate(lr: Any, option: str) -> None:
    """A learning rate must be a finite number > 0; the error names ``option``, as the user set it
    (``model.optimizer.init_args.lr in my.yaml``). A value that is no plain number (a tensor) is left alone."""
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        return
    if not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"{option} must be a finite number > 0, got {lr}")


def as_group(cls: type, value: Any) -> Any:
    """``value`` as an instance of the group ``cls``: an instance, a dict of its fields, or None (defaults).

    An unknown key fails with the group's prefix and the closest field name.
    """
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    if dataclasses.is_dataclass(value):  # the same group from another import (e.g. a namespace)
        value = dataclasses.asdict(value)
    if not isinstance(value, dict):
        raise TypeError(f"{cls.prefix} must be a {cls.__name__} or a mapping of its fields, got {value!r}")
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in value:
        if key not in fields:
            close = [renamed_option(f"{cls.prefix}.{key}")] if renamed_option(f"{cls.prefix}.{key}") else [
                f"{cls.prefix}.{c}" for c in difflib.get_close_matches(key, sorted(fields), n=1)]
            hint = f"; did you mean {close[0]}?" if close else f"; valid: {', '.join(sorted(fields))}"
            raise ValueError(f"unknown option {cls.prefix}.{key}{hint}")
    return cls(**value)


def to_primitives(value: Any) -> Any:
    """A group (or anything nested in one) as plain dicts, lists and scalars, as stored in checkpoints."""
    if dataclasses.is_dataclass(value):
        return {f.name: to_primitives(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_primitives(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_primitives(v) for v in value]
    return value
