"""StepProgressBar: the training bar counts optimizer steps up to ``max_steps`` and shows a few chosen metrics."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import TQDMProgressBar

__all__ = ["StepProgressBar"]

# metric logged -> its label on the bar
DEFAULT_METRICS = {"train/reward": "reward", "train/kl": "kl", "val/reward": "val_reward"}


class StepProgressBar(TQDMProgressBar):
    """A tqdm bar for RLOO runs: ``Training: 12%|█▏ | 48/400 [..., reward=0.412, kl=0.031, val_reward=0.395]``.

    With ``max_steps`` set, the training bar counts optimizer steps (``trainer.global_step``) up to
    ``max_steps`` across epochs, so it is right under ``accumulate_grad_batches`` and starts at the
    restored step on a resume; with ``max_steps=-1`` it falls back to Lightning's count of the
    epoch's batches. Only ``metrics`` are shown (the latest logged values, on one line), no
    ``v_num``. Validation bars are Lightning's.

    The ``rloo-lightning`` command uses it in place of Lightning's default progress bar; a progress
    bar given in ``trainer.callbacks`` (or ``enable_progress_bar: false``) replaces it.

    Args:
        metrics: the logged metrics to show, as ``{name: label}`` or a list of names (labelled by
            their names); default ``train/reward``, ``train/kl`` and ``val/reward``.
        refresh_rate, process_position, leave: as for :class:`~lightning.pytorch.callbacks.TQDMProgressBar`.
    """

    def __init__(self, metrics: dict[str, str] | list[str] | None = None, refresh_rate: int = 1,
                 process_position: int = 0, leave: bool = False) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        metrics = DEFAULT_METRICS if metrics is None else metrics
        self.metrics = dict(metrics) if isinstance(metrics, dict) else {name: name for name in metrics}

    @staticmethod
    def counts_steps(trainer) -> bool:
        """Whether the training bar counts optimizer steps (``max_steps`` set) rather than the epoch's batches."""
        return trainer.max_steps is not None and trainer.max_steps > 0

    def training_total(self, trainer) -> int | None:
        """The training bar's total: ``max_steps``, else the epoch's batches (None when unknown)."""
        if self.counts_steps(trainer):
            return int(trainer.max_steps)
        total = self.total_train_batches
        return None if total is None or total == float("inf") else int(total)

    def training_position(self, trainer, batch_idx: int) -> int:
        """The training bar's count after batch ``batch_idx``: the optimizer steps done, else the epoch's batches."""
        return int(trainer.global_step) if self.counts_steps(trainer) else batch_idx + 1

    def on_train_start(self, trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        self._fresh = True
        if self.counts_steps(trainer):
            self._start_steps(trainer)

    def on_train_epoch_start(self, trainer, *args: Any) -> None:
        if not self.counts_steps(trainer):
            super().on_train_epoch_start(trainer, *args)
            return
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        if self._leave or getattr(self, "_fresh", True):  # once per fit: the clock starts with the first epoch
            self._fresh = False
            self._start_steps(trainer)

    def _start_steps(self, trainer) -> None:
        """The training bar at the (restored) step of ``max_steps``; its rate counts this run's steps only."""
        bar = self.train_progress_bar
        bar.reset(total=trainer.max_steps)
        bar.initial = bar.n = int(trainer.global_step)
        bar.unit = "step"
        bar.set_description("Training")  # refreshes the bar

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not self.counts_steps(trainer):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        bar, n = self.train_progress_bar, self.training_position(trainer, batch_idx)
        # under gradient accumulation most batches make no step: the bar moves on optimizer steps only
        if bar is None or bar.disable or n == bar.n or not self._should_update(n, bar.total):
            return
        bar.n = n
        bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        """The chosen metrics' latest values (those logged so far), under their labels; no ``v_num``."""
        logged = trainer.callback_metrics
        items: dict[str, Any] = {}
        for name, label in self.metrics.items():
            value = logged.get(name)
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    continue
                value = value.item()
            if value is not None:
                items[label] = value
        return items
