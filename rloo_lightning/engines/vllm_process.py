"""The trainer's side of :class:`~rloo_lightning.engines.vllm.VLLMEngine`'s child process: :class:`ChildProcess`
starts it (``spawn``, with an environment of its own) and speaks to it over a pipe.

Requests carry ids; the child (``vllm_child.py``) answers them one at a time, in the order sent, and sends heartbeats
while it works. An answer that comes while the trainer waits for another is kept until asked for. While the trainer
waits, a child that ends raises :class:`ChildEnded` and one that sends nothing for ``stall_timeout`` seconds raises
:class:`ChildStalled`: fail, never hang. A send is held to the same bound: a child that takes nothing in (stopped,
or stuck with the pipe full) for ``stall_timeout`` seconds raises :class:`ChildStalled` too, and the pipe, cut in the
middle of a message, is not written to again (:meth:`ChildProcess.close` then kills the child).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Iterator

import torch

from rloo_lightning.engines.vllm_child import serve_requests
from rloo_lightning.engines.vllm_common import scoped_environ
from rloo_lightning.runtime import sigterm

__all__ = ["ChildEnded", "ChildProcess", "ChildStalled", "said_once", "vllm_log_level"]

#: Environment of this process that would make the child believe it is a rank of the trainer's process group.
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID")
_POLL_SECONDS = 0.05  # how often the trainer checks for a stop signal while the child generates
#: The child's heartbeat period while it generates, at most (a fifth of ``stall_timeout`` when that is shorter), so
#: that a live child is never silent for a whole ``stall_timeout``.
_HEARTBEAT_SECONDS = 2.0
#: Request ids, unique in this process: a handle of a closed engine's child never names a request of its next one.
_request_ids = itertools.count()
#: vLLM's log level in the child unless ``VLLM_LOGGING_LEVEL`` is set: its INFO lines (about 20 at start, 3 a push)
#: describe its own setup, not the run.
_VLLM_LOG_LEVEL = "WARNING"


#: vLLM's set-up warnings that a child of this process said already (``vllm_child._OnceVLLMRecords``): a later child
#: leaves them out.
_said_once: set[str] = set()


def said_once(names) -> None:
    """Note the set-up warnings a child said (its ``build`` answer): no later child of this process says them."""
    _said_once.update(names or ())


def vllm_log_level() -> str:
    """vLLM's log level in the child: ``VLLM_LOGGING_LEVEL``, else WARNING."""
    return os.environ.get("VLLM_LOGGING_LEVEL", _VLLM_LOG_LEVEL).upper()


class ChildEnded(RuntimeError):
    """The engine's child process ended while the trainer waited for it."""


class ChildStalled(TimeoutError):
    """The engine's child sent nothing for ``stall_timeout`` seconds (or did not start within ``startup_timeout``)."""


class ChildProcess:
    """The child process that holds the vLLM engine, and the pipe to it.

    Requests go out as ``(verb, id, args, stoppable)``; the child answers them in order with ``("answer", id,
    status, value, seconds)`` and sends ``("beat", id)`` while it works. :meth:`send` returns the id; :meth:`result`
    waits for that id's answer, keeping every other answer that comes meanwhile (:attr:`answers`) until its own
    :meth:`result`.
    """

    def __init__(self, device: torch.device, threads: int, timeout: float, stall_timeout: float = 600.0) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.stop_event = ctx.Event()
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(threads),
               "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
               "VLLM_LOGGING_LEVEL": vllm_log_level(), "RLOO_VLLM_SAID_ONCE": ",".join(sorted(_said_once)),
               "TOKENIZERS_PARALLELISM": "false"}
        if device.type == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = _visible_device(device)
        heartbeat = min(_HEARTBEAT_SECONDS, stall_timeout / 5)
        # spawn copies this process's environment at start, and would run the user's script again in the child
        # (a script without a `__main__` guard would start training there): the child needs nothing from it.
        # SIGINT held: the spawned child imports for seconds before it ignores the signal (sigterm.sigint_held).
        with scoped_environ(env, drop=_LAUNCHER_ENV), _main_script_hidden(), sigterm.sigint_held():
            self.process = ctx.Process(target=serve_requests, args=(child, self.stop_event, heartbeat), daemon=True,
                                       name="rloo-vllm-engine")
            self.process.start()
        child.close()
        self.timeout, self.stall_timeout = timeout, stall_timeout
        self.pending: dict[int, str] = {}  # id -> verb: sent, not answered yet
        self.answers: dict[int, tuple] = {}  # id -> (status, value, seconds): answered, not yet asked for
        self.dropped: set[int] = set()  # pending ids whose answer nobody will ask for (a wait cut by a stop)
        self.heard = False  # whether the child has sent anything yet (before that, it imports: startup_timeout)
        self.jammed: str | None = None  # why the pipe to the child can no longer be written (a send cut short)
        # Before multiprocessing's own exit handler (atexit runs last-registered first), which would SIGTERM the
        # child (it ignores SIGTERM) and wait for it without a limit.
        atexit.register(self.close)

    def call(self, verb: str, *args):
        """Send one request and wait for its answer's value."""
        return self.result(self.send(verb, *args))[0]

    def send(self, verb: str, *args, stoppable: bool = False) -> int:
        """Send a request; its id. ``stoppable``: :attr:`stop_event` may cut it short (a synchronous generate)."""
        rid = next(_request_ids)
        self._write((verb, rid, args, stoppable), verb, self.stall_timeout)
        self.pending[rid] = verb
        return rid

    def _write(self, message: tuple, verb: str, timeout: float) -> None:
        """``conn.send(message)``, waiting at most ``timeout`` seconds for the child to take it in. The write runs in
        a thread of its own: a pipe's write blocks while the pipe is full (a message larger than its buffer, a child
        that reads nothing: stopped, or stuck) and cannot be cancelled; given up on, the thread stays blocked until
        the child is killed (:meth:`close`), and the pipe, holding part of a message, is never written again."""
        if self.jammed:
            raise ChildStalled(self.jammed)
        outcome: list[BaseException | None] = []
        writer = threading.Thread(target=_send_into, args=(self.conn, message, outcome), daemon=True,
                                  name="rloo-vllm-send")
        writer.start()
        deadline = time.monotonic() + timeout
        while not outcome:
            writer.join(_POLL_SECONDS)
            if outcome:
                break
            if not self.process.is_alive():
                writer.join(2)  # its write fails now (the reader is gone)
                if not outcome:
                    raise ChildEnded(self._ended(verb))
            elif time.monotonic() > deadline:
                self.jammed = (f"the vLLM engine (pid {self.process.pid}) took in nothing of the {verb!r} request "
                               f"for {timeout:g} s (VLLMEngine stall_timeout): it is stopped or stuck, with its pipe "
                               "full")
                raise ChildStalled(self.jammed)
        if isinstance(outcome[0], (OSError, ValueError)):  # a broken pipe, or closed here
            raise ChildEnded(self._ended(verb)) from outcome[0]
        if outcome[0] is not None:
            raise outcome[0]

    def answered(self, rid: int) -> bool:
        """Whether the answer of ``rid`` is in (reads what the child sent so far, without waiting)."""
        while rid in self.pending and self.conn.poll(0):
            self._receive(self.pending[rid])
        return rid not in self.pending

    def result(self, rid: int, stoppable: bool = False) -> tuple:
        """``(value, seconds)`` of request ``rid``, waiting for it. ``stoppable``: a stop signal while it waits
        (:func:`rloo_lightning.runtime.sigterm.check`) tells the child to end every row at its current token; a
        stop raised here still reads this request's answer (what comes before it is kept), so the next wait
        starts in step."""
        if rid not in self.pending and rid not in self.answers:
            raise ValueError(f"VLLMEngine: request {rid} is not pending (collected already, or sent to an engine "
                             "since closed)")
        verb = self.pending.get(rid, "generate")
        try:
            self._wait(rid, stoppable)
        except BaseException as err:
            if stoppable:
                self._settle(rid, err)
            raise
        finally:
            if stoppable:
                self.stop_event.clear()
        status, value, seconds = self.answers.pop(rid)
        if status == "refused":
            raise ValueError(value)
        if status == "error":
            raise RuntimeError(f"the vLLM engine failed during {verb!r}:\n{value}")
        return value, seconds

    def drain(self) -> None:
        """Wait for the answer of every pending request (kept for :meth:`result`)."""
        for rid in list(self.pending):
            self._wait(rid, stoppable=False)

    def _wait(self, rid: int, stoppable: bool) -> None:
        """Read the child's messages until ``rid`` is answered. Raises :class:`ChildEnded` when the child ends,
        :class:`ChildStalled` when it sends nothing for ``stall_timeout`` seconds (``build``, or before the child's
        first message: when it has not answered within ``startup_timeout``)."""
        verb = self.pending.get(rid)
        start = last = time.monotonic()
        while rid in self.pending:
            if self.conn.poll(_POLL_SECONDS):
                self._receive(verb)
                last = time.monotonic()
            elif not self.process.is_alive():
                raise ChildEnded(self._ended(verb))
            now = time.monotonic()
            if verb == "build" or not self.heard:  # building, or still importing (it has sent nothing yet)
                if now - start > self.timeout:
                    raise ChildStalled(f"the vLLM engine did not start within {self.timeout:.0f} s "
                                        "(VLLMEngine startup_timeout)")
            elif now - last > self.stall_timeout:
                raise ChildStalled(
                    f"the vLLM engine (pid {self.process.pid}) sent nothing for {self.stall_timeout:g} s during "
                    f"{verb!r} (VLLMEngine stall_timeout): it is stuck, or a single step of its engine takes "
                    "longer than that (raise stall_timeout then)")
            if stoppable and sigterm.check("generation"):
                self.stop_event.set()

    def _receive(self, verb: str) -> None:
        """Read one message: an answer is kept (or dropped, for a request given up on); a heartbeat only shows the
        child is alive."""
        try:
            message = self.conn.recv()
        except (EOFError, OSError) as err:  # the child's end closed: it ended
            self.process.join(2)
            raise ChildEnded(self._ended(verb)) from err
        self.heard = True
        if message[0] != "answer":
            return
        _, rid, status, value, seconds = message
        self.pending.pop(rid, None)
        if rid in self.dropped:
            self.dropped.discard(rid)
        else:
            self.answers[rid] = (status, value, seconds)

    def _settle(self, rid: int, err: BaseException) -> None:
        """After a stop raised while waiting for the stoppable ``rid``: cut it short and read its answer, so that no
        answer of it is left for a later wait; when that cannot be (the child ended or is stuck, or another
        exception comes), its answer is dropped whenever it comes."""
        self.stop_event.set()
        try:
            if not isinstance(err, (ChildEnded, ChildStalled)) and self.process.is_alive():
                self._wait(rid, stoppable=False)
        except BaseException:  # a second stop while settling: the first one is what the caller raises
            pass
        if rid in self.pending:
            self.dropped.add(rid)
        self.answers.pop(rid, None)

    def _ended(self, verb: str | None) -> str:
        return (f"the vLLM engine's process (pid {self.process.pid}) ended (exit code {self.process.exitcode}) "
                f"during {verb!r}")

    def close(self) -> None:
        """Stop the child: ``close`` and a wait of up to 10 s, then a kill. With requests pending it is killed at
        once (it would finish them first, and nobody will read their answers)."""
        atexit.unregister(self.close)
        if self.process.is_alive():
            with contextlib.suppress(OSError, ValueError, ChildEnded, ChildStalled):  # a stuck child: killed below
                self._write(("close", None, (), False), "close", min(self.stall_timeout, 10.0))
            self.process.join(0 if self.pending or self.jammed else 10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(10)
        self.conn.close()


def _send_into(conn, message: tuple, outcome: list) -> None:
    """The sending thread of :meth:`ChildProcess._write`: ``outcome`` gets None, or the exception of the send."""
    try:
        conn.send(message)
    except BaseException as err:  # noqa: B036 - handed to the waiting thread, which raises it
        outcome.append(err)
    else:
        outcome.append(None)


@contextlib.contextmanager
def _main_script_hidden() -> Iterator[None]:
    """``__main__`` without a file or spec while a child is spawned: ``multiprocessing`` then does not import it."""
    import sys

    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    for k in saved:
        setattr(main, k, None) if k == "__spec__" else delattr(main, k)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


def _visible_device(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index] if visible else str(index)
