"""SIGTERM at any point: a preempted job ends promptly, and keeps what it can keep.

Lightning acts on SIGTERM at the end of a training step or of a validation batch, and only once its trainer runs;
before that (building the prompt cache, loading the model) the signal's default action kills the process at once,
leaving the other ranks waiting in a collective. A step's generation, or one validation batch of many prompts,
can take minutes. This module's handler, installed by the CLI before anything else:

* before the first optimizer step (cache building, model loading, the validation before training, the first step)
  there is nothing to save: it raises :class:`~lightning.pytorch.utilities.exceptions.SIGTERMException` at once
  (the CLI exits with 143 and says so in one line);
* after it, it sets a flag that the long loops read between their units of work (each generated token, each
  validation batch, each turn of an episode): :func:`check` raises there during validation, where
  ``FinalCheckpoint`` writes ``last.ckpt`` of the step just finished; and inside a training step's generation
  (one process), where ``FinalCheckpoint`` writes the state of the step before, as a stop at that step's end
  would have (it keeps a snapshot of what a step changes before its optimizer step: the loops' counters, the
  callbacks' and the module's own state). With several ranks a step runs to its end, where Lightning's stop,
  agreed by every rank, writes ``last.ckpt`` of that step;
* it forwards the signal to the ranks this process launched, before Lightning's handler (which does the same)
  is installed.
"""

from __future__ import annotations

import os
import signal
import threading

from lightning.pytorch.utilities.exceptions import SIGTERMException

__all__ = ["aborted_step", "attach", "check", "install", "phase", "requested", "set_phase"]

_state = {"requested": False, "phase": "setup", "installed": False, "trainer": None}
# phase: "setup" (nothing trained yet), "train" (inside a training step), "boundary" (between steps),
# "validation" (a validation loop after the first step), "saving" (a checkpoint is being written)


def install(trainer=None) -> None:
    """Install the handler (main thread only; idempotent). ``trainer``: its launcher's ranks get the signal."""
    if trainer is not None:
        _state["trainer"] = trainer
    if _state["installed"] or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _handler)
    _state["installed"] = True


def attach(trainer) -> None:
    """The trainer of this run (its launcher's ranks get the signal); the run starts in the ``setup`` phase."""
    _state["trainer"], _state["phase"], _state["aborted_step"] = trainer, "setup", False


def phase() -> str:
    return _state["phase"]


def set_phase(phase: str) -> None:
    """Where the run is: ``setup``, ``train``, ``boundary``, ``validation`` or ``saving``."""
    _state["phase"] = phase


def requested() -> bool:
    return _state["requested"]


def check(where: str = "") -> None:
    """Raise ``SIGTERMException`` if a SIGTERM arrived and the run may stop here; a no-op otherwise.

    It may before the first step, in a validation loop, and, in a one-process run, inside a training step's
    generation: ``FinalCheckpoint`` then writes the state of the step before (:func:`aborted_step`)."""
    if not _state["requested"]:
        return
    phase = _state["phase"]
    if phase == "train" and getattr(_state["trainer"], "world_size", 1) == 1:
        _state["aborted_step"] = True
        raise SIGTERMException(where)
    if phase in ("setup", "validation"):
        raise SIGTERMException(where)


def aborted_step() -> bool:
    """A training step was abandoned mid-way by :func:`check` (its state is not the one to save)."""
    return _state.get("aborted_step", False)


def _handler(signum, frame) -> None:
    first = not _state["requested"]
    _state["requested"] = True
    if first:
        _forward(signum)
    if _state["phase"] == "setup":
        raise SIGTERMException("before the first step")


def _forward(signum) -> None:
    """Pass the signal to the ranks this process launched, unless Lightning's handler already did."""
    trainer = _state["trainer"]
    if trainer is None or getattr(trainer, "received_sigterm", False):
        return
    launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
    for proc in getattr(launcher, "procs", None) or []:
        try:
            if proc.poll() is None:
                os.kill(proc.pid, signum)
        except (OSError, AttributeError):
            pass


def reset() -> None:
    """Forget a signal (tests, and a new run in the same process)."""
    _state.update(requested=False, phase="setup", trainer=None)
