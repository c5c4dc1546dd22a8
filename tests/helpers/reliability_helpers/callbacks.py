"""Callbacks for the reliability tests, given to the CLI by class path (``tests/helpers/`` on ``PYTHONPATH``).

* :class:`PoisonReward` puts an inf/NaN into ``rollout.baseline_rewards`` once, at a chosen step
  (a finite task reward, a non-finite loss).
* :class:`PoisonGrad` puts a NaN into one gradient element once, after backward (the loss is
  finite; only the gradient is not), as a low-precision overflow in backward would.
* :class:`RolloutRecorder` appends each rollout's prompts and completions to a JSON-lines file.
* :class:`SigtermAt` sends its own process SIGTERM at a chosen training step or predict batch.
"""

from __future__ import annotations

import json
import os
import signal

from lightning.pytorch import Callback

from rloo_lightning.callbacks import RolloutHook

__all__ = ["PoisonReward", "PoisonGrad", "RolloutRecorder", "SigtermAt"]


class PoisonReward(RolloutHook):
    """Set ``rollout.baseline_rewards[0] = value`` in the first rollout at ``global_step == step``.

    Fires once only: after a skipped step the global step may not advance, and a hook keyed on the
    step alone would poison every later batch too.
    """

    def __init__(self, step: int, value: str = "inf") -> None:
        self.step = step
        self.value = float(value)
        self.fired_at: list[int] = []

    def on_rollout(self, trainer, pl_module, rollout) -> None:
        if trainer.global_step == self.step and not self.fired_at:
            shaped = rollout.baseline_rewards.clone()
            shaped[0] = self.value
            rollout.baseline_rewards = shaped
            self.fired_at.append(trainer.global_step)
            print(f"PoisonReward: baseline_rewards[0] = {self.value} at step {trainer.global_step}", flush=True)


class PoisonGrad(Callback):
    """After backward at ``global_step == step`` (once), set one gradient element of the policy to NaN."""

    def __init__(self, step: int, value: str = "nan") -> None:
        self.step = step
        self.value = float(value)
        self.fired_at: list[int] = []

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step == self.step and not self.fired_at:
            grad = next(p.grad for p in pl_module.policy.parameters() if p.grad is not None)
            grad.view(-1)[0] = self.value
            self.fired_at.append(trainer.global_step)
            print(f"PoisonGrad: grad[0] = {self.value} at step {trainer.global_step}", flush=True)


class RolloutRecorder(RolloutHook):
    """Append ``{rank, global_step, epoch, prompts, completions, rewards, transcripts}`` per rollout to ``path`` (rank
    suffixed)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_rollout_end(self, trainer, pl_module, rollout) -> None:
        k = rollout.k
        record = {
            "rank": trainer.global_rank,
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "prompts": rollout.prompts[::k],
            "completions": rollout.completions,
            "rewards": rollout.rewards.tolist(),
            "transcripts": rollout.columns.get("transcript"),  # multi-turn episodes' messages (else None)
        }
        path = self.path if trainer.global_rank == 0 else f"{self.path}.rank{trainer.global_rank}"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


class SigtermAt(Callback):
    """Send this process SIGTERM (as a scheduler preempting the job) at the end of training step ``step`` (its
    ``global_step`` after the update), of training batch ``batch`` (counted from 0 across epochs: with gradient
    accumulation, between two micro-batches of one step) or of predict batch ``predict_batch``."""

    def __init__(self, step: int = -1, predict_batch: int = -1, batch: int = -1) -> None:
        self.step, self.predict_batch, self.batch = step, predict_batch, batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step or trainer.fit_loop.epoch_loop.total_batch_idx == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if batch_idx == self.predict_batch:
            os.kill(os.getpid(), signal.SIGTERM)
