"""What the ``rloo-lightning`` command writes besides its progress (:mod:`rloo_lightning.callbacks.progress`).

* Python warnings as one ``warning: <message>`` line on stderr (no source path, no source line), see
  :func:`format_warning`.
* Nothing glued to a progress bar: on a terminal, a bar that is drawn is cleared before a warning, a log record
  or an error is written (:func:`end_partial_line`); in a file there are no partial lines (the progress is written
  as whole lines, and stdout is line-buffered so that a line is never split by stderr's output).
* The closing line of ``fit``, ``validate``, ``test`` and ``predict``, naming where the run's files went:
  ``fit done: checkpoint /abs/.../last.ckpt | logs /abs/.../version_0`` (:func:`outputs_line`); and the line a
  resumed fit starts with when it writes into a new folder (:func:`resume_line`).

:func:`install` sets up the first two in the command's process (``main`` calls it); nothing here runs on import.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from contextlib import contextmanager
from typing import Iterator, TextIO

from rloo_lightning.runtime import framework

__all__ = ["is_terminal", "end_partial_line", "write_line", "format_warning", "install", "outputs_line",
           "report_outputs", "resume_line"]


def is_terminal(stream: TextIO | None) -> bool:
    """Whether ``stream`` is an interactive terminal (not a file, a pipe, a captured stream or ``TERM=dumb``)."""
    try:
        return bool(stream is not None and stream.isatty()) and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def _drawn_bars() -> list:
    """The tqdm bars drawn now (enabled and started): only on a terminal; in a file the progress is plain lines."""
    from tqdm import tqdm

    with tqdm.get_lock():
        return [bar for bar in framework.tqdm_bars() if not bar.disable and hasattr(bar, "start_t")]


def end_partial_line() -> None:
    """Clear every progress bar drawn on the terminal, so that what is written next starts a line of its own (a
    bar redraws itself at its next update)."""
    for bar in _drawn_bars():
        try:
            bar.clear()
        except (ValueError, OSError):  # its stream is closed: nothing on screen to clear
            pass


@contextmanager
def _bars_set_aside(stream: TextIO) -> Iterator[None]:
    """Bars drawn on the terminal cleared while ``stream`` is written to, and drawn again after."""
    bars = _drawn_bars()
    if not bars:
        yield
        return
    from tqdm import tqdm

    with tqdm.external_write_mode(file=stream):
        yield


def write_line(text: str, stream: TextIO | None = None) -> None:
    """Write ``text`` as a line of its own to ``stream`` (default stderr) and flush it; a bar drawn on the
    terminal is cleared first and drawn again after."""
    stream = sys.stderr if stream is None else stream
    with _bars_set_aside(stream):
        stream.write(text + "\n")
        stream.flush()


def format_warning(message: Warning | str) -> str:
    """A warning as the command prints it: ``warning: <message>`` (the message's own lines kept)."""
    return f"warning: {str(message).strip()}"


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:  # warnings.showwarning
    try:
        write_line(format_warning(message), sys.stderr if file is None else file)
    except (OSError, ValueError):  # stderr closed: a warning is not worth a crash
        pass


class _EndPartialLine(logging.Filter):
    """Lets every record pass, after clearing a progress bar drawn on the terminal (the record gets a line of
    its own instead of being glued to the bar)."""

    def filter(self, record: logging.LogRecord) -> bool:
        end_partial_line()
        return True


def _line_buffered(stream: TextIO) -> None:
    reconfigure = getattr(stream, "reconfigure", None)
    if reconfigure is not None and not is_terminal(stream):
        try:
            reconfigure(line_buffering=True)
        except (ValueError, OSError):
            pass


def install() -> None:
    """In the command's process: warnings as ``warning: <message>`` lines; log records written to the console
    (Lightning's, the root logger's) and warnings never glued to a progress bar; stdout line-buffered when it is
    not a terminal (a file or a pipe), so that its lines and stderr's interleave whole, in the order written."""
    warnings.showwarning = _show_warning
    _line_buffered(sys.stdout)
    for name in ("lightning.pytorch", "lightning.fabric", ""):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and not any(
                    isinstance(f, _EndPartialLine) for f in handler.filters):
                handler.addFilter(_EndPartialLine())


# -- where the run's files went ----------------------------------------------------------------------------


def _checkpoint(trainer) -> str | None:
    """The checkpoint a fit ended with: ``last.ckpt`` (FinalCheckpoint's), else a ``ModelCheckpoint``'s last or
    best one; None when none was written."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from rloo_lightning.callbacks.checkpoint import FinalCheckpoint

    candidates = [cb.last_path(trainer, broadcast=False) for cb in trainer.callbacks if isinstance(cb, FinalCheckpoint)]
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint):
            candidates += [cb.last_model_path, cb.best_model_path]
    return next((path for path in candidates if path and os.path.exists(path)), None)


def _log_dirs(trainer) -> list[str]:
    """Each logger's folder (a TensorBoard or CSV logger's version folder) that exists, without repeats."""
    found: list[str] = []
    for logger in trainer.loggers:
        try:
            path = getattr(logger, "log_dir", None) or logger.save_dir
        except Exception:  # noqa: BLE001 - a logger that cannot say: it is left out of the line
            continue
        if path and os.path.isdir(path) and os.path.abspath(path) not in found:
            found.append(os.path.abspath(path))
    return found


def _predictions(trainer) -> list[str]:
    from rloo_lightning.callbacks.predict import PredictionWriter

    paths = [getattr(cb, "path", None) for cb in trainer.callbacks if isinstance(cb, PredictionWriter)]
    return [os.path.abspath(path) for path in paths if path is not None and os.path.exists(path)]


def outputs_line(trainer, subcommand: str) -> str:
    """The one line that ends ``subcommand`` (``fit``, ``validate``, ``test``, ``predict``), naming what it wrote:
    ``<subcommand> done: checkpoint <last.ckpt> | predictions <file> | logs <folder>`` (absolute paths, the items
    that apply), or ``<subcommand> done: nothing was saved``."""
    items = []
    if subcommand == "fit":
        checkpoint = _checkpoint(trainer)
        if checkpoint is not None:
            items.append(f"checkpoint {os.path.abspath(checkpoint)}")
    if subcommand == "predict":
        items += [f"predictions {path}" for path in _predictions(trainer)]
    items += [f"logs {path}" for path in _log_dirs(trainer)]
    return f"{subcommand} done: " + (" | ".join(items) if items else "nothing was saved")


def resume_line(trainer, ckpt_path: str | None) -> str | None:
    """The line a resumed fit starts with when its checkpoints go to another folder than the one of the checkpoint
    it resumes from (Lightning's default logger starts a new ``version_N``): ``resuming from <ckpt>: this run's
    checkpoints go to a new folder, <folder>`` (absolute paths). None when the run goes on in its checkpoint's own
    folder, saves no checkpoints, or resumes from no local file."""
    from rloo_lightning.callbacks.checkpoint import FinalCheckpoint
    from rloo_lightning.runtime.checkpoint_check import local_checkpoint_path

    local = local_checkpoint_path(ckpt_path) if ckpt_path else None
    if local is None or not trainer.checkpoint_callbacks:
        return None
    folder = FinalCheckpoint.dirpath(trainer, broadcast=False)  # the run's checkpoint folder, before it is made
    local = os.path.abspath(local)
    if os.path.realpath(folder) == os.path.realpath(os.path.dirname(local)):
        return None
    return f"resuming from {local}: this run's checkpoints go to a new folder, {os.path.abspath(folder)}"


def report_outputs(trainer, subcommand: str | None) -> None:
    """Print :func:`outputs_line` on stdout (global rank 0) after a trainer subcommand ran."""
    if trainer is None or subcommand not in ("fit", "validate", "test", "predict") or not trainer.is_global_zero:
        return
    write_line(outputs_line(trainer, subcommand), sys.stdout)
