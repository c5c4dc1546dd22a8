"""The guarded environment calls of an episode: :class:`EnvCalls` runs them on worker threads, each within a
timeout, and :func:`call_error` turns a call's status (``ok``, ``error``, ``timeout``, ``not started``, ``cut
off``) or a malformed answer (:func:`check_step`, :func:`check_reward`, :func:`check_metrics`) into an
:class:`EpisodeError` naming the environment, the call and the place.
"""

from __future__ import annotations

import math
import numbers
import queue
import re
import threading
import time
from typing import Callable, Sequence

from torch import Tensor

from rloo_lightning.environments.base import EnvironmentConfigError, EnvStep, Environment, Message

__all__ = ["EnvCalls", "EpisodeError", "call_error", "check_metrics", "check_reward", "check_step"]

_ROLE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")



class EpisodeError(RuntimeError):
    """An environment failed: it raised, ran past ``environment.timeout``, or returned something malformed. The
    message names the environment, the call, the prompt row, the sample and the turn; ``call`` is the method
    (``reset``, ``step``, ...) and ``how`` one of ``raised``, ``timed out``, ``malformed``, ``not started`` (the
    rollout's time for calls ran out after a timeout, or too many abandoned calls still run)."""

    def __init__(self, message: str, call: str = "step", how: str = "raised") -> None:
        super().__init__(message)
        self.call, self.how = call, how


def call_error(env: Environment, call: str, status: str, value, wrong: str | None, at: str,
               timeout: float | None) -> EpisodeError | None:
    """The :class:`EpisodeError` of one guarded call (an :meth:`EnvCalls.run` outcome ``(status, value)``, and
    ``wrong``: why its value is malformed, or None), or None when the call went well. ``at`` names the place."""
    name = type(env).__name__
    if status == "timeout":
        within = f"within {timeout} s {at} (environment.timeout)" if value is None else f"{at}: {value}"
        return EpisodeError(f"environment {name}.{call} did not return {within}; it was abandoned and is not called "
                            "again", call, "timed out")
    if status == "not started":
        return EpisodeError(f"environment {name}.{call} was not started {at}: {value}", call, "not started")
    if status == "error":
        failed = " failed" if call == "step" else f".{call} failed"
        return EpisodeError(f"environment {name}{failed} {at}: {type(value).__name__}: {value}", call, "raised")
    if wrong is not None:  # "returned ...; why": the place goes between
        what, _, why = wrong.partition("; ")
        return EpisodeError(f"environment {name}.{call} {what} {at}" + (f"; {why}" if why else ""), call, "malformed")
    return None


# -- environment calls, each guarded ----------------------------------------------------------------------------------
class EnvCalls:
    """Runs environment calls, ``workers`` at a time, each within ``timeout`` seconds.

    The calls run on ``workers`` threads kept for the run (the calls of a turn wait on sandboxes, interpreters or
    services far more often than they compute). A call past ``timeout`` is abandoned: Python cannot stop a thread,
    so it runs on in the background and its result is thrown away, its thread is replaced, and the caller never
    calls that environment object again. With one worker and no timeout the calls run in the caller's thread, one
    after another.

    Hung calls must not add up (sixteen in a row would cost sixteen timeouts), so a rollout (:meth:`new_rollout`)
    shares one more ``timeout`` once one of its calls has timed out: the rollout then waits at most that long on
    its calls, in all of its :meth:`run` s together; when it is spent, the calls still running are abandoned
    (``timeout``) and the calls not started are failed without starting (``not started``). Hung calls thus cost a
    rollout about twice the timeout at most, however many hang. At most ``max_hung`` abandoned calls may run on at
    once (default ``max(16, 4 * workers)``; a rollout abandons at most ``2 * workers``): past it a call is failed
    without starting until one of them returns, so the threads of hung calls stay bounded.

    Results come back in the calls' order whatever the order they finish in, so a turn's transcripts are the same
    for any number of workers (for environments that keep their state to themselves, as :class:`Environment`
    asks).
    """

    def __init__(self, timeout: float | None = None, workers: int = 1, max_hung: int | None = None) -> None:
        if timeout is not None and not timeout > 0:
            raise EnvironmentConfigError(f"environment.timeout must be > 0 seconds or null, got {timeout}")
        if workers < 1:
            raise EnvironmentConfigError(f"environment.workers must be >= 1, got {workers}")
        self.timeout, self.workers = timeout, workers
        self.max_hung = max(16, 4 * workers) if max_hung is None else max_hung
        self.abandoned = 0  # calls abandoned so far (their threads may still be running)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._changed = threading.Condition()
        self._threads: set[threading.Thread] = set()  # the live workers (an abandoned one leaves the set)
        self._hung: set[threading.Thread] = set()  # the threads of abandoned calls still running
        self._left: float | None = None  # once a call of this rollout timed out: the seconds it may still wait

    @property
    def hung(self) -> int:
        """How many abandoned calls are still running (each on its own thread)."""
        with self._changed:
            return len(self._hung)

    def new_rollout(self) -> None:
        """The calls from here on are a new rollout's: no call of it has timed out yet."""
        self._left = None

    def run(self, calls: Sequence[Callable[[], object]], fail_fast: bool = False) -> list[tuple[str, object]]:
        """``[(status, value)]`` per call: ``("ok", result)``, ``("error", exception)``, ``("timeout", None)``
        (past its ``timeout``), ``("timeout", why)`` (cut when the rollout's time ran out), ``("not started",
        why)``, and with ``fail_fast`` (``environment.on_error: raise``) ``("cut off", started)``: the run returned
        at the first call that failed, and this one had not finished (``started``: it was running and is
        abandoned; never call its object again)."""
        if self.timeout is None and self.workers == 1:
            results: list[tuple[str, object]] = []
            for call in calls:
                results.append(("cut off", False) if fail_fast and results and results[-1][0] != "ok"
                               else self._one(call))
            return results
        if self._left is not None and self._left <= 0:
            return [("not started", self._spent())] * len(calls)
        batch = _Batch(len(calls))
        with self._changed:
            while len(self._threads) < self.workers:
                self._start_worker()
        for i, call in enumerate(calls):
            self._jobs.put((batch, i, call))
        charged = time.monotonic()  # since when this run's waiting counts against the rollout's time left
        try:
            with self._changed:
                while True:
                    now = time.monotonic()
                    running = [i for i in batch.started if batch.results[i] is None]
                    for i in running:
                        if self.timeout is not None and now - batch.started[i] >= self.timeout:
                            batch.results[i] = ("timeout", None)
                            self._abandon(batch, i)
                            if self._left is None:  # the rollout's first timeout: one more timeout, in all
                                self._left, charged = self.timeout, now
                    if self._left is not None and now - charged >= self._left:
                        return self._stop(batch, ("timeout", self._spent()), ("not started", self._spent()))
                    if fail_fast and any(r is not None and r[0] != "ok" for r in batch.results):
                        return self._stop(batch, ("cut off", True), ("cut off", False))
                    if all(r is not None for r in batch.results):
                        return batch.results
                    deadlines = [batch.started[i] + self.timeout for i in running if batch.results[i] is None] \
                        if self.timeout is not None else []
                    if self._left is not None:
                        deadlines.append(charged + self._left)
                    self._changed.wait(max(min(deadlines) - time.monotonic(), 0.0) if deadlines else None)
        finally:
            with self._changed:
                batch.cancelled = True  # calls not yet started (the caller was interrupted) are skipped
                if self._left is not None:
                    self._left -= time.monotonic() - charged

    def _spent(self) -> str:
        return (f"the rollout's time for environment calls ran out (environment.timeout: once a call has timed out, "
                f"the rollout's calls get {self.timeout} s more in all)")

    def _stop(self, batch: _Batch, running: tuple, waiting: tuple) -> list[tuple[str, object]]:
        """End ``batch`` now (under the lock): a call still running gets ``running`` and is abandoned, a call not
        started gets ``waiting`` and never starts."""
        batch.cancelled = True
        for i, result in enumerate(batch.results):
            if result is None:
                batch.results[i] = running if i in batch.started else waiting
                if i in batch.started:
                    self._abandon(batch, i)
        return batch.results

    def _abandon(self, batch: _Batch, i: int) -> None:
        """Leave call ``i`` of ``batch`` running on its thread (it may never come back) and replace the thread."""
        self._threads.discard(batch.thread[i])
        self._hung.add(batch.thread[i])
        self.abandoned += 1
        self._start_worker()

    def _start_worker(self) -> None:
        thread = threading.Thread(target=self._work, daemon=True, name="rloo-env-call")
        self._threads.add(thread)
        thread.start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            batch, i, call = self._jobs.get()
            with self._changed:
                if batch.cancelled:
                    continue
                if len(self._hung) >= self.max_hung:
                    batch.results[i] = ("not started", f"{len(self._hung)} abandoned environment calls are still "
                                        "running, the most kept (a thread cannot be stopped; environment.timeout); "
                                        "calls start again when one of them returns")
                    self._changed.notify_all()
                    continue
                batch.started[i], batch.thread[i] = time.monotonic(), me
                self._changed.notify_all()
            outcome = self._one(call)
            with self._changed:
                if batch.results[i] is None:
                    batch.results[i] = outcome
                self._changed.notify_all()
                if me not in self._threads:  # abandoned: a replacement took its place
                    self._hung.discard(me)
                    return

    @staticmethod
    def _one(call: Callable[[], object]) -> tuple[str, object]:
        try:
            return "ok", call()
        except Exception as err:  # the environment's own failure: reported by the caller, with its name and place
            return "error", err


class _Batch:
    """One :meth:`EnvCalls.run`: each call's result, start time and thread."""

    def __init__(self, n: int) -> None:
        self.results: list = [None] * n
        self.started: dict[int, float] = {}
        self.thread: dict[int, threading.Thread] = {}
        self.cancelled = False


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) or isinstance(value, Tensor) and value.numel() == 1


def check_step(step) -> str | None:
    """Why ``step`` is not a well-formed :class:`EnvStep`, or None."""
    if not isinstance(step, EnvStep):
        return f"returned {type(step).__name__}; it must return an EnvStep"
    obs = step.observation
    if obs is not None:
        if not isinstance(obs, Message):
            return (f"returned an observation of type {type(obs).__name__}; it must be a Message(role, content) or "
                    "None")
        if not isinstance(obs.role, str) or not _ROLE.fullmatch(obs.role):
            return f"returned a message with role {obs.role!r}; a role is a plain name such as 'user' or 'tool'"
        if not isinstance(obs.content, str):
            return f"returned a message whose content is {type(obs.content).__name__}; it must be a str"
    if not _is_number(step.reward):
        return f"returned a reward of type {type(step.reward).__name__} ({step.reward!r:.40}); it must be a number"
    if not math.isfinite(float(step.reward)):
        return f"returned the reward {float(step.reward)}; a reward must be finite"
    if not isinstance(step.done, (bool, numbers.Integral)):
        return f"returned done={step.done!r:.40}; it must be True or False"
    return None


def check_reward(value) -> str | None:
    if not _is_number(value):
        return f"returned {type(value).__name__} ({value!r:.40}); it must return a number"
    if not math.isfinite(float(value)):
        return f"returned {float(value)}; a reward must be finite"
    return None


def check_metrics(value, names: Sequence[str]) -> str | None:
    if not isinstance(value, dict):
        return f"returned {type(value).__name__}; it must return a dict of numbers"
    for name in names:
        if name in value and not _is_number(value[name]):
            return f"returned {name}={value[name]!r:.40}; a metric must be a number"
    return None
