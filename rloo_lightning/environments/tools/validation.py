"""Checking a call's arguments before the tool runs: against the tool's signature, then its JSON schema, in the
subset that ``get_json_schema`` writes: ``type`` (a name, or a list of names for a ``Union``: the value must fit
one of them; ``bool`` is not an ``integer`` or a ``number``; ``"null"`` allows ``null``), ``nullable``
(``Optional``), ``enum`` (``Literal`` and ``Enum``), ``anyOf`` / ``oneOf`` (a ``Union`` of lists, dicts,
literals...: the value must fit at least one), ``items`` and ``prefixItems`` (``list[int]``, ``tuple[int, str]``)
and ``properties`` / ``additionalProperties`` (``dict[str, int]``), checked in depth. What a schema does not say (no
``type``, an unknown key) is not checked.
"""

from __future__ import annotations

import inspect
import json
from typing import Any, Callable

from rloo_lightning.environments.tools.parsing import MAX_ARGUMENT_DEPTH, describe_error

__all__ = ["argument_error", "short_value"]

_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict, "null": type(None)}


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def short_value(value: Any, limit: int = 80) -> str:
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
        return f"argument {path!r} must be one of {short_value(options, 200)}, got {short_value(value)}"
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


def argument_error(fn: Callable, schema: dict, arguments: dict) -> str | None:
    """Why ``arguments`` do not fit ``fn`` (its signature, and its JSON schema), or None. Never raises: a check that
    fails on an odd schema lets the call through (the tool then judges its arguments)."""
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as err:
        return describe_error(err).partition(": ")[2][:300] or "the arguments do not fit its signature"
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
