"""A Lightning callback that records a training process's memory and step times (for benchmarks/memory_report.py).

Added to a run with ``--trainer.callbacks+=benchmarks._memory_probe.MemoryProbe`` (the repository's root on
``PYTHONPATH``);
writes JSON to ``$MEMORY_PROBE_OUT`` when training ends. Recorded, in MiB:

- ``start_rss_mb``: resident set at ``setup`` (interpreter, torch, Lightning, the data; no model yet);
- ``load_rss_mb`` / ``load_hwm_mb``: resident set and its high-water mark (VmHWM) at ``on_train_start``,
  i.e. after ``configure_model`` (policy, reference, LoRA wrapping), the strategy's setup (the precision
  plugin's cast under ``bf16-true``) and the optimizer's construction (AdamW's moments are created
  lazily, at the first step, so they are not in it);
- ``train_peak_rss_mb``: the largest resident set sampled (every ``interval`` s, from /proc/self/statm)
  between ``on_train_start`` and ``on_train_end``: the training phase's own peak, which the whole
  process's peak (``ru_maxrss``, measured by the parent) can hide when loading peaks higher;
- ``tensors``: torch's view of the persistent state, by summing tensor storage: policy parameters
  (all / trainable), the frozen reference's parameters, the gradients just before the optimizer step, the
  optimizer's state, with their dtypes. On CUDA, also torch.cuda's peak allocated/reserved.
- ``step_s``: wall seconds of each training step (``on_train_batch_start`` to ``on_train_batch_end``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback

from rloo_lightning.runtime.timing import peak_rss_mb

_PAGE = os.sysconf("SC_PAGE_SIZE")
_MIB = 1024 * 1024


def rss_mb() -> float:
    """Current resident set of this process, MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE / _MIB


def hwm_mb() -> float:
    """High-water mark of this process's resident set (VmHWM), MiB; NaN if unreadable."""
    hwm = peak_rss_mb()
    return float("nan") if hwm is None else hwm


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a shared storage is counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        if key not in seen:
            seen.add(key)
            total += s.nbytes()
    return total


def _dtypes(tensors) -> list[str]:
    return sorted({str(t.dtype).removeprefix("torch.") for t in tensors if isinstance(t, torch.Tensor)})


class MemoryProbe(Callback):
    """Records RSS after model load, the training phase's peak RSS, torch's tensor totals and step times."""

    def __init__(self, out: str | None = None, interval: float = 0.01) -> None:
        self.out = out or os.environ.get("MEMORY_PROBE_OUT")
        self.interval = interval
        self.record: dict = {"step_s": []}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peak = 0.0
        self._t0 = 0.0

    # -- sampling ------------------------------------------------------------------------------
    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, rss_mb())
            time.sleep(self.interval)

    # -- hooks ---------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        self.record["start_rss_mb"] = rss_mb()

    def on_train_start(self, trainer, pl_module) -> None:
        self.record["load_rss_mb"] = rss_mb()
        self.record["load_hwm_mb"] = hwm_mb()
        self.record["load_tensors"] = self._tensors(trainer, pl_module)
        self._peak = rss_mb()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.record["grad_mb"] = _storage_bytes(grads) / _MIB
        self.record["grad_dtypes"] = _dtypes(grads)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.record["step_s"].append(time.perf_counter() - self._t0)
        self.record.setdefault("rss_after_step_mb", []).append(rss_mb())

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._peak = max(self._peak, rss_mb())
        self.record["train_peak_rss_mb"] = self._peak
        self.record["end_rss_mb"] = rss_mb()
        self.record["hwm_at_end_mb"] = hwm_mb()
        self.record["tensors"] = self._tensors(trainer, pl_module)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.record["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / _MIB
            self.record["cuda_max_reserved_mb"] = torch.cuda.max_memory_reserved() / _MIB
        self.record["torch_threads"] = torch.get_num_threads()
        self.record["package_file"] = getattr(sys.modules.get(type(pl_module).__module__), "__file__", None)
        if self.out:
            Path(self.out).write_text(json.dumps(self.record, indent=1))

    # -- torch's view --------------------------------------------------------------------------
    @staticmethod
    def _tensors(trainer, pl_module) -> dict:
        policy = pl_module.policy
        params = list(policy.parameters())
        trainable = [p for p in params if p.requires_grad]
        ref = getattr(pl_module, "_ref", None)
        ref_params = list(ref.model.parameters()) if ref is not None else []
        state = []
        for opt in trainer.optimizers:
            for s in opt.state.values():
                state.extend(v for v in s.values() if isinstance(v, torch.Tensor))
        return {
            "policy_params_mb": _storage_bytes(params) / _MIB,
            "policy_param_dtypes": _dtypes(params),
            "trainable_params_mb": _storage_bytes(trainable) / _MIB,
            "num_params": sum(p.numel() for p in params),
            "num_trainable": sum(p.numel() for p in trainable),
            "reference_params_mb": _storage_bytes(ref_params) / _MIB,
            "reference_dtypes": _dtypes(ref_params),
            "optimizer_state_mb": _storage_bytes(state) / _MIB,
            "optimizer_state_dtypes": _dtypes(state),
        }
