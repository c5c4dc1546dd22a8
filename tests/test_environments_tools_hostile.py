"""Hostile tool calls: whatever the policy writes, ``ToolEnvironment.step`` answers with a message and counts it;
nothing raises out of it. Deeply nested or huge JSON, union / optional / list / literal parameters, a calculator
that returns only real numbers, several calls in one turn, a memory limit for the worker, odd results."""

from __future__ import annotations

import json
import re

import pytest

from rloo_lightning.environments.base import PolicyTurn
from rloo_lightning.environments.tools import ERROR_KINDS, ToolEnvironment, calculator, tool_schema
from rloo_lightning.environments.tools.validation import argument_error

CALC = "rloo_lightning.environments.tools.calculator"
TOOLS = [f"tool_helpers.{name}" for name in ("add", "divide", "pick", "maybe", "either", "total", "colour", "shape",
                                              "anything", "odd_result")] + [CALC]


def _turn(text: str, index: int = 0) -> PolicyTurn:
    return PolicyTurn(token_ids=(), text=text, index=index, ended=True)


def _call(tool: str, /, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module")
def env():
    return ToolEnvironment(TOOLS, timeout=None)


def _step(env: ToolEnvironment, text: str):
    env.reset({}, 0)
    return env.step(_turn(text))


def _errors(env: ToolEnvironment) -> dict[str, float]:
    counts = env.metrics()
    return {k: counts[f"tool_errors/{k}"] for k in ERROR_KINDS if counts[f"tool_errors/{k}"]}


# -- 1. JSON the parser cannot or should not read --------------------------------------------------------------------
DEEP = "[" * 100_000
NESTED_300 = "[" * 300 + "]" * 300


@pytest.mark.parametrize("body,message", [
    (DEEP, "nested too deeply"),
    ('{"name": "add", "arguments": {"a": ' + DEEP + ', "b": 1}}', "nested too deeply"),
    ('{"name": "add", "arguments": {"a": ' + "9" * 5000 + ', "b": 1}}', "4300 digits"),
    ('{"name": "anything", "arguments": {"value": ' + NESTED_300 + "}}", "nested more than 64 levels"),
], ids=["deep-call", "deep-argument", "5000-digit-integer", "valid-but-300-deep"])
def test_deep_or_huge_json_is_a_malformed_call_not_an_exception(env, body, message):
    step = _step(env, f"<tool_call>{body}</tool_call>")
    assert step.observation.role == "tool" and not step.done
    assert step.observation.content.startswith("error (malformed): ") and message in step.observation.content
    assert _errors(env) == {"malformed": 1} and env.metrics()["tool_calls"] == 1
    assert len(step.observation.content) < 300  # the message names the problem, it does not echo the input


def test_any_other_failure_of_the_json_parser_is_a_malformed_call(env, monkeypatch):
    def boom(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(json, "loads", boom)
    step = _step(env, _call("add", a=1, b=2))
    assert step.observation.content == "error (malformed): the call could not be read (MemoryError)"


@pytest.mark.parametrize("schema", [
    {"type": ["integer"]}, {"type": 5}, {"type": ["integer", None, {"x": 1}]}, {"type": "array", "items": "x"},
    {"enum": 3}, {"anyOf": "x"}, {"anyOf": [3, None]}, {"type": "object", "properties": [1]}, "not a schema",
    {"type": {"integer": 1}},
], ids=str)
def test_odd_schemas_never_make_the_argument_check_raise(schema):
    def fn(a):
        return a

    full = {"function": {"parameters": {"properties": {"a": schema}}}}
    for value in (1, "x", None, [1], {"k": 1}):
        result = argument_error(fn, full, {"a": value})
        assert result is None or isinstance(result, str)
    assert argument_error(fn, {"function": {"parameters": {"properties": ["a"]}}}, {"a": 1}) is None
    assert argument_error(fn, {"function": []}, {"a": 1}) is None


# -- 2. union, optional, list and literal parameters ---------------------------------------------------------------
def test_the_schemas_transformers_writes_for_these_hints():
    """What ``get_json_schema`` (transformers 5.x) emits, which the argument check follows."""
    import tool_helpers as t

    def prop(fn):
        return {k: v for k, v in tool_schema(fn)["function"]["parameters"]["properties"]["value" if fn not in (
            t.total, t.colour) else ("values" if fn is t.total else "name")].items() if k != "description"}

    assert prop(t.pick) == prop(t.either) == {"type": ["integer", "string"]}
    assert prop(t.maybe) == {"type": "integer", "nullable": True}
    assert prop(t.total) == {"type": "array", "items": {"type": "integer"}}
    assert prop(t.colour) == {"type": "string", "enum": ["red", "green"]}
    assert prop(t.shape) == {"anyOf": [{"type": "array", "items": {"type": "integer"}},
                                       {"type": "object", "additionalProperties": {"type": "integer"}}]}
    assert prop(t.anything) == {}


ARGUMENT_CASES = [
    ("pick", {"value": 3}, "int:3"),
    ("pick", {"value": "x"}, "str:x"),
    ("pick", {"value": True}, "argument 'value' must be of type integer or string, got bool"),
    ("pick", {"value": 2.5}, "argument 'value' must be of type integer or string, got float"),
    ("pick", {"value": None}, "argument 'value' must be of type integer or string, got null"),
    ("either", {"value": "y"}, "str:y"),
    ("maybe", {"value": None}, "NoneType:None"),
    ("maybe", {"value": 4}, "int:4"),
    ("maybe", {"value": "4"}, "argument 'value' must be of type integer or null, got str"),
    ("total", {"values": [1, 2, 3]}, "6"),
    ("total", {"values": [1, "2"]}, "argument 'values[1]' must be of type integer, got str"),
    ("total", {"values": [True]}, "argument 'values[0]' must be of type integer, got bool"),
    ("total", {"values": 3}, "argument 'values' must be of type array, got int"),
    ("colour", {"name": "red"}, "red"),
    ("colour", {"name": "blue"}, "argument 'name' must be one of ['red', 'green'], got 'blue'"),
    ("shape", {"value": [1, 2]}, "list"),
    ("shape", {"value": {"a": 1}}, "dict"),
    ("shape", {"value": {"a": "b"}}, "argument 'value' fits none of the allowed types: argument 'value' must be "
                                     "of type array, got dict; argument 'value[\"a\"]' must be of type integer, "
                                     "got str"),
    ("shape", {"value": "x"}, "argument 'value' fits none of the allowed types"),
    ("anything", {"value": [[1], {"a": None}]}, "list"),
    ("divide", {"a": 1, "b": True}, "argument 'b' must be of type number, got bool"),
]


@pytest.mark.parametrize("name,arguments,expected", ARGUMENT_CASES,
                         ids=[f"{name}-{i}" for i, (name, _, _) in enumerate(ARGUMENT_CASES)])
def test_union_optional_list_and_literal_parameters_are_checked_by_their_schema(env, name, arguments, expected):
    step = _step(env, _call(name, **arguments))
    content = step.observation.content
    if expected.startswith("argument "):
        assert content.startswith(f"error (bad_arguments): {name}: {expected}"), content
        assert _errors(env) == {"bad_arguments": 1}
    else:
        assert content == expected and _errors(env) == {}


# -- 3. the calculator returns real numbers ---------------------------------------------------------------------------
@pytest.mark.parametrize("expression,message", [
    ("(-8) ** 0.5", "not a real number"),
    ("1e308 * 10", "too large"),
    ("1e400", "too large"),
    ("1e5 ** 100", "too large"),
    ("999999 ** 100 * 999999 ** 100 * 999999 ** 100 * 999999 ** 100", "too large"),
    ("1 / 0", "division by zero"),
    ("1 // 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("3 +", "not an arithmetic expression"),
], ids=["complex", "overflow", "inf-literal", "float-pow", "huge-int", "div", "floordiv", "mod", "zero-pow",
        "syntax"])
def test_the_calculator_answers_only_finite_real_numbers(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator(expression)


def test_the_calculator_still_answers_ordinary_arithmetic():
    assert calculator("(7 + 5) * 3") == "36" and calculator("7 / 2") == "3.5" and calculator("-8 ** (1 / 3)") == "-2"
    assert calculator("(" * 99 + "1" + ")" * 99) == "1" and calculator("2 ** -1") == "0.5"
    assert calculator("10 ** 100") == str(10 ** 100)


def test_a_complex_or_zero_division_result_is_an_exception_message_to_the_policy(env):
    step = _step(env, _call("calculator", expression="(-8) ** 0.5"))
    assert step.observation.content.startswith("error (exception): calculator raised ValueError: ")
    assert "not a real number" in step.observation.content
    step = _step(env, _call("calculator", expression="1 / 0"))
    assert step.observation.content == "error (exception): calculator raised ValueError: division by zero"


# -- 4. several calls in one turn ------------------------------------------------------------------------------------
def test_several_calls_in_one_turn_all_run_in_order_and_each_is_counted(env):
    text = ("First " + _call("add", a=1, b=2) + " then " + _call("divide", a=1, b=0) + _call("nope")
            + _call("calculator", expression="6 * 7") + ' and <tool_call>{"name": "add"')
    step = _step(env, text)
    assert not step.done and step.observation.role == "tool"
    assert json.loads(step.observation.content) == [
        {"name": "add", "result": "3"},
        {"name": "divide", "error": "error (exception): divide raised ZeroDivisionError: division by zero"},
        {"name": "nope", "error": "error (unknown_tool): no tool named 'nope'; tools: " + ", ".join(
            t.rsplit(".", 1)[1] for t in TOOLS)},
        {"name": "calculator", "result": "42"},
        {"name": None, "error": "error (malformed): the <tool_call> is not closed with </tool_call>"},
    ]
    counts = env.metrics()
    assert counts["tool_calls"] == 5 and counts["tool_errors"] == 3
    assert _errors(env) == {"exception": 1, "unknown_tool": 1, "malformed": 1}
    single = _step(env, "x " + _call("add", a=1, b=2))  # one call: the plain result, as before
    assert single.observation.content == "3" and single.info == {"tool": "add"}


def test_max_calls_counts_each_call_of_a_turn_and_ends_the_episode_past_it():
    env = ToolEnvironment(TOOLS, timeout=None, max_calls=2)
    env.reset({}, 0)
    step = env.step(_turn(_call("add", a=1, b=1) + _call("add", a=2, b=2) + _call("add", a=3, b=3)))
    assert step.done
    assert json.loads(step.observation.content) == [
        {"name": "add", "result": "2"}, {"name": "add", "result": "4"},
        {"name": "add", "error": "error (bad_arguments): no more than 2 tool calls per answer"}]
    assert env.metrics()["tool_calls"] == 3 and _errors(env) == {"bad_arguments": 1}
    env.reset({}, 1)
    assert env.step(_turn(_call("add", a=1, b=1))).observation.content == "2"
    last = env.step(_turn(_call("add", a=2, b=2) + _call("add", a=3, b=3), 1))
    assert last.done and json.loads(last.observation.content)[1]["error"].startswith("error (bad_arguments)")


# -- 6. results that are huge or cannot be written as text ----------------------------------------------------------
@pytest.mark.parametrize("kind,expected", [
    ("set", "{1, 2}"),
    ("bytes", "b'\\x00\\xff'"),
    ("surrogate", "half a pair: \\ud800"),
    ("unprintable", "error (exception): odd_result returned a result that cannot be written as text "
                    "(RuntimeError: no text for you)"),
    ("huge_int", "error (exception): odd_result returned a result that cannot be written as text (ValueError: "),
    ("deep", "error (exception): odd_result returned a result that cannot be written as text (RecursionError: "),
    ("unprintable_error", "error (exception): odd_result raised _UnprintableError (its message cannot be shown)"),
    ("exit", "error (exception): odd_result raised SystemExit: 3"),
])
def test_results_and_errors_that_resist_text_become_text_or_an_exception_message(env, kind, expected):
    step = _step(env, _call("odd_result", kind=kind))
    content = step.observation.content
    assert content.startswith(expected), content
    content.encode("utf-8")  # no lone surrogates reach the tokenizer
    assert env.metrics()["tool_errors"] == float(content.startswith("error ("))


# -- 5. a memory limit for the worker --------------------------------------------------------------------------------
def _address_space_limit(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max address space"))
    return int(re.split(r"\s{2,}", line.strip())[1])


@pytest.mark.slow  # a worker process
def test_a_tool_that_allocates_past_memory_mb_is_an_exception_and_the_worker_goes_on():
    env = ToolEnvironment(["tool_helpers.allocate", "tool_helpers.odd_result", "tool_helpers.anything"],
                          timeout=60, memory_mb=512)
    env.reset({}, 0)
    assert env.step(_turn(_call("allocate", megabytes=16))).observation.content == str(16 * 2 ** 20)
    pid = env.pool.pids[0]
    with open(f"/proc/{pid}/status") as f:
        size = int(next(line for line in f if line.startswith("VmSize")).split()[1]) * 1024
    limit = _address_space_limit(pid)
    assert size < limit <= size + 512 * 2 ** 20  # the worker's own start-up + 512 MiB
    step = env.step(_turn(_call("allocate", megabytes=2048), 1))
    assert step.observation.content.startswith("error (exception): allocate raised MemoryError"), step
    assert env.pool.pids[0] == pid  # the worker survived its MemoryError
    assert env.step(_turn(_call("allocate", megabytes=64), 2)).observation.content == str(64 * 2 ** 20)
    # a result that pickles in the worker but cannot be rebuilt here: an exception, and a fresh worker
    step = env.step(_turn(_call("odd_result", kind="unloadable"), 3))
    assert step.observation.content.startswith("error (exception): odd_result: the tool's worker failed"), step
    assert env.step(_turn(_call("anything", value=[[[1]]]), 4)).observation.content == "list"
    assert env.metrics()["tool_errors/exception"] == 2 and env.metrics()["tool_calls"] == 5
    assert ToolEnvironment(["tool_helpers.add"], timeout=60).memory_mb == 4096  # the default


def test_what_the_policy_wrote_is_echoed_short_and_as_valid_utf8(env):
    step = _step(env, '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2, "x\\ud800": 3}}</tool_call>')
    assert step.observation.content.startswith("error (bad_arguments): add: ")
    step.observation.content.encode("utf-8")
    long_name = "n" * 10_000
    step = _step(env, _call(long_name) + _call("x\ud800"))
    listed = json.loads(step.observation.content)
    assert [len(item["name"]) for item in listed] == [100, 2] and len(step.observation.content) < 1000
    step.observation.content.encode("utf-8")
    assert _errors(env) == {"unknown_tool": 2}
