"""A weighted combination of reward functions, optionally run in worker processes with a timeout."""

from __future__ import annotations

import math
import pickle
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rloo_lightning.options import parse_on_error
from rloo_lightning.runtime.workers import WorkerPool
from rloo_lightning.rewards.protocol import (
    RewardError,
    RewardFunction,
    RewardSpec,
    RewardTimeoutError,
    RewardWarning,
    call_plan,
    invoke,
    resolve_reward,
    short_repr,
    to_floats,
)

__all__ = ["RewardSet"]


def _parse_on_error(on_error: str | float | None) -> tuple[str, float | None]:
    """``("raise", None)``, ``("value", None)`` (None = missing) or ``("value", x)``."""
    try:
        return parse_on_error("rewards.on_error", on_error)
    except ValueError as err:
        raise RewardError(str(err)) from None


# -- the weighted set --------------------------------------------------------------------------
@dataclass
class RewardSet:
    """Several reward functions combined as a weighted sum ``r = sum_f w_f * r_f``.

    A completion whose score is ``None`` under any function gets ``NaN`` in the total, so that
    it is left out of its group's baseline rather than counted as 0 (which would bias it).

    Attributes:
        names, funcs, weights: one entry per function.
        specs: what each function was built from (sent to worker processes, which rebuild it).
        timeout: seconds one call (one function on one chunk) may run, or None. Needs a process
            it can kill, so a timeout runs the functions in at least one worker process.
        num_workers: worker processes for the functions (see :mod:`rloo_lightning.runtime.workers`);
            0 = in this process. Functions with ``run_in_main_process = True`` (the reward model)
            always run in this process, without a timeout, while the workers run the others.
        on_error: what an exception or a timeout scores: ``"raise"`` (default), ``"none"``
            (missing reward) or a float; a warning names the function, prompt and cause.
            Protocol errors (wrong count, NaN) always raise.
        chunk_size: completions per worker call (default: the batch split evenly over the
            workers). The timeout applies to one call; a timed-out call scores all of its chunk.
        start_method: ``"forkserver"`` (default where available) or ``"spawn"``.
    """

    names: list[str]
    funcs: list[RewardFunction]
    weights: list[float]
    specs: list[Any] | None = None
    timeout: float | None = None
    num_workers: int = 0
    on_error: str | float | None = "raise"
    chunk_size: int | None = None
    start_method: str | None = None
    _plans: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _pool: Any = field(default=None, init=False, repr=False, compare=False)
    _warned_no_reward: set = field(default_factory=set, init=False, repr=False, compare=False)
    _scored_by_on_error: set = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.timeout is not None and not self.timeout > 0:
            raise RewardError(f"rewards.timeout must be > 0 seconds or None, got {self.timeout!r}")
        if self.num_workers < 0:
            raise RewardError(f"rewards.workers (num_workers) must be >= 0, got {self.num_workers}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise RewardError(f"rewards.chunk_size must be >= 1 or None, got {self.chunk_size}")
        if self.start_method not in (None, "spawn", "forkserver"):
            raise RewardError(
                f"reward start_method must be 'forkserver', 'spawn' or None, got {self.start_method!r} "
                "('fork' can hang a process that already ran torch)"
            )
        self._on_error = _parse_on_error(self.on_error)
        if self.specs is None:
            self.specs = list(self.funcs)
        # Which functions leave this process: all, when workers are in use, except those that ask
        # to stay (a reward model on the GPU: ``run_in_main_process = True``).
        self._remote = [
            self.uses_workers and not getattr(fn, "run_in_main_process", False) for fn in self.funcs
        ]
        for i, remote in enumerate(self._remote):
            spec = self.specs[i]
            if remote and not isinstance(spec, (str, Mapping)):
                try:
                    pickle.dumps(spec)
                except Exception as err:
                    raise RewardError(
                        f"reward function {self.names[i]!r} cannot be sent to a worker process (reward "
                        f"timeout/workers are set): {err!r}. Define it at the top level of an importable "
                        "module and give its import path 'package.module.function'."
                    ) from err

    @property
    def uses_workers(self) -> bool:
        return self.num_workers > 0 or self.timeout is not None

    @classmethod
    def from_specs(
        cls,
        specs: Sequence[RewardSpec],
        weights: Sequence[float] | None = None,
        timeout: float | None = None,
        num_workers: int = 0,
        on_error: str | float | None = "raise",
        chunk_size: int | None = None,
        start_method: str | None = None,
    ) -> RewardSet:
        """Resolve and check every spec now, so a typo fails before any model is loaded."""
        if not specs:
            raise RewardError("rewards.funcs is empty: give at least one reward function (import path)")
        if isinstance(specs, (str, Mapping)) or callable(specs):
            specs = [specs]
        resolved = [resolve_reward(s) for s in specs]
        names = [n for n, _ in resolved]
        # Two functions with one name (e.g. two instances of a class) are logged apart.
        names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
        if weights is None:
            weights = [1.0] * len(resolved)
        if len(weights) != len(resolved):
            raise RewardError(f"rewards.weights has {len(weights)} values for {len(resolved)} rewards.funcs")
        for w in weights:
            if not math.isfinite(float(w)):
                raise RewardError(f"rewards.weights must be finite, got {list(weights)}")
        return cls(
            names, [f for _, f in resolved], [float(w) for w in weights], specs=list(specs),
            timeout=timeout, num_workers=num_workers, on_error=on_error, chunk_size=chunk_size,
            start_method=start_method,
        )

    # -- scoring -------------------------------------------------------------------------------
    def plan(self, i: int, column_names: Sequence[str]) -> tuple[str, tuple[str, ...]]:
        key = (i, tuple(column_names))
        if key not in self._plans:
            self._plans[key] = call_plan(self.names[i], self.funcs[i], column_names)
        return self._plans[key]

    def check_columns(self, column_names: list[str], source: str) -> None:
        """Every function's signature against the data's columns (``source`` names the data), before any model
        is loaded: a missing column is an error now, not after the first generation."""
        for i in range(len(self.funcs)):
            try:
                self.plan(i, list(column_names))
            except RewardError as err:
                raise RewardError(f"{err} [data: {source}]") from None

    def score(self, prompts, completions, completion_ids, columns: dict) -> tuple[torch.Tensor, dict]:
        """Score ``B`` completions.

        Returns:
            ``total`` ``[B]`` float32 weighted sum (NaN where any function gave None) and
            ``per_func`` ``{name: [B] float32}`` (NaN where that function gave None).
        """
        prompts, completions, completion_ids = list(prompts), list(completions), list(completion_ids)
        n = len(completions)
        columns = dict(columns or {})
        if len(prompts) != n or len(completion_ids) != n:
            raise RewardError(
                f"rewards: {len(prompts)} prompts, {len(completions)} completions and {len(completion_ids)} "
                "completion_ids: expected one of each per completion"
            )
        for c, values in columns.items():
            if len(values) != n:
                raise RewardError(f"rewards: column {c!r} has {len(values)} values for {n} completions")
        # Every signature is checked against the columns before any function runs.
        plans = [self.plan(i, list(columns)) for i in range(len(self.funcs))]
        values: list[list[float] | None] = [None] * len(self.funcs)
        self._scored_by_on_error.clear()

        remote = [i for i, r in enumerate(self._remote) if r]
        if remote and n:
            values_remote = self._score_in_workers(remote, plans, prompts, completions, completion_ids, columns)
            for i, v in values_remote.items():
                values[i] = v
        for i, fn in enumerate(self.funcs):
            if values[i] is not None:
                continue
            mode, cols = plans[i]
            try:
                raw = invoke(fn, mode, prompts, completions, completion_ids, {c: columns[c] for c in cols})
            except Exception as err:
                values[i] = self._failed(i, prompts, 0, n, err, "raised")
                continue
            values[i] = to_floats(self.names[i], raw, prompts)

        for i, (name, v) in enumerate(zip(self.names, values)):
            # (a call that raised or timed out and was scored by on_error has warned already)
            if (n and name not in self._warned_no_reward and i not in self._scored_by_on_error
                    and all(math.isnan(x) for x in v)):
                self._warned_no_reward.add(name)
                warnings.warn(
                    f"reward function {name!r} gave no reward (None) for every one of the {n} completions of "
                    "this call: with no valid value there is no learning signal (train/reward and val/reward NaN); "
                    "it should return a float per completion, None only where a completion cannot be scored",
                    RewardWarning, stacklevel=2,
                )
        per_func = {name: torch.tensor(v, dtype=torch.float32) for name, v in zip(self.names, values)}
        if per_func:
            total = sum(w * per_func[name] for name, w in zip(self.names, self.weights))
        else:
            total = torch.zeros(n)
        return total, per_func

    def _failed(self, i: int, prompts, start: int, stop: int, err: BaseException | None, how: str,
                tb: str | None = None) -> list[float]:
        """Handle an exception / timeout of function ``i`` on completions ``start:stop`` per ``on_error``."""
        name, prompt = self.names[i], short_repr(prompts[start]) if stop > start else None
        n = len(prompts)
        span = f" (completions {start}..{stop - 1} of {n})" if stop - start != n else ""
        if how == "timeout":
            msg = f"reward function {name!r} timed out after {self.timeout:g} s on prompt {prompt}{span}"
        elif how == "died":
            msg = f"reward function {name!r}: its worker process died ({err}) on prompt {prompt}{span}"
        else:
            msg = f"reward function {name!r} raised on prompt {prompt}{span}: {err!r}"
            if tb:
                msg += f"\nworker traceback:\n{tb}"
        action, value = self._on_error
        self._scored_by_on_error.add(i)
        if action == "raise":
            exc = RewardTimeoutError(msg + "; set on_error to 'none' or a float to score it instead") if how == \
                "timeout" else RewardError(msg)
            if isinstance(err, BaseException):
                raise exc from err
            raise exc
        warnings.warn(f"{msg}; scored as {'None (missing)' if value is None else value}", RewardWarning,
                      stacklevel=3)
        return [math.nan if value is None else value] * (stop - start)

    def _score_in_workers(self, indices, plans, prompts, completions, completion_ids, columns) -> dict:
        if self._pool is None or self._pool.closed:
            payloads = {i: self.specs[i] for i in indices}
            self._pool = WorkerPool(payloads, names=dict(enumerate(self.names)),
                                    num_workers=max(1, self.num_workers), start_method=self.start_method)
        n = len(prompts)
        size = self.chunk_size or max(1, math.ceil(n / self._pool.num_workers))
        tasks = []
        for i in indices:
            mode, cols = plans[i]
            for start in range(0, n, size):
                stop = min(n, start + size)
                chunk = (prompts[start:stop], completions[start:stop], completion_ids[start:stop],
                         {c: list(columns[c][start:stop]) for c in cols})
                tasks.append((i, start, stop, mode, chunk))
        outcomes = self._pool.run([(i, mode, chunk) for i, _, _, mode, chunk in tasks], timeout=self.timeout)
        out = {i: [math.nan] * n for i in indices}
        for (i, start, stop, _, _), (status, payload) in zip(tasks, outcomes):
            if status == "ok":
                vals = to_floats(self.names[i], payload, prompts[start:stop], offset=start, total=n)
            elif status == "error":
                err, tb = payload
                vals = self._failed(i, prompts, start, stop, err, "raised", tb)
            else:  # "timeout" or "died"
                vals = self._failed(i, prompts, start, stop, payload, status)
            out[i][start:stop] = vals
        return out

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker processes (also done at exit, and when the set is garbage-collected)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> RewardSet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self) -> dict:
        # Processes and pipes do not pickle (a spawned/copied module): a copy starts its own pool.
        state = self.__dict__.copy()
        state["_pool"] = None
        return state
