"""Tools by import path, each one's JSON schema (read from its signature and docstring), and the fallback
prompt text that lists the schemas for a chat template that takes no ``tools``.
"""

from __future__ import annotations

import json
from typing import Callable, Sequence

from rloo_lightning.environments.base import EnvironmentConfigError

__all__ = ["resolve_tools", "tool_prompt", "tool_schema", "tool_schemas"]


def resolve_tools(paths: Sequence[str]) -> dict[str, Callable]:
    """``{name: function}`` for import paths ``pkg.module.function``; errors (:class:`EnvironmentConfigError`)
    name the path."""
    from rloo_lightning.runtime.importpath import ImportPathError, import_object

    if isinstance(paths, str) or not paths:
        raise EnvironmentConfigError(f"tools must be a non-empty list of import paths 'package.module.function', "
                                     f"got {paths!r}")
    tools = {}
    for path in paths:
        try:
            fn = import_object(path, "tool")
        except ImportPathError as err:  # the importer is shared with reward functions; this is a tool's error
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
