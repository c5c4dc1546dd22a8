"""Wall-clock timers for benchmarking a training step: per-phase totals and a per-step Lightning callback.

``PhaseTimer`` accumulates wall seconds per named phase of a step; when disabled, ``timer(name)``
returns one shared ``nullcontext`` and costs nothing but the call. ``StepTimer`` is a callback that
records each training step's wall time (``on_train_batch_start`` to ``on_train_batch_end``), its
backward and optimizer parts, and the module's phase totals (``pl_module.timer``, if it has one), and
writes them as JSON.

On CUDA both synchronise the device before reading the clock, so that a phase is charged with the
kernels it launched (this adds sync points: time with it only when benchmarking).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from lightning.pytorch import Callback

__all__ = ["PhaseTimer", "StepTimer", "peak_rss_mb", "log_phase_times"]

_NULL = nullcontext()  # reusable and reentrant: the one context a disabled timer hands out


def _sync() -> None:
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
        _sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        _sync()
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


class StepTimer(Callback):
    """Per-step wall times of ``fit``, written as JSON to ``path``.

    Each training batch gives one entry::

        {"step": global step at the start, "t_start": seconds since the first step's start,
         "total_s": on_train_batch_start -> on_train_batch_end,
         "backward_s": on_before_backward -> on_after_backward,
         "optimizer_s": on_before_optimizer_step -> on_train_batch_end (optimizer and scheduler step),
         "phases": the module's ``timer.pop()`` (e.g. generation, reward, policy_forward, reference), or {},
         "rss_hwm_mb": the process's peak resident set so far (Linux ``VmHWM``; None elsewhere)}

    Phase totals accumulated between steps (e.g. validation) are discarded at each step's start. If
    the module pops its own timer during the step, its last pop (``timer.last``) is used instead.
    The file is ``{"steps": [...]}``, written at the end of training (and at teardown, if training
    stopped early); under several processes each rank writes ``<stem>.rank<r><suffix>``.

    Args:
        path: the JSON file to write.
    """

    def __init__(self, path: str) -> None:
        self.path = str(path)
        self.steps: list[dict] = []
        self._origin: float | None = None
        self._start = self._backward_start = self._optimizer_start = None
        self._backward = 0.0
        self._step = 0
        self._written = False

    # -- one step ------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        timer = getattr(pl_module, "timer", None)
        if timer is not None:
            timer.pop()  # phases run outside a step (validation, ...) are not this step's
            if hasattr(timer, "last"):
                timer.last = {}
        self._backward, self._optimizer_start, self._backward_start = 0.0, None, None
        self._step = trainer.global_step
        _sync()
        self._start = time.perf_counter()
        if self._origin is None:
            self._origin = self._start

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        _sync()
        self._backward_start = time.perf_counter()

    def on_after_backward(self, trainer, pl_module) -> None:
        _sync()
        if self._backward_start is not None:
            self._backward += time.perf_counter() - self._backward_start
            self._backward_start = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        _sync()
        self._optimizer_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        _sync()
        end = time.perf_counter()
        if self._start is None:
            return
        timer = getattr(pl_module, "timer", None)
        phases: dict[str, float] = {}
        if timer is not None:
            phases = dict(timer.pop()) or dict(getattr(timer, "last", None) or {})
        self.steps.append({
            "step": self._step,
            "t_start": self._start - self._origin,
            "total_s": end - self._start,
            "backward_s": self._backward,
            "optimizer_s": end - self._optimizer_start if self._optimizer_start is not None else 0.0,
            "phases": phases,
            "rss_hwm_mb": peak_rss_mb(),
        })
        self._start = None

    # -- output --------------------------------------------------------------------------------
    def _file(self, trainer) -> Path:
        path = Path(self.path)
        if trainer is not None and trainer.world_size > 1:
            path = path.with_name(f"{path.stem}.rank{trainer.global_rank}{path.suffix}")
        return path

    def write(self, trainer=None) -> Path:
        """Write the steps recorded so far; returns the file written."""
        path = self._file(trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"steps": self.steps}, indent=1))
        os.replace(tmp, path)
        self._written = True
        return path

    def on_train_end(self, trainer, pl_module) -> None:
        self.write(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and not self._written and self.steps:
            self.write(trainer)

    # -- checkpoints: a timer carries no state worth resuming ---------------------------------
    def state_dict(self) -> dict:
        return {}


def log_phase_times(trainer, totals: dict[str, float], step: int) -> None:
    """``time/<phase>`` seconds straight to the trainer's loggers, every ``log_every_n_steps`` steps.

    Not through ``self.log``: its per-key bookkeeping (about half a millisecond a key on CPU) would
    make the timers the largest cost they measure. So they are not in ``trainer.callback_metrics``.
    """
    if trainer is None or not trainer.loggers or step % max(trainer.log_every_n_steps, 1):
        return
    for logger in trainer.loggers:
        logger.log_metrics({f"time/{phase}": seconds for phase, seconds in totals.items()}, step=step)
