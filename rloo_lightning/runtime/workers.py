"""Worker processes for slow reward functions: parallel chunks, a per-call timeout, no hangs.

Rule rewards that run a verifier (a math checker, unit tests of generated code) can be slow and
can hang on one pathological completion. :class:`WorkerPool` runs them in separate processes:

* processes are never forked from the training process: forking a process that has already run
  torch (CUDA, OpenMP thread pools) can deadlock the child. The default is ``forkserver`` (a
  fresh server process imports this package once, then forks cheap workers from itself, so a
  worker killed after a timeout is replaced in milliseconds), or ``spawn`` (a fresh interpreter
  per worker, a few seconds of imports each) where ``forkserver`` does not exist;
* each worker rebuilds the reward functions from their specs (import path / class spec) or
  unpickles them (a function defined at the top level of an importable module), so a function
  must be importable in a fresh interpreter. The parent's ``sys.path`` (as it was when the
  first pool started, for ``forkserver``) is carried over, and the parent's working directory
  is appended to it (a ``myreward.py`` next to the data is importable, as in the CLI);
* one call (one function on one chunk of completions) that runs past ``timeout`` gets its worker
  killed (SIGTERM, then SIGKILL) and replaced; the caller gets ``"timeout"`` for that call and
  never waits longer. A worker that dies is replaced the same way. ``multiprocessing.Pool``
  cannot kill one task, so workers are plain processes with one pipe each;
* workers live across calls and are stopped by :meth:`WorkerPool.close`, at interpreter exit, or
  when the pool is garbage-collected. A worker whose parent died gets EOF on its pipe and exits;
* workers ignore SIGINT, from their start on: a terminal's Ctrl-C reaches the whole process group, and the
  trainer decides what it stops (:mod:`rloo_lightning.runtime.sigterm`); a worker killed by it would fail the step;
* ``memory_mb`` (None for rewards; the tool workers of
  :class:`~rloo_lightning.environments.tools.ToolEnvironment` set it) caps each worker's address space
  (``RLIMIT_AS``, Linux) at what it maps once started (its imports, torch's included, and functions built) plus
  ``memory_mb`` MiB: an allocation past it raises ``MemoryError`` in the call, an ``"error"`` outcome.

Each rank of a distributed run has its own pool.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import pickle
import sys
import time
import traceback
import weakref
from collections import deque
from collections.abc import Mapping
from multiprocessing.connection import wait
from typing import Any

from rloo_lightning.rewards.protocol import RewardError, build_reward, invoke
from rloo_lightning.runtime import framework
from rloo_lightning.runtime.sigterm import ignore_sigint, sigint_held

__all__ = ["WorkerPool", "RemoteError", "get_context"]

STARTUP_TIMEOUT = 300.0  # seconds a worker may take to import and build the reward functions


def get_context(start_method: str | None = None):
    """The multiprocessing context for workers: ``forkserver`` where it exists, else ``spawn``."""
    if start_method is None:
        start_method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(
            f"reward workers start with 'spawn' or 'forkserver', got {start_method!r} ('fork' can hang a "
            "process that already ran torch)"
        )
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        # Import this module (and so torch and the built-in rewards) once in the server, not in each
        # worker. Keeps what others asked to preload; no effect if the server already runs.
        current = framework.forkserver_preload_modules()
        if __name__ not in current:
            ctx.set_forkserver_preload(current + [__name__])
    return ctx


class RemoteError(Exception):
    """Stands in for an exception raised in a worker that could not be pickled back."""


def _pack(err: BaseException) -> bytes | None:
    try:
        data = pickle.dumps(err)
        pickle.loads(data)
        return data
    except Exception:
        return None


def _unpack(data: bytes | None, tb: str) -> BaseException:
    if data is not None:
        try:
            return pickle.loads(data)
        except Exception:
            pass
    last = tb.strip().splitlines()[-1] if tb.strip() else "unknown error"
    return RemoteError(last)


def _limit_address_space(memory_mb: int) -> None:
    """Set this process's soft ``RLIMIT_AS`` to what it maps now (``VmSize``) plus ``memory_mb`` MiB (never above
    a limit already set). Linux only: where ``/proc/self/status`` or ``resource`` is missing, nothing is set."""
    try:
        import resource

        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (ImportError, OSError, StopIteration, ValueError, IndexError):
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + memory_mb * 2 ** 20
    for current in (soft, hard):
        if current != resource.RLIM_INFINITY:
            limit = min(limit, current)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _worker_main(conn, payloads: dict[int, bytes], cwd: str | None = None, memory_mb: int | None = None) -> None:
    """Worker loop: build the functions, say ready, then answer ``(task_id, index, mode, args)``.

    ``cwd``: the parent's working directory, appended to ``sys.path`` before the functions are built.
    ``memory_mb``: MiB of address space the calls may add to what the worker maps once built (None: no limit).
    """
    ignore_sigint()  # first: a Ctrl-C to the process group is the trainer's to act on
    try:
        if cwd is not None:
            from rloo_lightning.runtime.importpath import add_cwd_to_sys_path

            add_cwd_to_sys_path(cwd, warn=False)  # the parent warned already
        funcs = {}
        for i, data in payloads.items():
            spec = pickle.loads(data)
            funcs[i] = build_reward(spec)[1] if isinstance(spec, (str, Mapping)) else spec
        if "torch" in sys.modules:  # N workers on N cores: no oversubscription by intra-op threads
            sys.modules["torch"].set_num_threads(1)
        if memory_mb is not None:
            _limit_address_space(memory_mb)
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which raises it
        with contextlib.suppress(Exception):  # the parent may be gone; the worker exits either way
            conn.send(("init_error", _pack(err), traceback.format_exc()))
        return
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # parent gone: just exit
            return
        if msg is None:
            return
        task_id, i, mode, (prompts, completions, completion_ids, columns) = msg
        try:
            values = invoke(funcs[i], mode, prompts, completions, completion_ids, columns)
            reply = ("ok", task_id, values)
            pickle.dumps(reply)  # values that cannot travel back are this call's error
        except BaseException as err:  # noqa: BLE001
            reply = ("error", task_id, _pack(err), traceback.format_exc())
        try:
            conn.send(reply)
        except OSError:
            return


class _Worker:
    __slots__ = ("proc", "conn", "ready", "task", "deadline", "started")

    def __init__(self, proc, conn) -> None:
        self.proc, self.conn = proc, conn
        self.ready = False
        self.task: int | None = None
        self.deadline = math.inf
        self.started = time.monotonic()


def _stop(worker: _Worker) -> None:
    """Kill one worker now (it may be stuck in C code: SIGTERM, then SIGKILL)."""
    proc = worker.proc
    if proc.is_alive():
        proc.terminate()
        proc.join(1.0)
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
    worker.conn.close()


def _shutdown(workers: list[_Worker]) -> None:
    """Ask every worker to exit, wait up to 2 s, then kill what is left."""
    for w in workers:
        try:
            w.conn.send(None)
        except Exception:
            pass
    deadline = time.monotonic() + 2.0
    for w in workers:
        w.proc.join(max(0.0, deadline - time.monotonic()))
    for w in workers:
        _stop(w)
    workers.clear()


class WorkerPool:
    """``num_workers`` processes that evaluate reward functions on chunks of completions.

    Args:
        payloads: ``{index: spec}``: an import path, a class-spec dict, or a picklable callable.
        names: ``{index: name}`` for messages.
        num_workers: processes to keep.
        start_method: ``"forkserver"`` (default where available) or ``"spawn"``; never ``"fork"``.
        memory_mb: MiB of address space each worker's calls may add to what it maps once started (``RLIMIT_AS``,
            Linux); None: no limit.
    """

    def __init__(self, payloads: Mapping[int, Any], names: Mapping[int, str], num_workers: int = 1,
                 start_method: str | None = None, memory_mb: int | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.names = dict(names)
        self.num_workers = num_workers
        self.memory_mb = memory_mb
        self._ctx = get_context(start_method)
        self._payloads = {i: pickle.dumps(spec) for i, spec in payloads.items()}
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        for _ in range(num_workers):
            self._workers.append(self._start())

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def _start(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_main, args=(child_conn, self._payloads, os.getcwd(), self.memory_mb),
                                 name="rloo-reward-worker", daemon=False)
        # A worker starts with SIGINT blocked until it ignores it: a spawned one imports for seconds first, and so
        # does a forkserver started here (it ignores SIGINT then; the processes it forks inherit the block).
        with sigint_held():
            proc.start()
        child_conn.close()  # so that the worker's death is EOF here
        return _Worker(proc, parent_conn)

    def _replace(self, worker: _Worker) -> None:
        _stop(worker)
        self._workers[self._workers.index(worker)] = self._start()

    def run(self, tasks: list[tuple[int, str, tuple]], timeout: float | None = None) -> list[tuple[str, Any]]:
        """Evaluate ``tasks`` (``(index, mode, (prompts, completions, completion_ids, columns))``).

        Returns one outcome per task, in order: ``("ok", values)``, ``("error", (exception, traceback))``,
        ``("timeout", None)`` or ``("died", "exit code N")``.
        """
        if self.closed:
            raise RuntimeError("WorkerPool is closed")
        try:
            return self._run(tasks, timeout)
        except BaseException:
            # Interrupted, or the workers cannot start: their state is unknown, start afresh next time.
            self.close()
            raise

    def _run(self, tasks, timeout):
        outcomes: list[tuple[str, Any] | None] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        while pending or any(w.task is not None for w in self._workers):
            now = time.monotonic()
            for w in list(self._workers):
                if w.ready and w.task is None and pending:
                    t = pending.popleft()
                    try:
                        w.conn.send((t, *tasks[t]))
                    except (OSError, ValueError):  # died while idle: start another, retry the task
                        pending.appendleft(t)
                        self._replace(w)
                        continue
                    w.task, w.deadline = t, (now + timeout if timeout is not None else math.inf)
            waiting = [w for w in self._workers if w.task is not None or not w.ready]
            deadlines = [w.deadline if w.ready else w.started + STARTUP_TIMEOUT for w in waiting]
            soonest = min(deadlines, default=math.inf)
            wait_s = None if soonest == math.inf else max(0.0, soonest - now)
            for conn in wait([w.conn for w in waiting], timeout=wait_s):
                w = next(w for w in self._workers if w.conn is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    w.proc.join(1.0)
                    code = w.proc.exitcode
                    if not w.ready:
                        raise RewardError(
                            f"a reward worker process exited during start-up (exit code {code}); its "
                            "output above says why"
                        ) from None
                    outcomes[w.task] = ("died", f"exit code {code}")
                    self._replace(w)
                    continue
                kind = msg[0]
                if kind == "ready":
                    w.ready = True
                elif kind == "init_error":
                    err = _unpack(msg[1], msg[2])
                    raise RewardError(
                        f"a reward worker process could not build the reward functions "
                        f"{sorted(self.names[i] for i in self._payloads)}: {err!r}. Functions sent to workers "
                        f"must be importable in a fresh interpreter.\nworker traceback:\n{msg[2]}"
                    ) from err
                else:
                    _, t, *rest = msg
                    outcomes[t] = ("ok", rest[0]) if kind == "ok" else ("error", (_unpack(rest[0], rest[1]), rest[1]))
                    w.task, w.deadline = None, math.inf
            now = time.monotonic()
            for w in list(self._workers):
                if w.task is not None and now >= w.deadline:
                    outcomes[w.task] = ("timeout", None)
                    self._replace(w)
                elif not w.ready and now >= w.started + STARTUP_TIMEOUT:
                    raise RewardError(
                        f"a reward worker process did not start within {STARTUP_TIMEOUT:g} s (importing "
                        f"{sorted(self.names[i] for i in self._payloads)})"
                    )
        return outcomes

    def close(self) -> None:
        """Stop all workers (idempotent)."""
        self._finalizer()
