"""The tool environment: an episode in which the policy calls tools before it answers, each call run (in a worker
process with a timeout and a memory limit, by default) and answered with its result or an error message; see
:mod:`rloo_lightning.environments.tools` for the call format and the error kinds.
"""

from __future__ import annotations

import json
import threading
from typing import Any, ClassVar, Sequence

from rloo_lightning.environments.base import EnvironmentConfigError, EnvStep, Environment, Message, PolicyTurn
from rloo_lightning.environments.tools.parsing import ToolCall, describe_error, read_calls
from rloo_lightning.environments.tools.schema import resolve_tools, tool_schema
from rloo_lightning.environments.tools.validation import argument_error, short_value

__all__ = ["ERROR_KINDS", "ToolEnvironment"]

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "exception", "timeout")


# -- results ---------------------------------------------------------------------------------------------------------
def _clean(text: str) -> str:
    """``text`` that encodes as UTF-8 (a lone surrogate is written as ``\\udXXX``), for the tokenizer."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _as_text(value: Any) -> str:
    """A tool's result as the policy reads it: a string as it is, else JSON, else ``str()``; raises if none."""
    if isinstance(value, str):
        return _clean(str.__str__(value))
    try:
        return _clean(json.dumps(value))
    except Exception:  # noqa: BLE001 - not JSON (a set, bytes, an object, nested too deeply...)
        return _clean(str(value))


class _Shared:
    """The tools of one configuration, shared by all its episodes: functions, schemas and the worker pool."""

    __slots__ = ("paths", "memory_mb", "functions", "schemas", "pool", "use_pool", "lock")

    def __init__(self, paths: tuple[str, ...], use_pool: bool, memory_mb: int | None) -> None:
        self.paths, self.use_pool, self.memory_mb = paths, use_pool, memory_mb
        self.lock = threading.Lock()  # one call at a time in the one worker (episodes may step concurrently)
        self.functions = resolve_tools(paths)
        self.schemas = {name: tool_schema(fn) for name, fn in self.functions.items()}
        self.pool = None
        if use_pool:
            self.start_pool()

    def start_pool(self) -> None:
        from rloo_lightning.runtime.workers import WorkerPool

        if self.pool is not None:
            self.pool.close()
        self.pool = WorkerPool(dict(enumerate(self.paths)), dict(enumerate(self.functions)), 1,
                               memory_mb=self.memory_mb)


class ToolEnvironment(Environment):
    """An episode in which the policy may call ``tools`` before it answers (the call format: the package docstring).

    Args:
        tools: import paths of the tool functions (``pkg.module.function``).
        timeout: seconds one call may run, in a worker process that is killed on timeout (None: calls run in this
            process, with no limit of time or memory).
        max_calls: the most calls of an episode, each call of a turn counted; a further call is answered with an
            error and ends the episode (None: no limit but ``environment.max_turns``).
        memory_mb: MiB of address space a call may add in its worker process, on top of what the worker maps
            after its start-up (its imports; measured: see ``docs/tools.md``, "Memory limit"):
            ``RLIMIT_AS`` of the worker is set to that size plus ``memory_mb``. Past it an allocation raises
            ``MemoryError`` in the tool, reported as ``exception``. Counts address space, not resident memory
            (thread stacks and malloc arenas count). None: no limit. Linux only; no effect without a worker
            (``timeout=None``).

    Rewards come from ``model.rewards.funcs``, which score the episode's last turn (its answer) and see the whole
    transcript; this environment pays nothing itself. Per episode it counts ``tool_calls``, ``tool_errors`` and
    each kind ``tool_errors/<kind>``, and ``tool_timeouts``, logged as ``train/<name>``.
    """

    metric_names: ClassVar[tuple[str, ...]] = ("tool_calls", "tool_errors", "tool_timeouts",
                                               *(f"tool_errors/{k}" for k in ERROR_KINDS))
    _pools: ClassVar[dict] = {}

    def __init__(self, tools: Sequence[str], timeout: float | None = 10.0, max_calls: int | None = None,
                 memory_mb: int | None = 4096) -> None:
        self._check_limits(timeout, max_calls, memory_mb)
        self.paths, self.timeout, self.max_calls, self.memory_mb = tuple(tools), timeout, max_calls, memory_mb
        key = (self.paths, timeout, memory_mb if timeout is not None else None)
        if key not in self._pools:  # one set of tools (and one worker) for every episode of this configuration
            self._pools[key] = _Shared(self.paths, timeout is not None, key[2])
        self._shared = self._pools[key]
        self.functions, self.schemas = self._shared.functions, self._shared.schemas

    @staticmethod
    def _check_limits(timeout, max_calls, memory_mb) -> None:
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise EnvironmentConfigError(f"timeout must be > 0 seconds or None, got {timeout!r}")
        if max_calls is not None and (isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1):
            raise EnvironmentConfigError(f"max_calls must be an integer >= 1 or None, got {max_calls!r}")
        if memory_mb is not None and (isinstance(memory_mb, bool) or not isinstance(memory_mb, int)
                                      or memory_mb < 1):
            raise EnvironmentConfigError(f"memory_mb must be an integer >= 1 (MiB) or None, got {memory_mb!r}")

    @classmethod
    def check_init_args(cls, init_args: dict) -> None:
        """The tools import, each has a schema, and the limits are valid: checked before any model loads (the
        worker process starts with the first episode)."""
        super().check_init_args(init_args)
        try:
            cls._check_limits(init_args.get("timeout", 10.0), init_args.get("max_calls"),
                              init_args.get("memory_mb", 4096))
            for fn in resolve_tools(init_args.get("tools")).values():
                tool_schema(fn)
        except EnvironmentConfigError as err:
            raise EnvironmentConfigError(f"environment.init_args: {err}") from err.__cause__

    @classmethod
    def check_data(cls, init_args: dict, datamodule) -> None:
        """Refuse a ``data.tools`` list (the schemas the prompts show) that names other tools than the
        environment runs: the policy would be shown tools it cannot call, or not shown ones it can."""
        shown = getattr(getattr(datamodule, "hparams", None), "get", lambda *_: None)("tools")
        if not shown:
            return
        runs = resolve_tools(init_args.get("tools"))
        listed = resolve_tools(shown)
        if {id(fn) for fn in runs.values()} != {id(fn) for fn in listed.values()}:
            raise EnvironmentConfigError(
                f"data.tools {list(shown)} differs from environment.init_args.tools {list(init_args['tools'])}: the "
                "prompts would list other tools than the environment runs; give both the same list")

    @property
    def pool(self):
        """The worker pool of this configuration (None without a timeout); replaced if it fails."""
        return self._shared.pool

    def reset(self, row: dict, seed: int) -> None:
        self.counts = dict.fromkeys(self.metric_names, 0.0)

    def metrics(self) -> dict[str, float]:
        return dict(self.counts)

    def _count_error(self, kind: str) -> str:
        self.counts["tool_errors"] += 1
        self.counts[f"tool_errors/{kind}"] += 1
        if kind == "timeout":
            self.counts["tool_timeouts"] += 1
        return kind

    def step(self, turn: PolicyTurn) -> EnvStep:
        calls = read_calls(turn.text)
        if not calls:
            return EnvStep(done=True)  # no call: the answer
        answers = [self._answer(call, malformed, name) for call, malformed, name in calls]
        done = any(ends for *_, ends in answers)
        if len(answers) == 1:
            name, kind, text, _ = answers[0]
            if kind is None:
                return EnvStep(observation=Message("tool", _clean(text)), done=done, info={"tool": name})
            return EnvStep(observation=Message("tool", _clean(f"error ({kind}): {text}")), done=done,
                           info={"tool_error": kind})
        listed, info = [], []
        for name, kind, text, _ in answers:
            name = name if name is None or name in self.functions else name[:100]  # no long garbage echoed
            listed.append({"name": name, "result": text} if kind is None
                          else {"name": name, "error": f"error ({kind}): {text}"})
            info.append({"tool": name, "tool_error": kind})
        content = _clean(json.dumps(listed, ensure_ascii=False))
        return EnvStep(observation=Message("tool", content), done=done, info={"tool_calls": info})

    def _answer(self, call: ToolCall | None, malformed: str | None,
                name: str | None) -> tuple[str | None, str | None, str, bool]:
        """One call: ``(name, error kind or None, result or error text, ends the episode)``; counts it."""
        self.counts["tool_calls"] += 1
        if self.max_calls is not None and self.counts["tool_calls"] > self.max_calls:
            limit = f"no more than {self.max_calls} tool calls per answer"
            return name, self._count_error("bad_arguments"), limit, True
        if malformed is not None:
            return name, self._count_error("malformed"), malformed, False
        fn = self.functions.get(call.name)
        if fn is None:
            return (call.name, self._count_error("unknown_tool"),
                    f"no tool named {short_value(call.name)}; tools: {', '.join(self.functions)}", False)
        wrong = argument_error(fn, self.schemas[call.name], call.arguments)
        if wrong is not None:
            return call.name, self._count_error("bad_arguments"), f"{call.name}: {wrong}", False
        status, value = self._run(call)
        if status == "timeout":
            stopped = f"{call.name} ran past {self.timeout} s and was stopped"
            return call.name, self._count_error("timeout"), stopped, False
        if status == "failed":
            return call.name, self._count_error("exception"), f"{call.name}: {value}", False
        if status != "ok":
            return call.name, self._count_error("exception"), f"{call.name} raised {value}", False
        try:
            return call.name, None, _as_text(value), False
        except Exception as err:  # noqa: BLE001 - a result with no text (its __str__ raises, too long an int...)
            return (call.name, self._count_error("exception"),
                    f"{call.name} returned a result that cannot be written as text ({describe_error(err)[:200]})",
                    False)

    def _run(self, call: ToolCall) -> tuple[str, Any]:
        """``("ok", value)``, ``("error", text)`` (the tool raised), ``("failed", text)`` (its worker died or
        failed) or ``("timeout", None)``."""
        if self.pool is None:
            try:
                return "ok", self.functions[call.name](**call.arguments)
            except (Exception, SystemExit) as err:  # the tool's own failure: reported to the policy
                return "error", describe_error(err)
        with self._shared.lock:
            return self._run_in_worker(call)

    def _run_in_worker(self, call: ToolCall) -> tuple[str, Any]:
        from rloo_lightning.rewards.protocol import RewardError

        if self.pool.closed:  # a failure (below) or an interrupt closed it
            self._shared.start_pool()
        index = list(self.functions).index(call.name)
        try:
            ((status, value),) = self.pool.run([(index, "call", (None, None, None, call.arguments))], self.timeout)
        except RewardError as err:  # the worker could not start: a configuration error, not the policy's
            raise RewardError(f"the tool worker for {list(self.functions)} could not start: {err}") from err
        except Exception as err:  # noqa: BLE001 - e.g. a result that cannot be unpickled here; the pool closed
            self._shared.start_pool()
            return "failed", f"the tool's worker failed and was restarted ({describe_error(err)[:200]})"
        if status == "error":
            return "error", describe_error(value[0])
        if status == "died":
            return "failed", f"the tool's worker died ({value}) and was replaced"
        return status, value
