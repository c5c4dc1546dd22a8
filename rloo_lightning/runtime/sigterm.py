"""SIGTERM (and Ctrl-C) at any point: a preempted job ends promptly, and keeps what it can keep.

Lightning acts on SIGTERM at the end of a training step or of a validation batch, and only once its trainer runs;
before that (building the prompt cache, loading the model) the signal's default action kills the process at once.
A step's generation, or one validation batch of many prompts, can take minutes. This module's handler, installed
by the CLI before anything else (and by :func:`attach` for a trainer made outside it):

* before the first optimizer step (cache building, model loading, the validation before training, the first step
  up to its update) there is nothing to save: it raises
  :class:`~lightning.pytorch.utilities.exceptions.SIGTERMException` at once (the CLI exits with 143 and says so in
  one line); from the first update on, Lightning stops at that step's end and ``last.ckpt`` holds it;
* after it, it sets a flag that the long loops read between their units of work (each generated token, each
  turn of an episode, each validation batch) through :func:`check`. With one process, ``check`` raises there:
  during validation ``FinalCheckpoint`` then writes ``last.ckpt`` of the step just finished; inside a training
  step, the state of the step before, as a stop at that step's end would have (it keeps a snapshot of what a step
  changes before its optimizer step: the loops' counters, the callbacks' and the module's own state);
* with several ranks no rank may stop alone (the others would wait for it in their next collective). ``check``
  then only tells the rank to cut its work short (the decode loop returns the tokens so far, episodes take no
  more turns) and the ranks decide together, with one small collective, at points every rank reaches in the same
  order (:func:`agree`): after a step's generation (before its first collective), at each training batch's end
  and at each validation batch's start. A rank that was not signalled learns of the signal from the process
  group's store within :data:`POLL_SECONDS` while it generates, or at the next of those points;
* it passes a SIGTERM on to the ranks this process launched. Lightning's own SIGTERM handler is replaced by this
  one for the trainer's run (it broadcasts a tensor from inside the handler, which pairs with whatever
  collective the other ranks are in at that moment).

In the CLI (:func:`install`; a trainer made outside it keeps Python's ``KeyboardInterrupt``), SIGINT (Ctrl-C) is
handled the same way, so that a stopped run keeps its ``last.ckpt`` (Python's own handler raises
``KeyboardInterrupt``: Lightning then exits 1 and saves nothing); the CLI exits with 130 instead of 143 and the
lines name the signal (:func:`signal_name`, :func:`exit_code`). A terminal sends Ctrl-C to its whole foreground
process group: the ranks this process launched get it from the terminal too, so a SIGINT is passed on to them as a
SIGTERM, which starts the same stop and is never taken for a second Ctrl-C there. A second SIGINT ends the process
at once (:func:`_end_now`): the processes it started are killed, nothing more is saved, and a checkpoint being
written is dropped (the write goes to a temporary name: what was written before stays whole). Worker processes
ignore SIGINT (:func:`ignore_sigint`, started under :func:`sigint_held`): the trainer decides.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from rloo_lightning.runtime import framework

__all__ = ["StepFailed", "abort_step", "aborted_step", "agree", "attach", "between_batches", "check", "end_step",
           "exit_code", "peer_stopped",
           "ignore_sigint", "install", "phase", "rank_zero", "requested", "set_phase", "sigint_held", "signal_name"]

POLL_SECONDS = 1.0  # how often a generating rank asks the process group's store whether another rank was signalled
_KEY = "rloo_lightning/sigterm"

_state = {"requested": False, "phase": "setup", "installed": False, "trainer": None, "aborted_step": False,
          "runs": 0, "polled": 0.0, "signal": None, "sigints": 0}
# signal: the first stop signal received (SIGTERM or SIGINT); sigints: how many SIGINTs (the second ends at once)
# phase: "setup" (nothing trained yet), "train" (inside a training step), "boundary" (between steps),
# "validation" (a validation loop after the first step), "saving" (a checkpoint is being written), "predict"


def install(trainer=None) -> None:
    """Install the handler for SIGTERM and SIGINT (main thread only; idempotent). ``trainer``: its launcher's ranks
    get a SIGTERM when this process gets either. A SIGINT ignored when the process started (a background job of a
    shell, ``nohup``) stays ignored."""
    if trainer is not None:
        _state["trainer"] = trainer
    if _state["installed"] or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _handler)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _handler)
    _state["installed"] = True


def attach(trainer) -> None:
    """The trainer of this run; the run starts in the ``setup`` phase. Lightning's SIGTERM notifier, which
    registers when the trainer's run starts, is replaced by :func:`_handler` (see the module docstring)."""
    _state.update(trainer=trainer, phase="setup", aborted_step=False, polled=0.0)
    _state["runs"] += 1  # the store key of this run: a signal of an earlier run in this process group is not seen
    framework.set_sigterm_notifier(trainer, _lightning_notifier)


def phase() -> str:
    return _state["phase"]


def set_phase(phase: str) -> None:
    """Where the run is: ``setup``, ``train``, ``boundary``, ``validation``, ``saving`` or ``predict``."""
    _state["phase"] = phase


def requested() -> bool:
    return _state["requested"]


def signal_name() -> str:
    """The name of the signal that stopped the run (``SIGTERM`` when none did)."""
    return signal.Signals(_state["signal"] or signal.SIGTERM).name


def exit_code() -> int:
    """The CLI's status after a stop: 128 + the signal, as a process killed by it (143 for SIGTERM, 130 for
    SIGINT), so that a scheduler or a wrapper script does not read a stopped run as a finished one."""
    return 128 + (_state["signal"] or signal.SIGTERM)


def rank_zero() -> bool:
    """This process is the one a user started, or global rank 0 (not a rank a launcher started): the one that
    writes the CLI's lines."""
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0"


@contextlib.contextmanager
def sigint_held():
    """SIGINT blocked in this thread while a worker process starts: a spawned child inherits the block across its
    ``exec`` and gets no ``KeyboardInterrupt`` while it imports, before :func:`ignore_sigint` (a SIGINT that comes
    meanwhile reaches this process when the block ends)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    from multiprocessing import resource_tracker

    # Started first, if it is not running: multiprocessing starts it with every start, and its start ends with an
    # unblock of SIGINT in this thread (it ignores the signal itself).
    resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def ignore_sigint() -> None:
    """In a worker process (reward, tool, generation): ignore SIGINT. A terminal sends Ctrl-C to the whole process
    group; a worker killed by it would break the step under the trainer, which decides when to stop (and stops
    its workers). Unblocks it after :func:`sigint_held` (a SIGINT held meanwhile is dropped, being ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def check(where: str = "") -> bool:
    """Between two units of work: raise ``SIGTERMException`` where this process may stop at once; return True where
    it should cut the work in hand short (several ranks, inside a training step or a validation: they stop
    together at the next :func:`agree`); False otherwise (no signal, or a phase that stops at its own end).

    With one process it raises before the first step, in a validation loop, and inside a training step:
    ``FinalCheckpoint`` then writes the state of the step before (:func:`aborted_step`)."""
    if not _state["requested"] and not _peer_signalled():
        return False
    phase = _state["phase"]
    if _world_size() > 1:
        if phase == "setup":
            raise SIGTERMException(where)
        return phase in ("train", "validation")
    if phase == "train":
        _state["aborted_step"] = True
        raise SIGTERMException(where)
    if phase in ("setup", "validation"):
        raise SIGTERMException(where)
    return False


def agree(trainer) -> bool:
    """Whether any rank has a SIGTERM, decided by every rank together (a collective with several ranks: call it
    only where every rank calls it in the same order). A yes is also Lightning's flag, so that its own stops at a
    batch's end happen on every rank or none."""
    if trainer is None:
        return _state["requested"]
    if getattr(trainer, "world_size", 1) > 1:
        flag = trainer.strategy.reduce_boolean_decision(_state["requested"], all=False)
        if flag:
            _state["requested"] = True
    if _state["requested"]:
        framework.mark_sigterm_received(trainer)
    return _state["requested"]


class StepFailed(RuntimeError):
    """A failure inside a training step that every rank raises together (:func:`end_step`): the ranks are all at
    the same point, outside any collective, so the checkpoint of the step before can be written collectively."""


def end_step(trainer, where: str, failure: BaseException | None = None, signals: bool = True) -> None:
    """At an agreement point of a step (after its generation, after its scoring), before anything of it is kept:
    every rank stops here if any was signalled, and the checkpoint written is the step before's
    (:func:`aborted_step`). ``failure``: this rank's exception in the work before the point (held, not raised, so
    that the other ranks do not wait for it in their next collective); with several ranks, a failure on any rank
    raises :class:`StepFailed` on every rank, naming the failed ranks and their errors. ``signals`` False: a point
    for failures only (a signal still stops the step at its end, as Lightning does)."""
    if trainer is None:
        if failure is not None:
            raise failure
        return
    if getattr(trainer, "world_size", 1) > 1:
        failed = trainer.strategy.reduce_boolean_decision(failure is not None, all=False)
        if failed:
            errors = [None] * trainer.world_size
            torch.distributed.all_gather_object(errors, None if failure is None else _one_line(failure))
            said = "; ".join(f"rank {rank}: {error}" for rank, error in enumerate(errors) if error is not None)
            _state["aborted_step"] = _state["phase"] == "train"
            raise StepFailed(f"{where} on {sum(e is not None for e in errors)} of {len(errors)} ranks: {said}") \
                from failure
    elif failure is not None:
        raise failure
    if signals and agree(trainer):
        _state["aborted_step"] = _state["phase"] == "train"
        raise SIGTERMException(where)


def _one_line(error: BaseException) -> str:
    """An error in one line: its message, after its class's name unless it is a runtime, value or OS error (the
    package's own errors among them), whose message says what failed."""
    message = " ".join(str(error).split())
    plain = isinstance(error, (RuntimeError, ValueError, OSError)) and message
    return message if plain else f"{type(error).__name__}: {message}" if message else type(error).__name__


def between_batches(trainer, where: str) -> None:
    """At a validation batch's start (every rank reaches it in the same order): stop there if any rank was
    signalled."""
    if agree(trainer):
        raise SIGTERMException(where)


def abort_step() -> None:
    """The step in progress is abandoned (a stop between two micro-batches of one optimizer step)."""
    _state["aborted_step"] = True


def aborted_step() -> bool:
    """A training step was abandoned mid-way (its state is not the one to save)."""
    return _state.get("aborted_step", False)


def _world_size() -> int:
    """The trainer's world size, or the process group's before a trainer is attached (set-up)."""
    size = getattr(_state["trainer"], "world_size", 1) or 1
    if size == 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        size = torch.distributed.get_world_size()
    return size


def peer_stopped() -> bool:
    """Whether another rank of this process group was signalled (its handler wrote the store key): a collective
    that failed because that rank ended is then this rank's stop too, not an error. Asks the store now."""
    store = _store() if _world_size() > 1 else None
    try:
        seen = store is not None and store.check([_key()])
    except (RuntimeError, ValueError):
        return False
    if seen:
        _state["requested"] = True
        _state["signal"] = _state["signal"] or signal.SIGTERM  # as the peer's (a scheduler's stop)
    return seen


def _key() -> str:
    """The store key of this run's signal (a signal of an earlier run in this process group is another key)."""
    return f"{_KEY}/{_state['runs']}"


def _store():
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    try:
        return framework.default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def _peer_signalled() -> bool:
    """Several ranks: whether another rank was signalled (asks the store at most every ``POLL_SECONDS``)."""
    if _world_size() == 1:
        return False
    now = time.monotonic()
    if now - _state["polled"] < POLL_SECONDS:
        return False
    _state["polled"] = now
    return peer_stopped()


def _handler(signum, frame) -> None:
    if signum == signal.SIGINT:
        _state["sigints"] += 1
        if _state["sigints"] > 1:
            _end_now()
    first = not _state["requested"]
    _state["requested"] = True
    trainer = _state["trainer"]
    if first:
        _state["signal"] = signum
        # A SIGTERM whatever the signal: a Ctrl-C reached the launched ranks from the terminal already, and a
        # forwarded SIGINT would be a second one there (the rank would end alone, the others waiting for it).
        _forward(signal.SIGTERM)
        if _world_size() > 1 and (store := _store()) is not None:
            try:
                store.set(_key(), "1")  # the ranks that were not signalled learn of it
            except (RuntimeError, ValueError):
                pass
    if _world_size() == 1:
        framework.mark_sigterm_received(trainer)  # one process: Lightning's stops apply as they are
    if _state["phase"] == "setup":
        raise SIGTERMException("before the first step")


def _end_now() -> None:
    """A second SIGINT: the user does not want to wait. End now, with the ranks and workers this process started
    (a worker in a call that never returns would outlive it); the line is written with one ``os.write`` (a signal
    handler may run while the main thread is inside a write to the same stream)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, RuntimeError, ValueError):  # closed, or reentered from inside a write
            pass
    if rank_zero():
        os.write(2, b"stopped at once by a second SIGINT (Ctrl-C): nothing more is saved (checkpoints written "
                    b"before it are whole)\n")
    _forward(signal.SIGKILL)
    for child in multiprocessing.active_children():
        child.kill()
    os._exit(128 + signal.SIGINT)


def _lightning_notifier(signum, frame) -> None:
    """In place of Lightning's notifier: this module's handler, unless the CLI already installed it (it then runs
    right after this in Lightning's handler chain)."""
    if not _state["installed"]:
        _handler(signum, frame)


def _forward(signum) -> None:
    """Pass the signal to the ranks this process launched."""
    launcher = getattr(getattr(_state["trainer"], "strategy", None), "launcher", None)
    if launcher is not None and hasattr(launcher, "kill"):
        try:
            launcher.kill(signum)
        except (OSError, AttributeError):
            pass


def reset() -> None:
    """Forget a signal (tests, and a new run in the same process)."""
    _state.update(requested=False, phase="setup", trainer=None, aborted_step=False, polled=0.0, signal=None,
                  sigints=0)
