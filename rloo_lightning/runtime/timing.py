"""Wall-clock timers of a training step's phases, and the process's peak memory.

``PhaseTimer`` accumulates wall seconds per named phase of a step; when disabled, ``timer(name)``
returns one shared ``nullcontext`` and costs nothing but the call. The benchmark's per-step callback
is :class:`rloo_lightning.callbacks.step_timer.StepTimer`.

On CUDA the timers synchronise the device before reading the clock, so that a phase is charged with the
kernels it launched (this adds sync points: time with it only when benchmarking).
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

__all__ = ["PhaseTimer", "peak_rss_mb", "sync_device"]

_NULL = nullcontext()  # reusable and reentrant: the one context a disabled timer hands out


def sync_device() -> None:
    """Wait for queued CUDA work, if CUDA is in use (no-op on CPU and before CUDA is initialised)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def peak_rss_mb() -> float | None:
    """This process's peak resident set so far, in MiB (``VmHWM`` of /proc/self/status; None if unreadable)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class _Phase:
    __slots__ = ("timer", "name", "start")

    def __init__(self, timer: PhaseTimer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> _Phase:
        sync_device()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        sync_device()
        totals = self.timer.totals
        totals[self.name] = totals.get(self.name, 0.0) + time.perf_counter() - self.start


class PhaseTimer:
    """Wall seconds per phase name, accumulated over ``with timer(name):`` blocks until :meth:`pop`.

    Args:
        enabled: when False, ``timer(name)`` returns a shared ``nullcontext`` and nothing is recorded.

    Example::

        timer = PhaseTimer(enabled=True)
        with timer("generation"):
            ...
        timer.pop()  # {"generation": 0.42}; the totals start again from empty
    """

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.totals: dict[str, float] = {}
        self.last: dict[str, float] = {}  # the most recent non-empty pop(), for readers that come later

    def __call__(self, name: str):
        if not self.enabled:
            return _NULL
        return _Phase(self, name)

    def pop(self) -> dict[str, float]:
        """The totals since the last pop (seconds per phase), and clear them."""
        totals, self.totals = self.totals, {}
        if totals:
            self.last = totals
        return totals
