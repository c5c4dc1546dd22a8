"""The rollout hook (the one point of the step callbacks may edit) and the validation pass at step 0."""

from __future__ import annotations

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torchmetrics import MeanMetric

from rloo_lightning.runtime import sigterm
from rloo_lightning.callbacks.progress import EvaluationProgress

__all__ = ["RolloutHook", "ValidateAtStart", "call_rollout_hooks"]


class RolloutHook(Callback):
    """A callback that sees each rollout between scoring and the advantages.

    Lightning has no hook there; :class:`rloo_lightning.RLOOModule` calls ``on_rollout`` on every
    trainer callback that subclasses this one, in the trainer's callback order.

    At that point ``rollout.scores``, ``rollout.rewards`` (the task reward r), ``rollout.kl`` (None when
    beta == 0) and ``rollout.baseline_rewards`` (r - beta*kl, what the baseline uses) are set, and
    ``rollout.keep`` is all True (but for truncated rows under ``shaping.mask_truncated_completions``). A hook
    may replace ``baseline_rewards`` or set rows of ``keep`` to False: dropped rows get advantage 0 and leave
    the loss's average.
    """

    def on_rollout(self, trainer: Trainer, pl_module: LightningModule, rollout) -> None:
        """Read or edit ``rollout`` (a :class:`rloo_lightning.rollout.Rollout`) before the advantages."""

    def on_rollout_end(self, trainer: Trainer, pl_module: LightningModule, rollout) -> None:
        """Read ``rollout`` after the advantages (``rollout.advantages``) and the loss are computed."""


def call_rollout_hooks(trainer, pl_module: LightningModule, hook: str, rollout) -> None:
    """``on_rollout`` (may edit) or ``on_rollout_end`` (read-only) on each :class:`RolloutHook` of ``trainer``'s
    callbacks, in their order."""
    for callback in trainer.callbacks:
        if isinstance(callback, RolloutHook):
            getattr(callback, hook)(trainer, pl_module, rollout)


class ValidateAtStart(Callback):
    """Evaluate the validation prompts before the first update and log ``val/*`` at step 0.

    Lightning's sanity check runs validation but discards its metrics, so the starting point of
    every ``val/`` curve would be missing. Skipped on resume (global step > 0). Evaluates as many
    batches as the trainer's ``limit_val_batches`` allows, like every later validation, and shows its progress
    on the trainer's :class:`~rloo_lightning.callbacks.StepProgressBar` like every later validation.
    """

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_step > 0 or trainer.datamodule is None:
            return
        loader = trainer.datamodule.val_dataloader()
        limit = trainer.limit_val_batches
        num_batches = len(loader)
        if isinstance(limit, int):
            num_batches = min(num_batches, limit)
        elif limit is not None:
            num_batches = int(num_batches * limit)
        if num_batches == 0:
            return
        means: dict[str, MeanMetric] = {}
        progress = EvaluationProgress(trainer, "validation (before training)", num_batches)  # the trainer's bar
        with torch.no_grad():
            for batch_idx, batch in enumerate(loader):
                if batch_idx >= num_batches:
                    break
                sigterm.between_batches(trainer, "validation")
                batch = pl_module.transfer_batch_to_device(batch, pl_module.device, 0)
                for name, values in pl_module.evaluate_batch(batch, batch_idx).items():
                    means.setdefault(name, MeanMetric(nan_strategy="ignore").to(pl_module.device)).update(values)
                progress.advance()
        # MeanMetric.compute reduces sums and counts across ranks.
        metrics = {f"val/{name}": metric.compute().item() for name, metric in means.items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=0)
        if not progress.close(metrics):  # plain progress lines: their last one has the metrics
            pl_module.print(f"validation before training: {metrics}")
