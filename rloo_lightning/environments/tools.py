"""Tool use: plain Python functions as tools, called by the policy in a multi-turn episode.

A tool is a typed function with a Google-style docstring (its ``Args:`` describe the parameters); its JSON schema
is read from them (``transformers.utils.get_json_schema``). The policy calls a tool by writing, in its turn::

    <tool_call>{"name": "calculator", "arguments": {"expression": "7 * 8"}}</tool_call>

The call runs (in a worker process with a timeout and a memory limit, by default), and its result comes back as a
``tool`` message; the policy goes on. A turn without a call is the policy's answer and ends the episode.

**Several calls in one turn** all run, in the order written, and each counts as a call (``max_calls`` too). With
one call the tool message is its result as it is (a string as it is, anything else as JSON) or its error message.
With several, the message is a JSON list with one object per call, in call order: ``{"name": <tool name>,
"result": <the text one call would have shown>}`` or ``{"name": <tool name, or null if it could not be read>,
"error": "error (<kind>): ..."}``, e.g.
``[{"name": "add", "result": "3"}, {"name": "divide", "error": "error (exception): divide raised ..."}]``.

Whatever goes wrong with a call becomes an error message to the policy, ``error (<kind>): ...``, and a metric,
never an exception out of :meth:`ToolEnvironment.step` (a policy under RL writes anything):

=====================  =====================================================================================
kind                   when
=====================  =====================================================================================
``malformed``          a ``<tool_call>`` that is not closed, not JSON (also JSON nested too deeply for the
                       parser, or an integer of more than 4300 digits), nested more than 64 levels deep, or not
                       ``{"name": ..., "arguments": {...}}``
``unknown_tool``       a name that is not one of the tools
``bad_arguments``      arguments the function's signature does not accept, or that do not fit its JSON schema
                       (below); a call past ``max_calls`` (which also ends the episode)
``exception``          the tool raised (a ``MemoryError`` past ``memory_mb`` too), its worker died or failed, or
                       its result cannot be written as text
``timeout``            the call ran past ``timeout`` seconds: its worker is killed and replaced
=====================  =====================================================================================

**Argument checks.** Before a tool runs, its arguments are checked against its schema, the subset that
``get_json_schema`` writes: ``type`` (a name, or a list of names for a ``Union``: the value must fit one of them;
``bool`` is not an ``integer`` or a ``number``; ``"null"`` allows ``null``), ``nullable`` (``Optional``),
``enum`` (``Literal`` and ``Enum``), ``anyOf`` / ``oneOf`` (a ``Union`` of lists, dicts, literals...: the value
must fit at least one), ``items`` and ``prefixItems`` (``list[int]``, ``tuple[int, str]``) and
``properties`` / ``additionalProperties`` (``dict[str, int]``), checked in depth. What a schema does not say (no
``type``, an unknown key) is not checked.

**Security.** A tool is your code, run with the policy's arguments: treat the arguments as untrusted input. Never
``eval`` or ``exec`` model output, never pass it to a shell; parse it (the built-in :func:`calculator` parses
arithmetic with :mod:`ast` and evaluates only numbers and ``+ - * / // % **`` with bounded exponents, to a finite
real number). The worker process bounds the time of a call and its address space (``memory_mb``), not what it
can touch.

Schemas reach the prompt through ``data.tools`` (the same import paths): a chat template that takes ``tools``
renders them itself; otherwise :func:`tool_prompt` writes them, with the call format above, as a system message.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import operator
import re
import sys
import threading
from typing import Any, Callable, ClassVar, Sequence

from rloo_lightning.environments.base import EnvironmentConfigError, EnvStep, Environment, Message, PolicyTurn

__all__ = ["ToolEnvironment", "ToolCall", "calculator", "parse_tool_call", "parse_tool_calls", "tool_prompt",
           "tool_schema", "resolve_tools", "tool_schemas", "ERROR_KINDS", "MAX_ARGUMENT_DEPTH"]

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "exception", "timeout")
MAX_ARGUMENT_DEPTH = 64  # arguments nested deeper are a malformed call (they could not even be sent to a worker)
_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict, "null": type(None)}


def resolve_tools(paths: Sequence[str]) -> dict[str, Callable]:
    """``{name: function}`` for import paths ``pkg.module.function``; errors (:class:`EnvironmentConfigError`)
    name the path."""
    from rloo_lightning.rewards.protocol import RewardError, _import_object

    if isinstance(paths, str) or not paths:
        raise EnvironmentConfigError(f"tools must be a non-empty list of import paths 'package.module.function', "
                                     f"got {paths!r}")
    tools = {}
    for path in paths:
        try:
            fn = _import_object(path, "tool")
        except RewardError as err:  # the importer is shared with reward functions; this is a tool's error
            raise EnvironmentConfigError(str(err)) from err.__cause__
        if not callable(fn):
            raise EnvironmentConfigError(f"tool {path!r} is not callable")
        name = fn.__name__
        if name in tools:
            raise EnvironmentConfigError(f"two tools are named {name!r}: {path!r} and another; tool names must be "
                                         "unique")
        tools[name] = fn
    return tools


def tool_schema(fn: Callable) -> dict:
    """The JSON schema of a tool (``{"type": "function", "function": {"name", "description", "parameters"}}``),
    from its type hints and its docstring's ``Args:``."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:
        raise EnvironmentConfigError(f"tool {getattr(fn, '__name__', fn)!r}: its schema needs a type hint for every "
                                     f"parameter and a docstring with a description and an Args: section ({err})"
                                     ) from err


def tool_schemas(paths: Sequence[str]) -> list[dict]:
    """The schemas of the tools at ``paths`` (``data.tools``), in order."""
    return [tool_schema(fn) for fn in resolve_tools(paths).values()]


def tool_prompt(schemas: Sequence[dict]) -> str:
    """The fallback system text for a chat template that takes no ``tools``: the schemas and the call format."""
    listed = "\n".join(json.dumps(s["function"] if "function" in s else s) for s in schemas)
    return ("You can call these tools:\n" + listed + "\nTo call one, write <tool_call>{\"name\": <tool name>, "
            "\"arguments\": {<argument>: <value>}}</tool_call> and stop. The result comes back in a tool message. "
            "When you have the answer, write it without a tool call.")


class ToolCall:
    """A parsed call: ``name`` and ``arguments`` (a dict)."""

    __slots__ = ("name", "arguments")

    def __init__(self, name: str, arguments: dict) -> None:
        self.name, self.arguments = name, arguments


# -- reading calls -------------------------------------------------------------------------------------------------
def _describe(err: BaseException) -> str:
    """``"Type: message"`` of an exception, or ``"Type"``; never raises (a ``__str__`` may)."""
    name = type(err).__name__
    try:
        text = str(err)
    except Exception:
        return f"{name} (its message cannot be shown)"
    return f"{name}: {text}" if text else name


def _too_deep(value: Any, limit: int) -> bool:
    """Whether lists and dicts nest in ``value`` more than ``limit`` levels (``{}`` is one level); iterative."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def _read_call(body: str, closed: bool) -> tuple[ToolCall | None, str | None, str | None]:
    """One call's text: ``(call, None, name)`` or ``(None, error, name-if-readable)``; never raises."""
    if not closed:
        return None, "the <tool_call> is not closed with </tool_call>", None
    try:
        parsed = json.loads(body.strip())
    except json.JSONDecodeError as err:
        return None, f"the call is not JSON ({err.msg} at character {err.pos})", None
    except RecursionError:
        return None, "the call is not JSON the parser can read (nested too deeply)", None
    except ValueError as err:  # e.g. an integer longer than sys.get_int_max_str_digits()
        digits = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
        if "digits" in _describe(err):
            return None, f"the call is not JSON the parser can read (an integer of more than {digits} digits)", None
        return None, f"the call could not be read ({_describe(err)[:200]})", None
    except Exception as err:  # noqa: BLE001 - whatever the parser does with what the policy wrote
        return None, f"the call could not be read ({_describe(err)[:200]})", None
    name = parsed.get("name") if isinstance(parsed, dict) else None
    if not isinstance(name, str):
        return None, 'the call must be {"name": <tool name>, "arguments": {...}}', None
    arguments = parsed.get("arguments", {})
    if not isinstance(arguments, dict):
        return None, "the call's arguments must be a JSON object", name
    if _too_deep(arguments, MAX_ARGUMENT_DEPTH):
        return None, f"the call's arguments are nested more than {MAX_ARGUMENT_DEPTH} levels deep", name
    return ToolCall(name, arguments), None, name


def _read_calls(text: str) -> list[tuple[ToolCall | None, str | None, str | None]]:
    return [_read_call(m.group(1), bool(m.group(2))) for m in _CALL.finditer(text)]


def parse_tool_calls(text: str) -> list[tuple[ToolCall | None, str | None]]:
    """Every ``<tool_call>...</tool_call>`` of ``text``, in order: ``(call, None)``, or ``(None, error)`` for a
    malformed one (only the last can be unclosed); ``[]`` when the text holds no call (it is an answer)."""
    return [(call, error) for call, error, _ in _read_calls(text)]


def parse_tool_call(text: str) -> tuple[ToolCall | None, str | None]:
    """The first ``<tool_call>...</tool_call>`` of ``text``: ``(call, None)``, ``(None, error)`` for a malformed
    one, or ``(None, None)`` when the text holds no call (it is an answer)."""
    match = _CALL.search(text)
    if match is None:
        return None, None
    call, error, _ = _read_call(match.group(1), bool(match.group(2)))
    return call, error


# -- checking arguments --------------------------------------------------------------------------------------------
def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _short(value: Any, limit: int = 80) -> str:
    try:
        text = repr(value)
    except Exception:
        return f"a {_type_name(value)}"
    return text if len(text) <= limit else text[:limit] + "..."


def _same(value: Any, option: Any) -> bool:
    """``value == option`` of the same JSON type (``True`` is not ``1``, ``1.0`` is not ``1``)."""
    return type(value) is type(option) and value == option


def _schema_error(value: Any, schema: Any, path: str, depth: int = 0) -> str | None:
    """Why ``value`` does not fit ``schema`` (the keys ``get_json_schema`` writes, see the module docstring), or
    None; what the schema does not say, or says in a way not understood, is not checked."""
    if not isinstance(schema, dict) or depth > MAX_ARGUMENT_DEPTH:
        return None
    if value is None and schema.get("nullable") is True:
        return None
    for key in ("anyOf", "oneOf"):  # "oneOf" read as "anyOf": the value must fit at least one
        options = schema.get(key)
        if isinstance(options, list) and options and all(isinstance(o, dict) for o in options):
            reasons = []
            for option in options:
                reason = _schema_error(value, option, path, depth + 1)
                if reason is None:
                    break
                reasons.append(reason)
            else:
                return f"argument {path!r} fits none of the allowed types: " + "; ".join(reasons)
    names = schema.get("type")
    names = [names] if isinstance(names, str) else names
    if isinstance(names, list) and names and all(isinstance(n, str) and n in _JSON_TYPES for n in names):
        fits = [n for n in names if isinstance(value, _JSON_TYPES[n]) and not (isinstance(value, bool)
                                                                               and n != "boolean")]
        if not fits:
            allowed = list(dict.fromkeys(names + (["null"] if schema.get("nullable") is True else [])))
            return f"argument {path!r} must be of type {' or '.join(allowed)}, got {_type_name(value)}"
    options = schema.get("enum")
    if isinstance(options, list) and options and not any(_same(value, o) for o in options):
        return f"argument {path!r} must be one of {_short(options, 200)}, got {_short(value)}"
    if isinstance(value, list):
        prefix = schema.get("prefixItems")
        for i, item in enumerate(value):
            if isinstance(prefix, list) and i < len(prefix):
                reason = _schema_error(item, prefix[i], f"{path}[{i}]", depth + 1)
            else:
                reason = _schema_error(item, schema.get("items"), f"{path}[{i}]", depth + 1)
            if reason is not None:
                return reason
    elif isinstance(value, dict):
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        for key, item in value.items():
            sub = properties[key] if key in properties else schema.get("additionalProperties")
            reason = _schema_error(item, sub, f"{path}[{json.dumps(str(key)[:40])}]", depth + 1)
            if reason is not None:
                return reason
    return None


def _argument_error(fn: Callable, schema: dict, arguments: dict) -> str | None:
    """Why ``arguments`` do not fit ``fn`` (its signature, and its JSON schema), or None. Never raises: a check that
    fails on an odd schema lets the call through (the tool then judges its arguments)."""
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as err:
        return _describe(err).partition(": ")[2][:300] or "the arguments do not fit its signature"
    except Exception:  # noqa: BLE001 - no signature to check
        pass
    try:
        properties = schema.get("function", schema).get("parameters", {}).get("properties", {})
        if not isinstance(properties, dict):
            return None
        for name, value in arguments.items():
            reason = _schema_error(value, properties.get(name), name)
            if reason is not None:
                return reason
    except Exception:  # noqa: BLE001
        return None
    return None


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
        from rloo_lightning.rewards.parallel import WorkerPool

        if self.pool is not None:
            self.pool.close()
        self.pool = WorkerPool(dict(enumerate(self.paths)), dict(enumerate(self.functions)), 1,
                               memory_mb=self.memory_mb)


class ToolEnvironment(Environment):
    """An episode in which the policy may call ``tools`` before it answers (see the module docstring).

    Args:
        tools: import paths of the tool functions (``pkg.module.function``).
        timeout: seconds one call may run, in a worker process that is killed on timeout (None: calls run in this
            process, with no limit of time or memory).
        max_calls: the most calls of an episode, each call of a turn counted; a further call is answered with an
            error and ends the episode (None: no limit but ``environment.max_turns``).
        memory_mb: MiB of address space a call may add in its worker process, on top of what the worker maps
            after its start-up (its imports: about 760 MiB with torch 2.x for CPU, more with a CUDA build):
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
        calls = _read_calls(turn.text)
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
                    f"no tool named {_short(call.name)}; tools: {', '.join(self.functions)}", False)
        wrong = _argument_error(fn, self.schemas[call.name], call.arguments)
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
                    f"{call.name} returned a result that cannot be written as text ({_describe(err)[:200]})", False)

    def _run(self, call: ToolCall) -> tuple[str, Any]:
        """``("ok", value)``, ``("error", text)`` (the tool raised), ``("failed", text)`` (its worker died or
        failed) or ``("timeout", None)``."""
        if self.pool is None:
            try:
                return "ok", self.functions[call.name](**call.arguments)
            except (Exception, SystemExit) as err:  # the tool's own failure: reported to the policy
                return "error", _describe(err)
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
            return "failed", f"the tool's worker failed and was restarted ({_describe(err)[:200]})"
        if status == "error":
            return "error", _describe(value[0])
        if status == "died":
            return "failed", f"the tool's worker died ({value}) and was replaced"
        return status, value


# -- a built-in tool ------------------------------------------------------------------------------------------------
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}
_LARGEST = 10 ** 308  # about the largest float: no result beyond it (an int could have thousands of digits)


def _real(value: Any) -> float:
    """``value`` if it is a finite real number within ±1e308, else ValueError."""
    if isinstance(value, complex):
        raise ValueError(f"the result {value} is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is too large (beyond ±1e308)" if math.isinf(value) else "the result is undefined")
    if isinstance(value, int) and abs(value) > _LARGEST:
        raise ValueError("the result is too large (beyond ±1e308)")
    return value


def _apply(op: Callable, *args: float) -> float:
    try:
        return _real(op(*args))
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("the result is too large (beyond ±1e308)") from None


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _real(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _apply(_OPERATORS[type(node.op)], _evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 100 or abs(left) > 1e6):
            raise ValueError("exponent or base too large")
        return _apply(_OPERATORS[type(node.op)], left, right)
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(7 + 5) * 3".
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression ({err.msg})") from None
    value = _evaluate(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)
