"""Rewards: the reward-function protocol and a weighted combination of reward functions.

A reward function is any callable

    fn(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **columns)
        -> list[float | None]

called once per rollout with one entry per completion (``B*k``, prompt-major), where
``columns`` are the dataset's extra columns, repeated so that ``columns[c][i]`` belongs to
completion ``i``. ``None`` means "no reward": the completion is left out of its group's
leave-one-out baseline and gets advantage 0. Functions are given as callables or as import
paths ``"package.module.function"`` (an import path executes that module's code).
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["RewardFunction", "resolve_reward", "RewardSet"]

RewardFunction = Callable[..., Sequence[float | None]]


def resolve_reward(spec: str | RewardFunction) -> tuple[str, RewardFunction]:
    """``(name, callable)`` for a callable or an import path ``"pkg.module.attr"``.

    Raises ``ValueError`` naming the path when it cannot be imported or is not callable.
    """
    if callable(spec):
        return getattr(spec, "__name__", type(spec).__name__), spec
    if not isinstance(spec, str) or "." not in spec:
        raise ValueError(f"reward function {spec!r}: expected a callable or an import path 'module.attr'")
    module_name, _, attr = spec.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward function {spec!r} cannot be imported: {err}") from err
    if inspect.isclass(fn):
        fn = fn()
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable")
    return attr, fn


@dataclass
class RewardSet:
    """Several reward functions combined as a weighted sum ``r = sum_f w_f * r_f``.

    A completion whose score is ``None`` under any function gets ``NaN`` in the total, so that
    it is left out of its group's baseline rather than counted as 0 (which would bias it).
    """

    names: list[str]
    funcs: list[RewardFunction]
    weights: list[float]

    @classmethod
    def from_specs(cls, specs: Sequence[str | RewardFunction], weights: Sequence[float] | None = None):
        if not specs:
            raise ValueError("reward_funcs is empty: give at least one reward function (import path)")
        resolved = [resolve_reward(s) for s in specs]
        names = [n for n, _ in resolved]
        # Two functions with one name (e.g. two instances of a class) are logged apart.
        names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
        if weights is None:
            weights = [1.0] * len(resolved)
        if len(weights) != len(resolved):
            raise ValueError(f"reward_weights has {len(weights)} values for {len(resolved)} reward_funcs")
        return cls(names, [f for _, f in resolved], [float(w) for w in weights])

    def score(self, prompts, completions, completion_ids, columns: dict) -> tuple[torch.Tensor, dict]:
        """Score ``B`` completions.

        Returns:
            ``total`` ``[B]`` float32 weighted sum (NaN where any function gave None) and
            ``per_func`` ``{name: [B] float32}`` (NaN where that function gave None).
        """
        per_func = {}
        for name, fn in zip(self.names, self.funcs):
            try:
                values = fn(prompts, completions, completion_ids, **columns)
            except Exception as err:
                raise RuntimeError(f"reward function {name!r} raised on prompt {prompts[0]!r}: {err!r}") from err
            values = list(values)
            if len(values) != len(completions):
                raise ValueError(
                    f"reward function {name!r} returned {len(values)} values for {len(completions)} completions"
                )
            out = []
            for i, v in enumerate(values):
                if v is None:
                    out.append(math.nan)
                    continue
                v = float(v)
                if not math.isfinite(v):
                    raise ValueError(
                        f"reward function {name!r} returned {v} for completion {i} of prompt {prompts[i]!r}; "
                        "return None to mark a missing reward"
                    )
                out.append(v)
            per_func[name] = torch.tensor(out, dtype=torch.float32)
        total = sum(w * per_func[n] for n, w in zip(self.names, self.weights))
        return total, per_func
