"""``last.ckpt`` at the end of every fit, optionally every N steps, and never stale after a resume."""

from __future__ import annotations

import copy
import os
import shutil
import time
from typing import Protocol, runtime_checkable

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from rloo_lightning.callbacks.checkpoint_space import LAST, checkpoint_bytes, is_local, same_path, space_problem
from rloo_lightning.runtime import framework, sigterm
from rloo_lightning.runtime.atomic_checkpoint import (
    NoSpaceError,
    atomic_copy,
    install_atomic_checkpoint_io,
    no_space_error,
    remove_stale_temps,
    replace_path,
    saves_a_folder,
    staging_path,
)

__all__ = ["FinalCheckpoint", "HasCheckpointEntries", "FAILURE_CHECKPOINT"]

#: After a fit that failed past its first step: ``{"path", "step"}`` of the ``last.ckpt`` it leaves (the CLI's last
#: line names it); empty when none was written.
FAILURE_CHECKPOINT: dict = {}


@runtime_checkable
class HasCheckpointEntries(Protocol):
    """A module that adds entries of its own to each checkpoint (``RLOOModule``: its skipped steps, moving average,
    reused rollout, moving reference). :class:`FinalCheckpoint` keeps them at every step's end, and a stop that
    abandons a step writes those."""

    def checkpoint_entries(self, step_end: bool = False) -> dict:
        """The top-level entries its ``on_save_checkpoint`` adds, as a checkpoint written now holds them. With
        ``step_end`` (kept at a step's end) an entry may be deferred: an object whose ``resolve()`` gives the value
        when a checkpoint of that step's end is written (every rank calls it then; a copy of it is itself)."""


class FinalCheckpoint(Callback):
    """Write ``last.ckpt`` when fit ends, when it is stopped by SIGTERM (preemption: the process then exits with
    status 143) or Ctrl-C (status 130; :mod:`rloo_lightning.runtime.sigterm`), and every ``every_n_steps`` optimizer
    steps, beside the checkpoints.

    Lightning's ``ModelCheckpoint`` saves on its own triggers only: with validation off, or a ``max_steps``
    that ``val_check_interval`` does not divide, the steps after its last trigger are lost. This callback
    adds one checkpoint of the final state, ``last.ckpt``, in the folder of the trainer's first
    ``ModelCheckpoint`` (its ``dirpath``: by default ``<logger dir>/checkpoints``). It never replaces or
    changes what a ``ModelCheckpoint`` saves; it only writes ``last.ckpt`` where none of the final step was
    written yet (a ``ModelCheckpoint(save_last=True)`` that just saved is left alone). Nothing is written
    when checkpointing is off (``enable_checkpointing=False``: no checkpoint callback) or no step was taken.

    After a resume ``last.ckpt`` stays the newest checkpoint of the folder:

    * a ``ModelCheckpoint`` restored from a checkpoint written before its first ``last.ckpt`` (its
      ``last_model_path`` is empty then) would find a ``last.ckpt`` on disk and write ``last-v1.ckpt``
      from then on, leaving ``last.ckpt`` stale; on resume its ``last_model_path`` is pointed back at
      ``last.ckpt`` (the folder's ``last.ckpt`` is the run's own: the run resumes there);
    * resumed from another checkpoint of the same folder (a step file, ``last-v1.ckpt``), that checkpoint
      is copied to ``last.ckpt`` (bit for bit: resuming from either is the same) before the first step,
      so a crash before the next save does not leave ``last.ckpt`` two or more steps behind.

    Before training (``on_fit_start``: the model built, the optimizers made, nothing generated yet) it checks that
    the checkpoint folder's filesystem can take the checkpoints the fit writes (:meth:`check_space`), so that a
    full disk stops the run before the compute rather than losing it at the first save.

    Stateless: nothing of it is in the checkpoint. Runs on every rank (``trainer.save_checkpoint`` is
    collective under DDP and the sharded strategies); file copies are made on global rank 0.

    Args:
        every_n_steps: also write ``last.ckpt`` every N optimizer steps (0: only at the end of fit).
        every_minutes: also write it at the first optimizer step's end this many minutes after the last write (0:
            never). A failure other than a stop signal writes the last finished step where one process can (see
            :meth:`_keep_after_failure`).
    """

    def __init__(self, every_n_steps: int = 0, every_minutes: float = 0.0) -> None:
        if every_n_steps < 0:
            raise ValueError(f"FinalCheckpoint: every_n_steps must be >= 0, got {every_n_steps}")
        if every_minutes < 0:
            raise ValueError(f"FinalCheckpoint: every_minutes must be >= 0, got {every_minutes}")
        self.every_n_steps, self.every_minutes = every_n_steps, every_minutes
        self._last_write = time.monotonic()  # of the last last.ckpt, or of training's start
        self._saved_step: int | None = None  # global step of the last.ckpt written in this fit, if any
        self._train_started = False
        self._boundary: dict | None = None  # the state at the end of the last step (one process)
        self._boundary_step: int | None = None  # its optimizer step
        self._size: int | None = None  # estimated bytes of one checkpoint (check_space), for a failed save's message

    # -- where -------------------------------------------------------------------------------------
    @staticmethod
    def _enabled(trainer: Trainer) -> bool:
        return (
            bool(trainer.checkpoint_callbacks)
            and not trainer.fast_dev_run
            and trainer.state.fn == TrainerFn.FITTING
        )

    @staticmethod
    def dirpath(trainer: Trainer, broadcast: bool = True) -> str:
        """The first ``ModelCheckpoint``'s folder, else where Lightning's default one would write."""
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None:
                return str(cb.dirpath)
        if trainer.loggers:
            logger = trainer.loggers[0]
            save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
            version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
            path = os.path.join(save_dir, str(logger.name), version, "checkpoints")
        else:
            path = os.path.join(trainer.default_root_dir, "checkpoints")
        return trainer.strategy.broadcast(path) if broadcast else path  # loggers name versions on rank 0

    def last_path(self, trainer: Trainer, broadcast: bool = True) -> str:
        return os.path.join(self.dirpath(trainer, broadcast), LAST)

    # -- hooks -------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._saved_step = None
        self._train_started = False

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After the strategy's setup (model built and sharded, optimizers made), before the validation at start
        # and the first step: a full disk is found before the compute.
        if self._enabled(trainer):
            self.check_space(trainer, pl_module)

    def check_space(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Raise :class:`~rloo_lightning.runtime.atomic_checkpoint.NoSpaceError` (one line: the folder, the estimate,
        the free space) when the filesystem of the checkpoint folder has less free space than the checkpoints of
        this fit need at once.

        One checkpoint: :func:`checkpoint_bytes` (a lower bound). At once: ``last.ckpt``, the files each
        ``ModelCheckpoint`` on the same filesystem keeps (``save_top_k``, at least 1; its own ``save_last`` file
        if it is another; none for one that cannot save during this fit: no validation and no step or time
        trigger), and one more being written beside them (every save writes the new file before the old one goes).
        Checkpoint files already in those folders are counted as free (they are replaced or rotated). Every rank
        estimates (FSDP1 sums its shards); global rank 0 reads the free space (a file checkpoint is written by it,
        a sharded one into the folder every rank shares, which rank 0 swaps in) and every rank raises together.
        Remote (fsspec URL) folders are not checked.
        """
        size = checkpoint_bytes(trainer, pl_module)  # every rank: a collective under FSDPStrategy
        self._size = size
        folder = self.dirpath(trainer)
        message = None
        if trainer.is_global_zero and "://" not in folder:  # a local folder (ModelCheckpoint resolves file://)
            message = space_problem(trainer, folder, size)
        message = trainer.strategy.broadcast(message)
        if message:
            raise NoSpaceError(message, folder)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Every state is restored by now (also under strategies that restore after their setup).
        self._train_started = True
        self._last_write = time.monotonic()
        if not self._enabled(trainer) or trainer.ckpt_path is None:
            return
        target = self.last_path(trainer)
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.save_last and _plain_last_name(cb):
                cb.last_model_path = os.path.join(str(cb.dirpath), cb.CHECKPOINT_NAME_LAST + cb.FILE_EXTENSION)
        self._refresh_after_resume(trainer, target)

    def _keep_boundary(self, trainer: Trainer, pl_module: LightningModule, where: str) -> None:
        """The state a stop at this step's end saves, for a SIGTERM inside the next step (sigterm.py): what a step
        changes before its optimizer step (the weights, optimizer and schedulers change only there)."""
        if trainer.global_step > 0 and self._enabled(trainer):
            self._boundary = _boundary_state(trainer, pl_module, where)
            self._boundary_step = trainer.global_step

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and self._boundary is not None:
            self._keep_boundary(trainer, pl_module, "validation")  # a validation at the step's end changed it

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._boundary is not None:
            self._keep_boundary(trainer, pl_module, "epoch")  # so did the end of the epoch

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if ended_optimizer_step(trainer, batch_idx):
            self._keep_boundary(trainer, pl_module, "batch")
        step = trainer.global_step
        if step == 0 or self._saved_step == step or not self._enabled(trainer):
            return
        if (self.every_n_steps > 0 and step % self.every_n_steps == 0) or self._minutes_passed(trainer, batch_idx):
            self._save(trainer)

    def _minutes_passed(self, trainer: Trainer, batch_idx: int) -> bool:
        """At an optimizer step's end: ``every_minutes`` since the last write, by rank 0's clock (broadcast: every
        rank writes or none; each rank reaches every step's end in the same order)."""
        if self.every_minutes <= 0 or not ended_optimizer_step(trainer, batch_idx):
            return False
        due = time.monotonic() - self._last_write >= 60.0 * self.every_minutes
        return bool(trainer.strategy.broadcast(due)) if trainer.world_size > 1 else due

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Here, not in on_fit_end: that runs after the strategy's teardown (model moved off the device).
        if self._enabled(trainer) and not self._last_is_current(trainer):
            self._save(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        FAILURE_CHECKPOINT.clear()
        if not self._enabled(trainer) or trainer.global_step == 0:
            return
        if not isinstance(exception, SIGTERMException):
            self._keep_after_failure(trainer, exception)
            return
        # Preempted: SIGTERMException on every rank together (sigterm.py decides where), so the steps since the last
        # checkpoint are kept as a resumable last.ckpt.
        if sigterm.aborted_step():  # stopped inside a step: its start's state, as a stop at the step before writes
            if self._saved_step != trainer.global_step and self._boundary is not None:
                self._save(trainer, rewind=self._boundary)
        elif not self._last_is_current(trainer):
            self._save(trainer)
        path = self.last_path(trainer)
        rank_zero_info(f"stopped by {sigterm.signal_name()} after step {trainer.global_step}; {path} holds that step: "
                       f"resume with --ckpt_path {path}")

    def _keep_after_failure(self, trainer: Trainer, exception: BaseException) -> None:
        """Any other failure (an engine or server gone, a stall, an environment or reward error under ``raise``, a
        non-finite stop, ...): ``last.ckpt`` of the last finished step, as a stop inside the step writes it (the
        boundary state, whose resume is bit-identical), and :data:`FAILURE_CHECKPOINT` says where, for the run's
        last line. With several ranks the write is collective: it is made when every rank failed together inside a
        step (:class:`~rloo_lightning.runtime.sigterm.StepFailed`: a rank's engine, environment or reward failing in
        a step's generation or scoring); after any other failure the other ranks are elsewhere (in their next
        collective, or gone): nothing is written then, and the last periodic ``last.ckpt`` stays
        (``run.checkpoint_every_minutes``); the same when the failure came after a step's optimizer step but before
        its end (the weights are then newer than every state this callback holds)."""
        path = self.last_path(trainer, broadcast=False)
        # sigterm.StepFailed: every rank raised it at the same agreement point, outside any collective: they write
        # together.
        together = trainer.world_size == 1 or isinstance(exception, sigterm.StepFailed)
        if together and self._saved_step != trainer.global_step:
            if self._boundary is None or self._boundary_step != trainer.global_step:
                rank_zero_info(f"failed during step {trainer.global_step + 1}, after its update: no consistent state "
                               "to write")
            else:
                try:
                    self._save(trainer, rewind=self._boundary)
                except Exception as error:  # the failure is the run's story: this one is said, not raised
                    rank_zero_info(f"{LAST} not written after the failure: {error}")
        if self._saved_step is not None and os.path.exists(path):
            FAILURE_CHECKPOINT.update(path=path, step=self._saved_step)

    def _last_is_current(self, trainer: Trainer) -> bool:
        """No step taken, or ``last.ckpt`` already holds this step (written by this callback or by a
        ``ModelCheckpoint(save_last=True)`` that just saved it)."""
        if trainer.global_step == 0 or self._saved_step == trainer.global_step:
            return True
        target = self.last_path(trainer)
        return any(
            isinstance(cb, ModelCheckpoint)
            and cb.save_last
            and same_path(cb.last_model_path, target)
            and framework.last_saved_step(cb) == trainer.global_step
            for cb in trainer.checkpoint_callbacks)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Resumed at or past max_steps: the fit loop is skipped (no on_train_start/end), nothing trains,
        # and last.ckpt is only brought up to the checkpoint resumed from (a file copy needs no model).
        # After the teardown: no collective here, rank 0 alone copies.
        if not self._train_started and self._enabled(trainer) and trainer.ckpt_path is not None:
            self._refresh_after_resume(trainer, self.last_path(trainer, broadcast=False), collective=False)

    # -- how ---------------------------------------------------------------------------------------
    def _save(self, trainer: Trainer, rewind: dict | None = None) -> None:
        """Write ``last.ckpt`` so that a kill at any moment leaves the previous one or this one; with ``rewind`` (a
        stop abandoned the step in progress), the checkpoint of the step's start (:func:`_rewound`).

        Every rank: a collective under DDP / FSDP. A full checkpoint (optimizer, loops, callbacks): resumable.
        A file goes through :class:`~rloo_lightning.runtime.atomic_checkpoint.AtomicCheckpointIO` (installed here if the
        strategy still has Lightning's default IO: a trainer made outside the CLI). A folder (a sharded
        strategy's: it bypasses the checkpoint IO) is saved under a hidden name beside ``last.ckpt`` and swapped
        in by global rank 0 once every rank has written its shards.
        """
        target = self.last_path(trainer)
        install_atomic_checkpoint_io(trainer.strategy)
        before = sigterm.phase()
        sigterm.set_phase("saving")  # a SIGTERM during the write waits for it
        try:
            if saves_a_folder(trainer.strategy) and is_local(target):
                staged = trainer.strategy.broadcast(staging_path(target))  # rank 0's name, the same on every rank
                try:
                    _write(trainer, staged, rewind)  # ends with a barrier: every shard is written
                except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException is no Exception
                    # The save is collective: every rank is done with the folder. The previous last.ckpt is whole.
                    shutil.rmtree(staged, ignore_errors=True)
                    error = no_space_error(exc, target, self._size)
                    if error is not None and error is not exc:
                        raise error from exc
                    raise
                if trainer.is_global_zero:
                    remove_stale_temps(os.path.dirname(staged))
                    replace_path(staged, target)
                trainer.strategy.barrier("FinalCheckpoint.save")
            else:
                _write(trainer, target, rewind)
        finally:
            sigterm.set_phase(before)
        self._saved_step = trainer.global_step
        self._last_write = time.monotonic()

    def _refresh_after_resume(self, trainer: Trainer, target: str, collective: bool = True) -> None:
        """Copy the checkpoint resumed from to ``target`` when it is another checkpoint of the same folder.

        Decided on global rank 0 (the one that writes checkpoints) and broadcast, so that every rank
        takes the same branch and meets the barrier after the copy.
        """
        source = str(trainer.ckpt_path)
        if same_path(source, target):
            self._saved_step = trainer.global_step  # resumed from last.ckpt itself: it is the newest
            return
        copy = (
            is_local(source)
            and is_local(target)
            and same_path(os.path.dirname(source), os.path.dirname(target))  # else no stale last.ckpt here
            and os.path.exists(source)
        )
        if collective:
            copy = trainer.strategy.broadcast(copy)
        if not copy:
            return
        if trainer.is_global_zero:
            _atomic_copy(source, target)
        if collective:
            trainer.strategy.barrier("FinalCheckpoint.refresh")
        self._saved_step = trainer.global_step


def ended_optimizer_step(trainer: Trainer, batch_idx: int) -> bool:
    """Whether an optimizer step ended with training batch ``batch_idx`` (every ``accumulate_grad_batches``
    batches, and at an epoch's last batch); for ``on_train_batch_end``."""
    return (batch_idx + 1) % trainer.accumulate_grad_batches == 0 \
        or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch


def start_next_epoch(loops: dict | None) -> None:
    """Written after an epoch ended (a stop at its last step, the state kept for it): the epoch loop's counters as
    the next epoch starts them (Lightning resets them then, not at the epoch's end).

    Otherwise a run resumed from it continues the finished epoch: its ``is_last_batch`` and per-epoch batch count
    make the next epoch's first micro-batch an optimizer step of its own under gradient accumulation (measured:
    the resumed run then leaves the uninterrupted one). In place; a no-op for any other checkpoint."""
    fit = (loops or {}).get("fit_loop")
    if not fit or "epoch_progress" not in fit or "epoch_loop.batch_progress" not in fit:
        return
    epoch, batches = fit["epoch_progress"]["current"], fit["epoch_loop.batch_progress"]
    if not (batches.get("is_last_batch") and epoch["completed"] == epoch["ready"] > 0):
        return
    batches["is_last_batch"] = False
    optimizer = fit.get("epoch_loop.automatic_optimization.optim_progress", {}).get("optimizer", {})
    for progress in (batches, fit.get("epoch_loop.scheduler_progress", {}), optimizer.get("step", {}),
                     optimizer.get("zero_grad", {})):
        if "current" in progress:
            progress["current"] = {key: 0 for key in progress["current"]}


def _boundary_state(trainer: Trainer, pl_module: LightningModule, where: str) -> dict:
    """What a checkpoint written at this step's end holds and the next step may change before its optimizer step:
    the loops (their counters as at that end), the callbacks' states, the module's own entries and its small
    buffers. Copied, so the next step's changes do not reach it; the weights are not (they change only at the
    optimizer step), except a reference that a step mixes first (``kl.ref_sync_steps``), whose entry is cloned.

    ``where`` it is taken decides which of Lightning's counters are still to come at that step's end:
    ``batch`` (``on_train_batch_end``: the batch completed, the step for the loggers), ``validation`` (a validation
    after it: the step for the loggers) or ``epoch`` (the epoch's end after it: the epoch completed)."""
    loops = copy.deepcopy(framework.loops_state(trainer))
    fit = loops["fit_loop"]
    counted = {"batch": [("epoch_loop.batch_progress", "completed")], "validation": [], "epoch": [
        ("epoch_progress", "completed")]}[where]
    for progress, counter in counted:
        for scope in ("total", "current"):
            fit[progress][scope][counter] += 1
    if where != "epoch":
        fit["epoch_loop.state_dict"]["_batches_that_stepped"] += 1
    extras = pl_module.checkpoint_entries(step_end=True) if isinstance(pl_module, HasCheckpointEntries) else {}
    extras = {key: _cloned(value) if key == "rloo_reference" else copy.deepcopy(value) for key, value in extras.items()}
    buffers = {name: value.detach().clone() for name, value in pl_module.named_buffers() if value.numel() < 1024}
    return {"loops": loops, "callbacks": copy.deepcopy(framework.callbacks_state(trainer)), "extras": extras,
            "buffers": buffers}


def _write(trainer: Trainer, path: str, rewind: dict | None) -> None:
    """``trainer.save_checkpoint(path)``; with ``rewind`` (:func:`_boundary_state`), the checkpoint rewound to it
    once every hook has made it (:func:`_rewound`)."""
    if rewind is None:
        trainer.save_checkpoint(path, weights_only=False)
    else:
        framework.save_checkpoint_edited(trainer, path, lambda checkpoint: _rewound(checkpoint, rewind,
                                                                                    trainer.lightning_module))


def _rewound(checkpoint: dict, boundary: dict, pl_module: LightningModule) -> None:
    """``checkpoint``, just made inside a step that a stop abandoned, as a save at the step's start made it: its loops,
    callbacks, the module's own entries (in place of those it holds now) and small buffers are the boundary's
    (``last.ckpt`` then holds the step before, as a stop at that step's end would have written it)."""
    checkpoint["loops"], checkpoint["callbacks"] = boundary["loops"], boundary["callbacks"]
    for key in pl_module.checkpoint_entries() if isinstance(pl_module, HasCheckpointEntries) else ():
        checkpoint.pop(key, None)
    checkpoint.update({key: value.resolve() if callable(getattr(value, "resolve", None)) else value
                       for key, value in copy.deepcopy(boundary["extras"]).items()})
    for name, value in boundary["buffers"].items():
        if name in checkpoint["state_dict"]:
            checkpoint["state_dict"][name] = value.clone()
    start_next_epoch(checkpoint.get("loops"))


def _cloned(state: dict) -> dict:
    return {key: value.detach().clone() if hasattr(value, "detach") else copy.deepcopy(value)
            for key, value in state.items()}


def _plain_last_name(cb: ModelCheckpoint) -> bool:
    """``last`` without ``{metric}`` fields, and a folder: its last checkpoint has one fixed path."""
    return cb.dirpath is not None and "{" not in cb.CHECKPOINT_NAME_LAST and is_local(str(cb.dirpath))


def _atomic_copy(source: str, target: str) -> None:
    """Copy a checkpoint file (or a sharded checkpoint folder) to ``target``.

    The copy is staged beside ``target`` (a hidden ``.last.ckpt.tmp-...`` name; never in ``$TMPDIR``, which
    may be another filesystem, where a move is a copy again) and renamed over it: a kill leaves the old
    ``target`` or the whole copy. A symlink ``target`` (``save_last="link"``) is replaced, not the file it
    points to. See :func:`rloo_lightning.runtime.atomic_checkpoint.atomic_copy`.
    """
    atomic_copy(source, target)
