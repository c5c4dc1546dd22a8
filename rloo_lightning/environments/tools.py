"""Tool use: plain Python functions as tools, called by the policy in a multi-turn episode.

A tool is a typed function with a Google-style docstring (its ``Args:`` describe the parameters); its JSON schema
is read from them (``transformers.utils.get_json_schema``). The policy calls a tool by writing, in its turn::

    <tool_call>{"name": "calculator", "arguments": {"expression": "7 * 8"}}</tool_call>

The call runs (in a worker process with a timeout, by default), and its result comes back as a ``tool`` message;
the policy goes on. A turn without a call is the policy's answer and ends the episode. Whatever goes wrong with a
call becomes an error message to the policy and a metric, never a crash:

=====================  =====================================================================================
kind                   when
=====================  =====================================================================================
``malformed``          a ``<tool_call>`` that is not closed, not JSON, or not ``{"name": ..., "arguments": {...}}``
``unknown_tool``       a name that is not one of the tools
``bad_arguments``      arguments the function's signature does not accept, or of the wrong JSON type
``exception``          the tool raised
``timeout``            the call ran past ``timeout`` seconds: its worker is killed and replaced
=====================  =====================================================================================

**Security.** A tool is your code, run with the policy's arguments: treat the arguments as untrusted input. Never
``eval`` or ``exec`` model output, never pass it to a shell; parse it (the built-in :func:`calculator` parses
arithmetic with :mod:`ast` and evaluates only numbers and ``+ - * / // % **`` with bounded exponents). The worker
process bounds the time of a call, not what it can touch.

Schemas reach the prompt through ``data.tools`` (the same import paths): a chat template that takes ``tools``
renders them itself; otherwise :func:`tool_prompt` writes them, with the call format above, as a system message.
"""

from __future__ import annotations

import ast
import inspect
import json
import operator
import re
from typing import Any, Callable, ClassVar, Sequence

from rloo_lightning.environments.base import EnvStep, Environment, Message, PolicyTurn

__all__ = ["ToolEnvironment", "ToolCall", "calculator", "parse_tool_call", "tool_prompt", "tool_schema",
           "resolve_tools", "tool_schemas", "ERROR_KINDS"]

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "exception", "timeout")
_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict}


def resolve_tools(paths: Sequence[str]) -> dict[str, Callable]:
    """``{name: function}`` for import paths ``pkg.module.function``; errors name the path."""
    from rloo_lightning.rewards.protocol import _import_object

    if isinstance(paths, str) or not paths:
        raise ValueError(f"tools must be a non-empty list of import paths 'package.module.function', got {paths!r}")
    tools = {}
    for path in paths:
        fn = _import_object(path, "tool")
        if not callable(fn):
            raise ValueError(f"tool {path!r} is not callable")
        name = fn.__name__
        if name in tools:
            raise ValueError(f"two tools are named {name!r}: {path!r} and another; tool names must be unique")
        tools[name] = fn
    return tools


def tool_schema(fn: Callable) -> dict:
    """The JSON schema of a tool (``{"type": "function", "function": {"name", "description", "parameters"}}``),
    from its type hints and its docstring's ``Args:``."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: its schema needs a type hint for every parameter "
                         f"and a docstring with a description and an Args: section ({err})") from err


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


def parse_tool_call(text: str) -> tuple[ToolCall | None, str | None]:
    """The first ``<tool_call>...</tool_call>`` of ``text``: ``(call, None)``, ``(None, error)`` for a malformed
    one, or ``(None, None)`` when the text holds no call (it is an answer)."""
    match = _CALL.search(text)
    if match is None:
        return None, None
    if not match.group(2):
        return None, "the <tool_call> is not closed with </tool_call>"
    try:
        body = json.loads(match.group(1).strip())
    except json.JSONDecodeError as err:
        return None, f"the call is not JSON ({err.msg} at character {err.pos})"
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None, 'the call must be {"name": <tool name>, "arguments": {...}}'
    arguments = body.get("arguments", {})
    if not isinstance(arguments, dict):
        return None, "the call's arguments must be a JSON object"
    return ToolCall(body["name"], arguments), None


def _argument_error(fn: Callable, schema: dict, arguments: dict) -> str | None:
    """Why ``arguments`` do not fit ``fn`` (its signature, and the JSON types of its schema), or None."""
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as err:
        return str(err)
    properties = schema.get("function", schema).get("parameters", {}).get("properties", {})
    for name, value in arguments.items():
        expected = _JSON_TYPES.get(properties.get(name, {}).get("type"))
        if expected is not None and (not isinstance(value, expected) or (isinstance(value, bool)
                                                                         and expected is not bool)):
            return f"argument {name!r} must be of type {properties[name]['type']}, got {type(value).__name__}"
    return None


class ToolEnvironment(Environment):
    """An episode in which the policy may call ``tools`` before it answers (see the module docstring).

    Args:
        tools: import paths of the tool functions (``pkg.module.function``).
        timeout: seconds one call may run, in a worker process that is killed on timeout (None: calls run in this
            process, with no limit).
        max_calls: the most calls of an episode; a further call is answered with an error and ends the episode
            (None: no limit but ``environment.max_turns``).

    Rewards come from ``model.rewards.funcs``, which score the episode's last turn (its answer) and see the whole
    transcript; this environment pays nothing itself. Per episode it counts ``tool_calls``, ``tool_errors`` and
    each kind ``tool_errors/<kind>``, and ``tool_timeouts``, logged as ``train/<name>``.
    """

    metric_names: ClassVar[tuple[str, ...]] = ("tool_calls", "tool_errors", "tool_timeouts",
                                               *(f"tool_errors/{k}" for k in ERROR_KINDS))
    _pools: ClassVar[dict] = {}

    def __init__(self, tools: Sequence[str], timeout: float | None = 10.0, max_calls: int | None = None) -> None:
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout}")
        if max_calls is not None and max_calls < 1:
            raise ValueError(f"max_calls must be >= 1 or None, got {max_calls}")
        self.paths, self.timeout, self.max_calls = tuple(tools), timeout, max_calls
        key = (self.paths, timeout)
        if key not in self._pools:  # one set of tools (and one worker) for every episode of this configuration
            functions = resolve_tools(self.paths)
            schemas = {name: tool_schema(fn) for name, fn in functions.items()}
            pool = None
            if timeout is not None:
                from rloo_lightning.rewards.parallel import WorkerPool

                pool = WorkerPool(dict(enumerate(self.paths)), {i: n for i, n in enumerate(functions)}, 1)
            self._pools[key] = (functions, schemas, pool)
        self.functions, self.schemas, self.pool = self._pools[key]

    def reset(self, row: dict, seed: int) -> None:
        self.counts = dict.fromkeys(self.metric_names, 0.0)

    def metrics(self) -> dict[str, float]:
        return dict(self.counts)

    def _error(self, kind: str, text: str) -> EnvStep:
        self.counts["tool_errors"] += 1
        self.counts[f"tool_errors/{kind}"] += 1
        if kind == "timeout":
            self.counts["tool_timeouts"] += 1
        return EnvStep(observation=Message("tool", f"error ({kind}): {text}"), info={"tool_error": kind})

    def step(self, turn: PolicyTurn) -> EnvStep:
        call, malformed = parse_tool_call(turn.text)
        if call is None and malformed is None:
            return EnvStep(done=True)  # no call: the answer
        self.counts["tool_calls"] += 1
        if self.max_calls is not None and self.counts["tool_calls"] > self.max_calls:
            step = self._error("bad_arguments", f"no more than {self.max_calls} tool calls per answer")
            return EnvStep(observation=step.observation, done=True, info=step.info)
        if malformed is not None:
            return self._error("malformed", malformed)
        fn = self.functions.get(call.name)
        if fn is None:
            return self._error("unknown_tool", f"no tool named {call.name!r}; tools: {', '.join(self.functions)}")
        wrong = _argument_error(fn, self.schemas[call.name], call.arguments)
        if wrong is not None:
            return self._error("bad_arguments", f"{call.name}: {wrong}")
        status, value = self._run(call)
        if status == "timeout":
            return self._error("timeout", f"{call.name} ran past {self.timeout} s and was stopped")
        if status != "ok":
            return self._error("exception", f"{call.name} raised {value}")
        try:
            content = value if isinstance(value, str) else json.dumps(value)
        except (TypeError, ValueError):
            content = str(value)
        return EnvStep(observation=Message("tool", content), info={"tool": call.name})

    def _run(self, call: ToolCall) -> tuple[str, Any]:
        if self.pool is None:
            try:
                return "ok", self.functions[call.name](**call.arguments)
            except Exception as err:  # the tool's own failure: reported to the policy
                return "error", f"{type(err).__name__}: {err}"
        index = list(self.functions).index(call.name)
        ((status, value),) = self.pool.run([(index, "call", (None, None, None, call.arguments))], self.timeout)
        if status == "error":
            err = value[0]
            return "error", f"{type(err).__name__}: {err}"
        if status == "died":
            return "error", f"the tool's worker died ({value})"
        return status, value


# -- a built-in tool ------------------------------------------------------------------------------------------------
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 100 or abs(left) > 1e6):
            raise ValueError("exponent or base too large")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(7 + 5) * 3".
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _evaluate(ast.parse(expression, mode="eval"))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)
