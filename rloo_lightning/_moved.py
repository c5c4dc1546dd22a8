"""Old module paths kept importable for a while: each is a shim whose attributes come from the new module, with
one FutureWarning per name naming the new path (shown by default: users see it, unlike a DeprecationWarning)."""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable

__all__ = ["moved"]


def moved(old: str, new: str, elsewhere: dict[str, str] | None = None) -> Callable[[str], Any]:
    """The module ``__getattr__`` of the shim at ``old``: ``name`` comes from ``new`` (or from ``elsewhere[name]``
    for a module split in several: a module path, or ``module:NewName`` for a name that changed too), with a warning
    once per name, pointing at the caller's line."""
    warned: set[str] = set()
    elsewhere = dict(elsewhere or {})

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        target, _, new_name = elsewhere.get(name, new).partition(":")
        new_name = new_name or name
        value = getattr(importlib.import_module(target), new_name)  # an unknown name: the new module's AttributeError
        if name not in warned:
            warned.add(name)
            warnings.warn(f"{old}.{name} moved to {target}.{new_name}; the old path will be removed", FutureWarning,
                          stacklevel=2)
        return value

    return __getattr__
