"""Rewards: the reward-function protocol and a weighted combination of reward functions.

A reward function is any callable

    fn(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **columns)
        -> list[float | None]

called once per rollout with one entry per completion (``B*k``, prompt-major), where
``columns`` are the dataset's extra columns, repeated so that ``columns[c][i]`` belongs to
completion ``i``. ``None`` means "no reward": the completion is left out of its group's
leave-one-out baseline and gets advantage 0.

How a function is called is read from its signature, once per set of column names and
before any function runs:

* ``fn(prompts, completions, completion_ids, **columns)``: every column is passed.
* ``fn(prompts, completions, completion_ids, answer)`` (no ``**kwargs``): only the columns it
  names are passed; a required parameter that is not a column is an error naming it.
* TRL-style ``fn(completions, **kwargs)`` (fewer than three positional parameters): called with
  keywords ``prompts=, completions=, completion_ids=`` and the columns.

A reward function is given (``RLOOModule(rewards={"funcs": [...]})``, ``--model.rewards.funcs``) as

* a callable;
* an import path ``"package.module.function"`` (a class there is instantiated with no
  arguments);
* ``{"class_path": "package.module.Class", "init_args": {...}}``: a class configured from YAML
  (``init_args`` on a function binds them with :func:`functools.partial`); an optional
  ``"name"`` key sets the name it is logged under (``train/score/<name>``).

Import paths execute that module's code. Built-in rule rewards are in
:mod:`rloo_lightning.rewards.builtin`, a reward model in :mod:`rloo_lightning.rewards.model`,
reward shaping (missing-EOS and overlong penalties, clipping) in
:mod:`rloo_lightning.rewards.shaping`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import pickle
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "RewardFunction",
    "RewardSpec",
    "RewardError",
    "RewardTimeoutError",
    "RewardWarning",
    "resolve_reward",
    "RewardSet",
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
    """A reward call failed or timed out and was scored by ``on_error`` instead of raising."""


def _short(text: Any, limit: int = 200) -> str:
    """``repr`` of a prompt, cut to ``limit`` characters: error messages stay readable."""
    r = repr(text)
    return r if len(r) <= limit else r[: limit - 5] + "...'"


# -- resolving specs ---------------------------------------------------------------------------
def _import_object(path: str, what: str) -> Any:
    """The object at ``"pkg.module.attr[.attr...]"``: the longest importable module prefix, then attributes."""
    if not isinstance(path, str) or "." not in path.strip("."):
        raise RewardError(f"{what} {path!r}: expected an import path 'package.module.name'")
    parts = path.split(".")
    errors = []
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            # Only "this very module is missing" means: try a shorter prefix. A missing
            # dependency *inside* an existing module is the user's real error.
            if err.name is not None and (module_name == err.name or module_name.startswith(err.name + ".")):
                errors.append(err)
                continue
            raise RewardError(f"{what} {path!r} cannot be imported: {err}") from err
        except Exception as err:  # the module itself failed while executing
            raise RewardError(f"{what} {path!r}: importing {module_name!r} failed: {err!r}") from err
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError as err:
            raise RewardError(f"{what} {path!r} cannot be imported: {err}") from err
        return obj
    raise RewardError(f"{what} {path!r} cannot be imported: {errors[-1] if errors else 'no module'}") from (
        errors[-1] if errors else None
    )


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


def _resolve(spec: RewardSpec) -> tuple[str, RewardFunction]:
    """``(name, callable)`` for any accepted spec form."""
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
        obj = _import_object(spec["class_path"], "reward function")
        fn = _instantiate(obj, dict(init_args), spec["class_path"])
        name = spec.get("name") or (obj.__name__ if inspect.isclass(obj) else _name_of(obj))
        where = spec["class_path"]
    elif isinstance(spec, str):
        obj = _import_object(spec, "reward function")
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
    name, fn = _resolve(spec)
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
              check_required: bool = True) -> tuple[str, tuple[str, ...]]:
    """How to call ``fn`` given these dataset columns: ``(mode, columns to pass)``.

    ``mode`` is ``"positional"`` (``fn(prompts, completions, completion_ids, **cols)``) or
    ``"keyword"`` (``fn(prompts=..., completions=..., completion_ids=..., **cols)``, TRL's style).
    A callable may list the columns it reads in ``required_columns`` (the built-ins do).
    Raises :class:`RewardError` naming the function when neither binds or a column is missing.
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
    detail = (
        f" It requires {missing}, which {'is not a' if len(missing) == 1 else 'are not'} dataset "
        f"column{'' if len(missing) == 1 else 's'} (columns: {sorted(column_names)})."
        if missing else ""
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
        call_plan(name, fn, as_positional, check_required=False)
    except RewardError as first:
        try:
            call_plan(name, fn, as_keyword, check_required=False)
        except RewardError:
            raise first from None


def invoke(fn: RewardFunction, mode: str, prompts, completions, completion_ids, columns: Mapping) -> list:
    """Call ``fn`` as :func:`call_plan` decided; the values as a list (not yet checked)."""
    if mode == "keyword":
        values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    else:
        values = fn(prompts, completions, completion_ids, **columns)
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().reshape(-1).tolist()
    return list(values)


def to_floats(name: str, values: Sequence, prompts: Sequence[str], offset: int = 0,
              total: int | None = None) -> list[float]:
    """Check one function's values; ``None`` -> NaN. ``offset`` is the chunk's first completion."""
    n = len(prompts)
    if len(values) != n:
        where = f" (completions {offset}..{offset + n - 1} of {total})" if total is not None and total != n else ""
        raise RewardError(
            f"reward function {name!r} returned {len(values)} values for {n} completions{where} "
            f"(first prompt {_short(prompts[0]) if n else None}); it must return one value per completion"
        )
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
            continue
        try:
            f = float(v)
        except (TypeError, ValueError) as err:
            raise RewardError(
                f"reward function {name!r} returned {v!r} for completion {offset + i} (prompt "
                f"{_short(prompts[i])}): expected a float or None"
            ) from err
        if not math.isfinite(f):
            raise RewardError(
                f"reward function {name!r} returned {f} for completion {offset + i} of prompt "
                f"{_short(prompts[i])}; return None to mark a missing reward"
            )
        out.append(f)
    return out


def _parse_on_error(on_error: str | float | None) -> tuple[str, float | None]:
    """``("raise", None)``, ``("value", None)`` (None = missing) or ``("value", x)``."""
    if on_error is None:
        return "value", None
    if isinstance(on_error, bool):
        raise RewardError(f"rewards.on_error must be 'raise', 'none' or a float, got {on_error!r}")
    if isinstance(on_error, (int, float)):
        value = float(on_error)
    elif isinstance(on_error, str) and on_error.strip().lower() == "raise":
        return "raise", None
    elif isinstance(on_error, str) and on_error.strip().lower() in ("none", "null", "nan", "missing"):
        return "value", None
    else:
        try:
            value = float(on_error)
        except (TypeError, ValueError):
            raise RewardError(
                f"rewards.on_error must be 'raise', 'none' (missing reward) or a float, got {on_error!r}"
            ) from None
    if not math.isfinite(value):
        raise RewardError(f"rewards.on_error must be finite (use 'none' for a missing reward), got {on_error!r}")
    return "value", value


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
        num_workers: worker processes for the functions (see :mod:`rloo_lightning.rewards.parallel`);
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

        per_func = {name: torch.tensor(v, dtype=torch.float32) for name, v in zip(self.names, values)}
        if per_func:
            total = sum(w * per_func[name] for name, w in zip(self.names, self.weights))
        else:
            total = torch.zeros(n)
        return total, per_func

    def _failed(self, i: int, prompts, start: int, stop: int, err: BaseException | None, how: str,
                tb: str | None = None) -> list[float]:
        """Handle an exception / timeout of function ``i`` on completions ``start:stop`` per ``on_error``."""
        name, prompt = self.names[i], _short(prompts[start]) if stop > start else None
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
        from rloo_lightning.rewards.parallel import WorkerPool

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
