"""Write ``predict``'s completions to a JSON Lines file as they come."""

from __future__ import annotations

import json
import math
from pathlib import Path

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from rloo_lightning.runtime import sigterm

__all__ = ["PredictionWriter", "prediction_rows"]


def prediction_rows(rollout, prompts: list) -> list[dict]:
    """One JSON-ready dict per completion of a (scored or unscored) rollout, prompt-major.

    Args:
        rollout: :class:`~rloo_lightning.rollout.Rollout` of ``len(prompts) * k`` completions.
        prompts: the batch's prompts as given (strings or messages lists), one per group.

    Returns:
        ``prompt``, ``sample`` (0..k-1), ``completion``, ``num_tokens``, ``truncated``, then ``reward`` and
        ``scores`` when the rollout was scored (NaN, no reward, as null), and the row's other ``columns``.
    """
    lengths = rollout.completion_mask.sum(1).long().tolist()
    rows = []
    for i, completion in enumerate(rollout.completions):
        row = {"prompt": prompts[i // rollout.k], "sample": i % rollout.k, "completion": completion,
               "num_tokens": lengths[i], "truncated": bool(rollout.truncated[i])}
        if rollout.rewards is not None:
            row["reward"] = _number(rollout.rewards[i])
            row["scores"] = {name: _number(values[i]) for name, values in rollout.scores.items()}
        row["columns"] = {name: values[i] for name, values in rollout.columns.items()}
        rows.append(row)
    return rows


def _number(value) -> float | None:
    value = float(value)
    return None if math.isnan(value) else value


class PredictionWriter(BasePredictionWriter):
    """One JSON line per completion from ``predict_step``, written after each batch. A SIGTERM or Ctrl-C stops
    ``predict`` after the batch in progress is written (the process exits with status 143 or 130). A failure leaves
    no output file that reads as complete: none when nothing was written, else the batches done in
    ``<file>.partial``.

    Added by :class:`~rloo_lightning.RLOOModule` (``model.predict.output_file``); idle outside ``predict``.

    Args:
        output_file: the file to write (default ``<trainer.log_dir>/predictions.jsonl``). With several
            processes, rank N writes ``<stem>.rank<N>.jsonl`` beside it. An existing file is an error,
            raised at ``setup``, before the model is loaded: nothing already written is replaced.
    """

    def __init__(self, output_file: str | None = None) -> None:
        super().__init__(write_interval="batch")
        self.output_file = output_file
        self.path: Path | None = None
        self._handle = None

    def _path(self, trainer: Trainer, rank: int | None = None) -> Path:
        path = Path(self.output_file) if self.output_file else Path(
            trainer.log_dir or trainer.default_root_dir) / "predictions.jsonl"
        if trainer.world_size > 1:
            path = path.with_name(f"{path.stem}.rank{trainer.global_rank if rank is None else rank}{path.suffix}")
        return path

    def check(self, trainer: Trainer, option: str = "model.predict.output_file", every_rank: bool = False) -> Path:
        """The file this rank will write; an error naming ``option`` (as the user set it) and the file when it
        exists already (``every_rank``: when any rank's file exists). Touches nothing on disk."""
        for rank in range(trainer.world_size) if every_rank else [None]:
            path = self._path(trainer, rank)
            if path.exists() and self.output_file:
                raise FileExistsError(f"{option}: {path} exists; remove it or choose another file")
            if path.exists():
                raise FileExistsError(f"the predictions file {path} exists (the default, in the log folder); "
                                      f"remove it or set {option} to another file")
        return self._path(trainer)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if getattr(stage, "value", stage) == "predict":
            self.check(trainer)  # before the model is loaded: Lightning calls configure_model after setup

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.path = self.check(trainer)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.path, "x")  # "x": never replaces a file that appeared since the check
        self._written = 0

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx,
                           dataloader_idx=0) -> None:
        for row in prediction:
            self._handle.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        self._handle.flush()
        self._written += len(prediction)
        # Lightning's predict loop never looks at SIGTERM (fit and validation stop at the next batch): stop here,
        # after this batch is on disk; every rank together, so that no rank waits in a collective for another.
        if sigterm.agree(trainer):
            self._handle.close()
            self._handle = None
            rank_zero_info(f"predict stopped by {sigterm.signal_name()} after batch {batch_idx}: {self._written} "
                           f"completions are in {self.path}")
            raise SIGTERMException

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._handle.close()
        self._handle = None  # the command's last line names the file (rloo_lightning.runtime.console.outputs_line)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # A failed predict leaves no output file that reads as the whole: none when nothing was written, else the
        # batches done under <file>.partial, said in one line. (A stop signal keeps them in the file: said above.)
        if self._handle is None or isinstance(exception, SIGTERMException):
            return
        self._handle.close()
        self._handle = None
        if self._written == 0:
            self.path.unlink(missing_ok=True)
            return
        partial = self.path.with_name(self.path.name + ".partial")
        self.path.replace(partial)
        rank_zero_info(f"predict failed after {self._written} completions: they are in {partial}")
