"""StepTimer: per-step wall times and peak memory of ``fit``, as JSON (what ``benchmarks/bench.py`` reads)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from lightning.pytorch import Callback

from rloo_lightning.runtime.timing import sync_device, peak_rss_mb

__all__ = ["StepTimer"]


class StepTimer(Callback):
    """Per-step wall times of ``fit``, written as JSON to ``path``.

    Each training batch gives one entry::

        {"step": global step at the start, "t_start": seconds since the first step's start,
         "total_s": on_train_batch_start -> on_train_batch_end,
         "backward_s": on_before_backward -> on_after_backward,
         "optimizer_s": on_before_optimizer_step -> on_train_batch_end (optimizer and scheduler step),
         "phases": the module's ``timer.pop()`` (e.g. generation, reward, policy_logprobs, reference,
         update_forward, update_backward), or {},
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
        sync_device()
        self._start = time.perf_counter()
        if self._origin is None:
            self._origin = self._start

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        sync_device()
        self._backward_start = time.perf_counter()

    def on_after_backward(self, trainer, pl_module) -> None:
        sync_device()
        if self._backward_start is not None:
            self._backward += time.perf_counter() - self._backward_start
            self._backward_start = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        sync_device()
        self._optimizer_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        sync_device()
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
