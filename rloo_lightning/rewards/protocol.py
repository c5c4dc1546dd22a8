"""The reward-function protocol: errors, resolving specs to callables, and calling them.

What :class:`~rloo_lightning.rewards.reward_set.RewardSet` and the worker processes of
:mod:`rloo_lightning.runtime.workers` both need: turning a spec (callable, import path, class
spec dict) into a callable, deciding from its signature how to call it, calling it, and checking
the values it returns. The protocol itself is described in :mod:`rloo_lightning.rewards`.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from rloo_lightning.runtime.importpath import ImportPathError, import_object

__all__ = [
    "RewardFunction",
    "RewardSpec",
    "RewardError",
    "RewardTimeoutError",
    "RewardWarning",
    "resolve_reward",
    "build_reward",
    "short_repr",
    "call_plan",
    "invoke",
    "to_floats",
]

RewardFunction = Callable[..., Sequence[float | None]]
RewardSpec = str | dict | RewardFunction

_STANDARD_ARGS = ("prompts", "completions", "completion_ids")
_PROTOCOL = "(prompts, completions, completion_ids, **columns)"


class RewardError(ValueError):
    """A reward function is misconfigured, broke the protocol, or raised."""


class RewardTimeoutError(RewardError):
    """A reward function call ran past ``timeout`` and ``on_error="raise"``."""


class RewardWarning(RuntimeWarning):
    """A reward call failed or timed out and was scored by ``on_error`` instead of raising, or a function
    gave no reward (None) for every completion of a call (no learning signal)."""


def short_repr(text: Any, limit: int = 200) -> str:
    """``repr`` of a prompt, cut to ``limit`` characters: error messages stay readable."""
    r = repr(text)
    return r if len(r) <= limit else r[: limit - 5] + "...'"


# -- resolving specs ---------------------------------------------------------------------------
def _builtin_rewards() -> list[str]:
    """Import paths of the reward classes the package ships (the rule rewards and the reward model)."""
    from rloo_lightning.rewards import builtin, model

    return [f"{m.__name__}.{n}" for m in (builtin, model) for n in m.__all__ if inspect.isclass(getattr(m, n))]


def _import_reward(path: str) -> Any:
    """The object at a reward function's import path; :class:`RewardError` naming it (and the closest built-in
    reward) when it does not resolve."""
    try:
        return import_object(path, "reward function", candidates=_builtin_rewards)
    except ImportPathError as err:
        raise RewardError(str(err)) from err.__cause__


def _instantiate(obj: Any, init_args: Mapping, spec: Any) -> Any:
    if inspect.isclass(obj):
        try:
            return obj(**init_args)
        except TypeError as err:
            hint = (
                "; it needs arguments: give {'class_path': ..., 'init_args': {...}}"
                if not init_args else ""
            )
            raise RewardError(f"reward function {spec!r}: cannot instantiate {obj.__name__}: {err}{hint}") from err
        except Exception as err:
            raise RewardError(f"reward function {spec!r}: {obj.__name__}(...) raised {err!r}") from err
    if init_args:
        if not callable(obj):
            raise RewardError(f"reward function {spec!r} is not callable")
        return functools.partial(obj, **init_args)
    return obj


def _name_of(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        return _name_of(fn.func)
    return getattr(fn, "__name__", type(fn).__name__)


def build_reward(spec: RewardSpec) -> tuple[str, RewardFunction]:
    """``(name, callable)`` for any accepted spec form, without the signature check of
    :func:`resolve_reward` (worker processes rebuild already-checked functions with it)."""
    if isinstance(spec, Mapping):
        unknown = set(spec) - {"class_path", "init_args", "name"}
        if "class_path" not in spec or unknown:
            raise RewardError(
                f"reward function {dict(spec)!r}: a dict spec has keys 'class_path' (required), 'init_args' "
                f"and 'name'" + (f"; unknown: {sorted(unknown)}" if unknown else "")
            )
        init_args = spec.get("init_args") or {}
        if not isinstance(init_args, Mapping):
            raise RewardError(f"reward function {spec['class_path']!r}: init_args must be a mapping, got {init_args!r}")
        obj = _import_reward(spec["class_path"])
        fn = _instantiate(obj, dict(init_args), spec["class_path"])
        name = spec.get("name") or (obj.__name__ if inspect.isclass(obj) else _name_of(obj))
        where = spec["class_path"]
    elif isinstance(spec, str):
        obj = _import_reward(spec)
        fn = _instantiate(obj, {}, spec)
        name, where = spec.rpartition(".")[2], spec
    elif callable(spec):
        return _name_of(spec), spec
    else:
        raise RewardError(
            f"reward function {spec!r}: expected a callable, an import path 'module.attr' or "
            "{'class_path': ..., 'init_args': {...}}"
        )
    if not callable(fn):
        raise RewardError(f"reward function {where!r} is not callable")
    return str(name), fn


def resolve_reward(spec: RewardSpec) -> tuple[str, RewardFunction]:
    """``(name, callable)`` for a callable, an import path ``"pkg.module.attr"`` or a class spec dict.

    Raises :class:`RewardError` (a ``ValueError``) naming the spec when it cannot be imported,
    instantiated, or does not accept the reward protocol's arguments.
    """
    name, fn = build_reward(spec)
    _check_signature(name, fn)
    return name, fn


# -- signatures --------------------------------------------------------------------------------
def _signature(fn) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have none: cannot check
        return None


def _bindable(sig: inspect.Signature, *args, **kwargs) -> bool:
    try:
        sig.bind(*args, **kwargs)
        return True
    except TypeError:
        return False


def call_plan(name: str, fn: RewardFunction, column_names: Sequence[str],
              check_required: bool = True, columns_known: bool = True) -> tuple[str, tuple[str, ...]]:
    """How to call ``fn`` given these dataset columns: ``(mode, columns to pass)``.

    ``mode`` is ``"positional"`` (``fn(prompts, completions, completion_ids, **cols)``) or
    ``"keyword"`` (``fn(prompts=..., completions=..., completion_ids=..., **cols)``, TRL's style).
    A callable may list the columns it reads in ``required_columns`` (the built-ins do).
    Raises :class:`RewardError` naming the function when neither binds or a column is missing.
    ``columns_known=False``: ``column_names`` are a guess (before the data is read); the error lists none.
    """
    required_columns = getattr(fn, "required_columns", ()) if check_required else ()
    absent = [c for c in required_columns if c not in column_names]
    if absent:
        raise RewardError(
            f"reward function {name!r} reads column(s) {absent}, which the dataset does not have "
            f"(columns: {sorted(column_names)})"
        )
    sig = _signature(fn)
    if sig is None:
        return "positional", tuple(column_names)
    params = sig.parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    cols = tuple(c for c in column_names if var_kw or c in named)
    clash = [c for c in cols if c in _STANDARD_ARGS]
    if clash:
        raise RewardError(
            f"reward function {name!r}: dataset column(s) {clash} clash with the reward arguments "
            f"{_STANDARD_ARGS}; rename the column(s)"
        )
    dummy = {c: None for c in cols}
    if _bindable(sig, None, None, None, **dummy):
        return "positional", cols
    if _bindable(sig, **dict.fromkeys(_STANDARD_ARGS), **dummy):
        return "keyword", cols
    # Say what is wrong: required parameters that nothing provides, or too few positionals.
    required = [
        n for n, p in params.items()
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    positional = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 3:
        wanted = [n for n in required if n not in positional[:3]]
    else:
        wanted = [n for n in required if n not in _STANDARD_ARGS]
    missing = [n for n in wanted if n not in cols]
    close = [m for name in missing for m in difflib.get_close_matches(name, list(column_names), n=1)]
    detail = (
        f" It requires {missing}, which {'is not a' if len(missing) == 1 else 'are not'} dataset "
        f"column{'' if len(missing) == 1 else 's'} (columns: {sorted(column_names)}"
        + (f"; did you mean {', '.join(map(repr, close))}?" if close else "") + ")."
        if missing and columns_known else ""
    )
    raise RewardError(
        f"reward function {name!r} has signature {name}{sig}: it must accept {_PROTOCOL} "
        f"(or name the dataset columns it reads as parameters instead of **columns).{detail}"
    )


def _check_signature(name: str, fn: RewardFunction) -> None:
    """At construction the columns are unknown: assume that every extra required parameter is one."""
    sig = _signature(fn)
    if sig is None:
        return
    params = list(sig.parameters.values())
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    # Called positionally, the first three positional parameters take the standard arguments;
    # called by keyword (TRL style), the standard names do.
    as_positional = [p.name for p in required if p not in positional[:3]]
    as_keyword = [p.name for p in required if p.name not in _STANDARD_ARGS]
    try:
        call_plan(name, fn, as_positional, check_required=False, columns_known=False)
    except RewardError as first:
        try:
            call_plan(name, fn, as_keyword, check_required=False, columns_known=False)
        except RewardError:
            raise first from None


def invoke(fn: RewardFunction, mode: str, prompts, completions, completion_ids, columns: Mapping) -> list:
    """Call ``fn`` as :func:`call_plan` decided; the values as a list (not yet checked).

    ``mode == "call"``: ``fn(**columns)`` as it returns (a tool call in a worker process, see
    :mod:`rloo_lightning.environments.tools`)."""
    if mode == "call":
        return fn(**columns)
    if mode == "keyword":
        values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    else:
        values = fn(prompts, completions, completion_ids, **columns)
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().reshape(-1).tolist()
    return list(values)


def reward_number(value) -> float | None:
    """``value`` as a float when it is a real number: ``int``, ``float``, ``bool``, a numpy scalar (or 0-d array)
    of a bool, integer or floating dtype, or a 0-d torch tensor of a real dtype; None for anything else (a string
    such as ``"0.5"``, a complex, a list, a tensor of several values): a value is used as it is, never parsed."""
    if isinstance(value, (numbers.Real, np.bool_)):  # int, float, bool, Fraction, numpy's real scalars
        return float(value)
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.ndim == 0 and not value.dtype.is_complex else None
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "biuf":  # bool, int, uint, float
        return float(value.item())
    return None


def to_floats(name: str, values: Sequence, prompts: Sequence[str], offset: int = 0,
              total: int | None = None) -> list[float]:
    """Check one function's values; ``None`` -> NaN. ``offset`` is the chunk's first completion."""
    n = len(prompts)
    if len(values) != n:
        where = f" (completions {offset}..{offset + n - 1} of {total})" if total is not None and total != n else ""
        raise RewardError(
            f"reward function {name!r} returned {len(values)} values for {n} completions{where} "
            f"(first prompt {short_repr(prompts[0]) if n else None}); it must return one value per completion"
        )
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
            continue
        f = reward_number(v)
        if f is None:
            raise RewardError(
                f"reward function {name!r} returned {short_repr(v)} ({type(v).__name__}) for completion "
                f"{offset + i} (prompt {short_repr(prompts[i])}): a reward is a number (int, float, bool, a numpy "
                "or 0-d torch scalar) or None for a missing one; convert it in the function"
            )
        if not math.isfinite(f):
            raise RewardError(
                f"reward function {name!r} returned {f} for completion {offset + i} of prompt "
                f"{short_repr(prompts[i])}; return None to mark a missing reward"
            )
        out.append(f)
    return out
