"""Reading tool calls out of a policy turn: every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
in order, as a :class:`ToolCall` or the reason it is malformed; never an exception (a policy under RL writes
anything).
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

__all__ = ["MAX_ARGUMENT_DEPTH", "ToolCall", "describe_error", "parse_tool_call", "parse_tool_calls", "read_calls"]

MAX_ARGUMENT_DEPTH = 64  # arguments nested deeper are a malformed call (they could not even be sent to a worker)
_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)


class ToolCall:
    """A parsed call: ``name`` and ``arguments`` (a dict)."""

    __slots__ = ("name", "arguments")

    def __init__(self, name: str, arguments: dict) -> None:
        self.name, self.arguments = name, arguments


def describe_error(err: BaseException) -> str:
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
        if "digits" in describe_error(err):
            return None, f"the call is not JSON the parser can read (an integer of more than {digits} digits)", None
        return None, f"the call could not be read ({describe_error(err)[:200]})", None
    except Exception as err:  # noqa: BLE001 - whatever the parser does with what the policy wrote
        return None, f"the call could not be read ({describe_error(err)[:200]})", None
    name = parsed.get("name") if isinstance(parsed, dict) else None
    if not isinstance(name, str):
        return None, 'the call must be {"name": <tool name>, "arguments": {...}}', None
    arguments = parsed.get("arguments", {})
    if not isinstance(arguments, dict):
        return None, "the call's arguments must be a JSON object", name
    if _too_deep(arguments, MAX_ARGUMENT_DEPTH):
        return None, f"the call's arguments are nested more than {MAX_ARGUMENT_DEPTH} levels deep", name
    return ToolCall(name, arguments), None, name


def read_calls(text: str) -> list[tuple[ToolCall | None, str | None, str | None]]:
    return [_read_call(m.group(1), bool(m.group(2))) for m in _CALL.finditer(text)]


def parse_tool_calls(text: str) -> list[tuple[ToolCall | None, str | None]]:
    """Every ``<tool_call>...</tool_call>`` of ``text``, in order: ``(call, None)``, or ``(None, error)`` for a
    malformed one (only the last can be unclosed); ``[]`` when the text holds no call (it is an answer)."""
    return [(call, error) for call, error, _ in read_calls(text)]


def parse_tool_call(text: str) -> tuple[ToolCall | None, str | None]:
    """The first ``<tool_call>...</tool_call>`` of ``text``: ``(call, None)``, ``(None, error)`` for a malformed
    one, or ``(None, None)`` when the text holds no call (it is an answer)."""
    match = _CALL.search(text)
    if match is None:
        return None, None
    call, error, _ = _read_call(match.group(1), bool(match.group(2)))
    return call, error
