"""Tools for ``test_tools.py``, importable by path in a worker process."""

from __future__ import annotations

import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: the dividend.
        b: the divisor.
    """
    return a / b


def hang(seconds: float) -> str:
    """Sleep, far longer than any timeout.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "woke up"


def untyped(x):
    """No type hints."""
    return x
