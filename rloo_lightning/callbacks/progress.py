"""StepProgressBar: a tqdm bar on a terminal, plain progress lines in a file; the training bar counts optimizer
steps up to ``max_steps`` and shows a few chosen metrics.

The plain lines (written when stdout is not a terminal: a file, a pipe, a cluster's job log) look like::

    validation (before training) 1/8 batches | 0.0527 s/batch | elapsed 0.1s | eta 0.4s
    validation (before training) 8/8 batches | 0.0346 s/batch | done in 0.3s | reward 0.2866 | reward_greedy 0.3218
    train step 1/60 | 0.0927 s/step | elapsed 0.1s | eta 5.5s | reward 0.3669 | kl 0
    train step 11/60 | 0.103 s/step | elapsed 1.1s | eta 5.0s | reward 0.3031 | kl 2.135
    validation (step 30) 8/8 batches | 0.0384 s/batch | done in 0.3s | reward 0.3618 | reward_greedy 0.3863
    train step 60/60 | 0.0903 s/step | done in 5.4s | reward 0.4707 | kl 2.213 | val_reward 0.4051

One line at the first update of a stage, then at most one every ``interval`` seconds, and one at the end of the
stage (``done in``; ``stopped after`` when it ended before its total). See ``docs/console.md``.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Callable, TextIO

import torch
from lightning.pytorch.callbacks import TQDMProgressBar

from rloo_lightning.runtime import framework
from rloo_lightning.runtime.console import is_terminal, write_line

__all__ = ["StepProgressBar", "LineBar", "EvaluationProgress", "format_duration", "format_rate", "format_value"]

# metric logged -> its label on the bar
DEFAULT_METRICS = {"train/reward": "reward", "train/kl": "kl", "val/reward": "val_reward"}
DEFAULT_INTERVAL = 30.0  # seconds between two plain progress lines of a stage (first and last lines aside)


def format_duration(seconds: float) -> str:
    """``0.4s``, ``12s``, ``3m05s``, ``2h07m``: tenths under 10 s, whole seconds under a minute."""
    if not math.isfinite(seconds):
        return "?"
    seconds = max(0.0, seconds)
    if seconds < 9.95:
        return f"{seconds:.1f}s"
    whole = int(round(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    minutes = (whole + 30) // 60
    return f"{minutes // 60}h{minutes % 60:02d}m"


def format_rate(seconds: float) -> str:
    """Seconds per unit with three significant digits: ``0.0712``, ``3.1``, ``12.3``, ``125``."""
    if not math.isfinite(seconds):
        return "?"
    return f"{seconds:.0f}" if seconds >= 100 else f"{seconds:.3g}"


def format_value(value: Any) -> str:
    """A metric's value on a line: four significant digits (``0.4123``, ``1235``, ``nan``); text as it is."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:.4g}"


class LineBar:
    """What :class:`StepProgressBar` uses in place of a tqdm bar when its output is not a terminal: plain lines.

    It has the part of tqdm's interface that Lightning's progress bar uses (``n``, ``total``, ``initial``,
    ``reset``, ``update``, ``refresh``, ``set_postfix``, ``set_description``, ``close``, ``write``, ``disable``),
    and writes nothing but whole lines, flushed as written:

    * ``<stage> step <n>/<total>`` (``unit="step"``) or ``<stage> <n>/<total> batches``, then ``<r> s/<unit>``
      (the mean over this stage's units so far), ``elapsed <t> | eta <t>``, and ``<label> <value>`` for each
      metric of ``postfix``;
    * one line at the first update, then at most one every ``interval`` seconds (a line only when ``n`` moved
      since the last line: never the same position twice);
    * one last line when the stage ends (``close``, or ``reset`` for the next loader or epoch), with
      ``done in <t>`` (``stopped after <t>`` when ``n`` did not reach ``total``) and ``final_metrics`` after
      ``postfix``. A position that reaches ``total`` is written by that last line only.

    Args:
        stage: what the line starts with (``train``, ``validation (step 100)``, ``test``, ...).
        unit: ``step`` or ``batch``.
        interval: the least seconds between two lines of the stage (0: a line at every update).
        disable: write nothing (ranks other than 0).
        stream: where to write (default: ``sys.stdout`` as it is when writing).
        clock: seconds, monotonic (a fake one in tests).
    """

    def __init__(self, stage: str, unit: str = "batch", interval: float = DEFAULT_INTERVAL, disable: bool = False,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.stage, self.unit, self.interval, self.disable = stage, unit, float(interval), disable
        self.stream, self.clock = stream, clock
        self.total: int | None = None
        self.n = self.initial = 0
        self.postfix: dict[str, Any] = {}
        self.final_metrics: dict[str, Any] = {}
        self.closed = False
        self._start()

    def _start(self) -> None:
        self.start_t = self.clock()
        self._printed_n: int | None = None  # position of the last line written
        self._printed_at: float | None = None  # when it was written

    # -- tqdm's interface, as Lightning uses it ----------------------------------------------------------
    def reset(self, total: int | float | None = None) -> None:
        """Start over (the next dataloader, epoch or run); a stage with progress not written ends with its line."""
        self._finish()
        self.closed = False
        self.n = self.initial = 0
        if total is not None:
            self.total = total
        self.final_metrics = {}
        self._start()

    def update(self, n: int = 1) -> None:
        self.n += n
        self.refresh()

    def refresh(self, nolock: bool = False, lock_args: Any = None) -> None:
        """Write a line if ``n`` moved since the last one, ``interval`` has passed and ``n`` is not the total."""
        if self.disable or self.closed or self.n <= self.initial or self.n == self._printed_n:
            return
        if self.total is not None and self.n >= self.total:
            return  # the stage's last line says it, with its duration
        now = self.clock()
        if self._printed_at is not None and now - self._printed_at < self.interval:
            return
        self._write(self.line(now), now)

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs: Any) -> None:
        self.postfix = {**(ordered_dict or {}), **kwargs}
        if refresh:
            self.refresh()

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        """Lightning's ``Epoch <n>`` (an epoch-based training bar) becomes ``train epoch <n>``; other descriptions
        (``Validation DataLoader 0``, ...) leave the stage as it was named."""
        if desc and desc.startswith("Epoch "):
            self.stage = f"train epoch {desc[len('Epoch '):]}"

    def close(self) -> None:
        """End the stage: its last line (when it made progress), then nothing more."""
        self._finish()
        self.closed = True

    def abandon(self) -> None:
        """End without a last line (an error is on its way)."""
        self.closed = True

    def clear(self, nolock: bool = False) -> None:
        """Nothing to clear: every line is whole."""

    def write(self, s: str, file: TextIO | None = None, end: str = "\n", nolock: bool = False) -> None:
        """Write ``s`` as a line of its own (``LightningModule.print`` comes here)."""
        write_line(s + end.rstrip("\n"), file or self._stream())

    # -- the lines ---------------------------------------------------------------------------------------
    def line(self, now: float | None = None, final: bool = False) -> str:
        now = self.clock() if now is None else now
        elapsed = now - self.start_t
        done = self.n - self.initial
        total = "?" if self.total is None else int(self.total)
        fields = [f"{self.stage} step {self.n}/{total}" if self.unit == "step" else
                  f"{self.stage} {self.n}/{total} batches"]
        per_unit = elapsed / done if done > 0 else math.nan
        if done > 0:
            fields.append(f"{format_rate(per_unit)} s/{self.unit}")
        if final:
            ended = self.total is None or self.n >= self.total
            fields.append(f"{'done in' if ended else 'stopped after'} {format_duration(elapsed)}")
        else:
            fields.append(f"elapsed {format_duration(elapsed)}")
            if self.total is not None and done > 0:
                fields.append(f"eta {format_duration((self.total - self.n) * per_unit)}")
        metrics = {**self.postfix, **(self.final_metrics if final else {})}
        fields += [f"{label} {format_value(value)}" for label, value in metrics.items()]
        return " | ".join(fields)

    def _finish(self) -> None:
        if self.disable or self.closed or self.n <= self.initial:
            return
        now = self.clock()
        self._write(self.line(now, final=True), now)

    def _write(self, text: str, now: float) -> None:
        write_line(text, self._stream())
        self._printed_n, self._printed_at = self.n, now

    def _stream(self) -> TextIO:
        return sys.stdout if self.stream is None else self.stream


class StepProgressBar(TQDMProgressBar):
    """The ``rloo-lightning`` progress display: a tqdm bar on a terminal, plain lines otherwise.

    On a terminal: ``Training: 12%|█▏ | 48/400 [..., reward=0.412, kl=0.031, val_reward=0.395]``. With
    ``max_steps`` set, the training bar counts optimizer steps (``trainer.global_step``) up to
    ``max_steps`` across epochs, so it is right under ``accumulate_grad_batches`` and starts at the
    restored step on a resume; with ``max_steps=-1`` it falls back to Lightning's count of the
    epoch's batches. Only ``metrics`` are shown (the latest logged values, on one line), no
    ``v_num``. Validation bars are Lightning's.

    When stdout is not a terminal (a file, a pipe: a job's log on a cluster), or with ``plain=True``: plain
    lines instead (:class:`LineBar`), no escape codes, no carriage returns: for each stage (sanity check,
    validation before training, training, each validation, test, predict) a line at its first update, then
    at most one every ``interval`` seconds, and one when it ends; a validation's last line has its ``val/``
    metrics, a test's its ``test/`` metrics. The format is in ``docs/console.md``.

    The ``rloo-lightning`` command uses it in place of Lightning's default progress bar; a progress
    bar given in ``trainer.callbacks`` (or ``enable_progress_bar: false``) replaces it.

    Args:
        metrics: the logged metrics to show, as ``{name: label}`` or a list of names (labelled by
            their names); default ``train/reward``, ``train/kl`` and ``val/reward``.
        refresh_rate, process_position, leave: as for :class:`~lightning.pytorch.callbacks.TQDMProgressBar`.
        plain: plain lines (True) or a tqdm bar (False); default (None): plain lines unless stdout is a
            terminal (``TERM=dumb`` counts as none).
        interval: the least seconds between two plain lines of a stage (the first and the last line of each
            stage aside); 0 writes one at every update.
    """

    def __init__(self, metrics: dict[str, str] | list[str] | None = None, refresh_rate: int = 1,
                 process_position: int = 0, leave: bool = False, plain: bool | None = None,
                 interval: float = DEFAULT_INTERVAL) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        if not interval >= 0:
            raise ValueError(f"StepProgressBar: interval must be >= 0 seconds, got {interval}")
        metrics = DEFAULT_METRICS if metrics is None else metrics
        self.metrics = dict(metrics) if isinstance(metrics, dict) else {name: name for name in metrics}
        self.plain = plain
        self.interval = float(interval)
        self.clock: Callable[[], float] = time.monotonic  # plain lines' clock (a fake one in tests)
        self.stream: TextIO | None = None  # plain lines' stream (default: sys.stdout as it is when writing)
        self._extra_bar = None  # the bar of a validation run outside Lightning's loops (EvaluationProgress)

    def __getstate__(self) -> dict:
        return {k: None if isinstance(v, LineBar) else v for k, v in super().__getstate__().items()}

    @property
    def plain_lines(self) -> bool:
        """Whether this bar writes plain lines (``plain``, else: stdout is not a terminal)."""
        if self.plain is not None:
            return bool(self.plain)
        return not is_terminal(sys.stdout if self.stream is None else self.stream)

    def _line_bar(self, stage: str, unit: str = "batch") -> LineBar:
        return LineBar(stage, unit, self.interval, disable=self.is_disabled, stream=self.stream, clock=self.clock)

    # -- the bars: tqdm's on a terminal, LineBar's otherwise ----------------------------------------------
    def init_sanity_tqdm(self):
        return self._line_bar("sanity check") if self.plain_lines else super().init_sanity_tqdm()

    def init_train_tqdm(self):
        return self._line_bar("train") if self.plain_lines else super().init_train_tqdm()

    def init_validation_tqdm(self):
        if not self.plain_lines:
            return super().init_validation_tqdm()
        trainer = self.trainer
        fitting = trainer.state.fn == "fit"
        return self._line_bar(f"validation (step {trainer.global_step})" if fitting else "validation")

    def init_test_tqdm(self):
        return self._line_bar("test") if self.plain_lines else super().init_test_tqdm()

    def init_predict_tqdm(self):
        return self._line_bar("predict") if self.plain_lines else super().init_predict_tqdm()

    def evaluation_bar(self, stage: str, total: int):
        """A bar for an evaluation outside Lightning's loops (the validation before training): a plain
        ``<stage> <n>/<total> batches`` line bar, or on a terminal a tqdm bar like a validation's."""
        if self.plain_lines:
            bar = self._line_bar(stage)
            bar.total = total
        else:
            bar = super().init_validation_tqdm()
            bar.reset(total=total)
            bar.set_description(stage[:1].upper() + stage[1:])
        self._extra_bar = bar
        return bar

    # -- training ------------------------------------------------------------------------------------------
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
        leave = framework.tqdm_leave(self)
        if leave:
            self.train_progress_bar = self.init_train_tqdm()
        if leave or getattr(self, "_fresh", True):  # once per fit: the clock starts with the first epoch
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
        bar = framework.tqdm_bar(self, "train")
        if not self.counts_steps(trainer) and not isinstance(bar, LineBar):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        n = self.training_position(trainer, batch_idx)
        # under gradient accumulation most batches make no step: the bar moves on optimizer steps only
        if bar is None or bar.disable or n == bar.n or not framework.tqdm_should_update(self, n, bar.total):
            return
        bar.n = n
        bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar (the metrics of this step)

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

    @staticmethod
    def stage_metrics(trainer, prefix: str) -> dict[str, Any]:
        """The scalar metrics logged under ``prefix`` (``val/``, ``test/``), labelled without it."""
        items = {}
        for name, value in trainer.callback_metrics.items():
            if not name.startswith(prefix):
                continue
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    continue
                value = value.item()
            items[name[len(prefix):]] = value
        return items

    # -- evaluation: the last plain line of a validation or a test has its metrics ---------------------------
    def on_validation_end(self, trainer, pl_module) -> None:
        bar = framework.tqdm_bar(self, "val")
        if isinstance(bar, LineBar) and not trainer.sanity_checking:
            bar.final_metrics = self.stage_metrics(trainer, "val/")
        super().on_validation_end(trainer, pl_module)

    def on_test_end(self, trainer, pl_module) -> None:
        bar = framework.tqdm_bar(self, "test")
        if isinstance(bar, LineBar):
            bar.final_metrics = self.stage_metrics(trainer, "test/")
        super().on_test_end(trainer, pl_module)

    # -- printing and errors --------------------------------------------------------------------------------
    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        """``LightningModule.print``: a line of its own (plain lines), else above the tqdm bars."""
        if self.plain_lines:
            write_line(sep.join(map(str, args)), sys.stdout if self.stream is None else self.stream)
            return
        super().print(*args, sep=sep, **kwargs)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """The bars end at once, without a last line: the error that follows starts a line of its own (a tqdm
        bar on a terminal is closed: its line ends)."""
        stages = ("val", "test", "predict", "train")
        for bar in (self._extra_bar, *(framework.tqdm_bar(self, stage) for stage in stages)):
            if isinstance(bar, LineBar):
                bar.abandon()
            elif bar is not None:
                try:
                    bar.close()
                except (ValueError, OSError):
                    pass
        self._extra_bar = None


class EvaluationProgress:
    """The progress of an evaluation that runs outside Lightning's loops (:class:`ValidateAtStart`'s), shown
    by the trainer's :class:`StepProgressBar` like any validation; with another progress bar, or none, or on
    ranks other than 0, nothing is shown.

    Args:
        trainer: the trainer (its ``progress_bar_callback``).
        stage: the name on the bar (``validation (before training)``).
        total: the number of batches.
    """

    def __init__(self, trainer, stage: str, total: int) -> None:
        callback = getattr(trainer, "progress_bar_callback", None)
        shown = isinstance(callback, StepProgressBar) and callback.is_enabled
        self.bar = callback.evaluation_bar(stage, total) if shown else None

    def advance(self, n: int = 1) -> None:
        """``n`` more batches done."""
        if self.bar is not None:
            self.bar.update(n)

    def close(self, metrics: dict[str, Any] | None = None) -> bool:
        """End the display; with plain lines the last one has ``metrics`` (``val/reward`` shown as ``reward``).
        Returns whether ``metrics`` were shown, so that the caller prints them only when they were not."""
        bar, self.bar = self.bar, None
        if bar is None:
            return False
        shown = isinstance(bar, LineBar) and bool(metrics)
        if shown:
            bar.final_metrics = {name.split("/", 1)[-1]: value for name, value in metrics.items()}
        bar.close()
        return shown
