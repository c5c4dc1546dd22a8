"""The process side of a run, registered by ``RLOOModule.configure_callbacks``: torch's CPU threads for each rank,
and where the run is for a stop signal (:mod:`rloo_lightning.runtime.sigterm`)."""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from rloo_lightning.callbacks.checkpoint import ended_optimizer_step
from rloo_lightning.runtime import sigterm
from rloo_lightning.runtime.threads import use_threads

__all__ = ["ProcessRuntime"]


class ProcessRuntime(Callback):
    """Sets torch's thread count before any model is loaded, and tells :mod:`~rloo_lightning.runtime.sigterm` the
    phase of the run, so that a SIGTERM or Ctrl-C stops it where what is kept is whole:

    * ``setup`` from the trainer's setup to the first step's update: a signal ends the run at once (nothing to keep);
    * ``train`` inside a step, ``boundary`` between steps: Lightning stops at the step's end and ``last.ckpt`` holds
      it; a stop between two micro-batches of one optimizer step abandons that step (``FinalCheckpoint`` then writes
      the state at its start);
    * ``validation`` in a validation loop after the first step, ``predict`` in predict.

    The ranks agree at each training batch's end and each validation batch's start (every rank reaches them in the
    same order); the agreement inside a step, after its generation, is ``RLOOModule.sample``'s. The module registers
    it last: its hooks run after every other callback's but Lightning's ``ModelCheckpoint``s (always last), and
    before the module's own (Lightning calls a module's hooks after its callbacks').
    """

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        sigterm.attach(trainer)  # a SIGTERM from now to the first step ends the run at once
        # Before any model is loaded: every rank of this node shares its CPUs (runtime/threads.py)
        rank_zero_info(use_threads(getattr(trainer, "num_devices", 1)))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step > 0:
            sigterm.set_phase("train")  # a SIGTERM now: Lightning stops at this step's end and keeps it

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        if sigterm.phase() == "setup":
            # The first step's update: a stop signal from here keeps this step, at its end (raised at once in its
            # end's hooks instead, it would save Lightning's counters half-updated).
            sigterm.set_phase("train")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        # Lightning stops at this batch's end on a SIGTERM: decided by every rank together; between two
        # micro-batches of one optimizer step the state to keep is the last step's (FinalCheckpoint rewinds).
        if sigterm.agree(trainer) and not ended_optimizer_step(trainer, batch_idx):
            sigterm.abort_step()
        if trainer.global_step > 0:
            sigterm.set_phase("boundary")

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_step > 0 and trainer.training is False:
            sigterm.set_phase("validation")  # a SIGTERM now ends the run at the next token: the step is kept

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_step > 0:
            sigterm.set_phase("boundary")

    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        if trainer.global_step > 0:
            sigterm.between_batches(trainer, "validation")  # every rank together (sigterm.py)

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        sigterm.set_phase("predict")  # from here PredictionWriter stops after the batch in progress is written
