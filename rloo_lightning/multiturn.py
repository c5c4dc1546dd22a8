"""Multi-turn episodes, token in and token out: the policy's turns, the environment's replies, one transcript.

Each turn, all live episodes of the batch generate together through the module's engine. Their contexts
are the prompt plus the transcript so far, left-padded. Finished episodes drop out. The policy's tokens are
kept exactly as sampled. Only the environment's reply and the chat template's turn markers are appended,
as ids (:class:`TurnFormat`). The policy's text is never re-rendered or re-tokenized, so a template that
rewrites earlier turns (for example, dropping reasoning from past assistant messages) changes nothing
here.

The transcript becomes the rollout's completion: ``completion_ids`` holds every token after the prompt, and
``completion_mask`` is 1 only on the tokens the policy sampled. Environment and template tokens are context.
The model attends to them, but they get zero gradient and no KL, because every loss and KL term in the
package is masked by ``completion_mask``.
"""

from __future__ import annotations

import logging
import math
import numbers
import queue
import re
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from rloo_lightning import stop
from rloo_lightning.environments.base import EnvironmentConfigError, EnvStep, Environment, Message, PolicyTurn

logger = logging.getLogger(__name__)
# The package's logger prints nothing by itself (a library's logger: the application sets up its handlers). Each
# environment failure is logged there in full; the console gets one warning line per step.
logging.getLogger("rloo_lightning").addHandler(logging.NullHandler())

__all__ = ["CUT_KINDS", "EnvCalls", "Episode", "EpisodeError", "EpisodeSampler", "EpisodeWarning", "TurnFormat",
           "assemble_transcripts", "run_episodes", "transcript_logps"]

# Sentinels for reading a chat template's turn markers: plain words, so that no template trims or escapes them.
_A, _O, _U = "QXASSISTANTQX", "QXOBSERVATIONQX", "QXUSERQX"
# Around the observation's sentinel: survives a template that keeps the content as it is, gone where it trims.
_PAD = "\t \t"
_ROLE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")
# A reply's text is cut to this many characters per allowed token before it is tokenized, so that a reply of
# megabytes costs no more to encode than one at the limit.
_CHARS_PER_TOKEN = 16


@dataclass
class TurnFormat:
    """The ids appended around an environment message, read off the chat template once per role.

    For a reply in role ``r`` with text ``c``, the appended ids are ``before[r] + data(c) + after[r]``.
    ``before`` closes the policy's turn (whatever the template writes after an assistant message, less the
    end-of-turn token the policy sampled itself, when the template's closing starts with it) and opens a
    message in role ``r``. ``after`` closes it and opens the next assistant turn, as ``add_generation_prompt``
    does. Both depend on the role: a template may wrap a ``tool`` message inside a user turn, or give it a header
    of its own. Without a chat template, ``plain`` gives the markers as text.

    The markers are markup: their special tokens are parsed. The content is data: it is encoded with special tokens
    split into plain text, so an environment (or a policy echoed by a tool) that writes ``<|im_end|>`` cannot end a
    turn. A template that trims a message's content (``| trim``) gets its content trimmed here too.
    """

    tokenizer: object
    before: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    after: dict[str, list[int]] = field(default_factory=dict)
    trims: dict[str, tuple[bool, bool]] = field(default_factory=dict)
    plain: str | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer, plain: str = "\n{role}: {content}\nassistant: ") -> "TurnFormat":
        """The format of ``tokenizer``: its chat template's markers, or ``plain`` (a ``str.format`` pattern with
        ``{role}`` and ``{content}``) when it has no template."""
        if not getattr(tokenizer, "chat_template", None):
            return cls(tokenizer, plain=plain)
        return cls(tokenizer)

    def _render(self, role: str) -> tuple[str, str, tuple[bool, bool]]:
        """The template's text between an assistant message and a ``role`` message, after the latter, and whether
        the template trims the content's start and end."""
        messages = [{"role": "user", "content": _U}, {"role": "assistant", "content": _A},
                    {"role": role, "content": _PAD + _O + _PAD}]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as err:
            raise EnvironmentConfigError(f"the chat template cannot render a {role!r} message after an assistant "
                                         f"turn: {type(err).__name__}: {err}") from err
        if _A not in text or _O not in text[text.index(_A):]:
            raise EnvironmentConfigError(f"the chat template drops the content of an assistant or {role!r} message; "
                                         "it cannot carry a multi-turn episode")
        start = text.index(_A) + len(_A)
        at = text.index(_O, start)
        between, after = text[start:at], text[at + len(_O):]
        keeps_start, keeps_end = between.endswith(_PAD), after.startswith(_PAD)
        between = between[:-len(_PAD)] if keeps_start else between
        after = after[len(_PAD):] if keeps_end else after
        return between, after, (not keeps_start, not keeps_end)

    def markup_ids(self, text: str) -> list[int]:
        """``text`` written by the template or the user's ``reply_format``: special tokens are parsed."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def data_ids(self, text: str) -> list[int]:
        """``text`` written by an environment or a tool: special tokens are plain text, never markers."""
        if not text:
            return []
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def content(self, message: Message) -> str:
        """The message's content as the template writes it (trimmed where the template trims it)."""
        if self.plain is not None:
            return message.content
        if message.role not in self.trims:
            self._markers(message.role, "")
        trim_start, trim_end = self.trims[message.role]
        text = message.content.lstrip() if trim_start else message.content
        return text.rstrip() if trim_end else text

    def _markers(self, role: str, end: str) -> tuple[list[int], list[int]]:
        if self.plain is not None:
            head, _, tail = self.plain.partition("{content}")
            return self.markup_ids(head.format(role=role)), self.markup_ids(tail.format(role=role))
        key = (role, end)
        if key not in self.before:
            between, after, trims = self._render(role)
            if end and between.startswith(end):
                between = between[len(end):]
            self.before[key] = self.markup_ids(between)
            self.after[role], self.trims[role] = self.markup_ids(after), trims
        return self.before[key], self.after[role]

    def reply_ids(self, message: Message, end_token: str | None = None, content_ids: list[int] | None = None
                  ) -> list[int]:
        """The ids to append after a policy turn that ended with the end-of-turn token whose text is
        ``end_token`` (None: nothing of the template's closing is left out). The policy wrote that token, so
        where the template closes an assistant message with the same text it is not appended again; a turn ended
        by another end token (a model with several) gets the template's closing after it. ``content_ids``: the
        content's ids when the caller has them already (:meth:`data_ids` of :meth:`content`, possibly cut)."""
        before, after = self._markers(message.role, end_token or "")
        if content_ids is None:
            content_ids = self.data_ids(self.content(message))
        return before + list(content_ids) + after


CUT_KINDS = ("max_new_tokens", "max_turns", "context")


@dataclass
class Episode:
    """One episode's transcript: segments of ids, each the policy's (``True``) or the environment's.

    ``cut_by`` says why an episode stopped early: ``none``; ``max_new_tokens`` (a turn, the last included, ended
    without an end-of-turn token, also when the environment ended the episode on it); ``max_turns`` (still going
    after ``environment.max_turns``); ``context`` (its next turn could pass the context budget). ``truncated`` is
    ``cut_by != "none"``.
    """

    env: Environment
    segments: list[tuple[list[int], bool]] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    env_reward: float = 0.0
    turns: int = 0
    done: bool = False
    cut_by: str = "none"
    logps: list[list[float]] | None = field(default_factory=list)  # the engine's log pi_s per policy segment
    failed: bool = False  # the environment failed (``on_error`` scored the episode)
    abandoned: bool = False  # a call ran past ``environment.timeout``: the object is never called again
    replies_cut: int = 0  # replies cut to ``environment.max_reply_tokens``

    @property
    def truncated(self) -> bool:
        return self.cut_by != "none"

    def cut(self, kind: str) -> None:
        """End the episode, cut by ``kind`` (a turn without an end token outranks the other kinds)."""
        self.done = True
        if self.cut_by != "max_new_tokens":
            self.cut_by = kind

    def length(self) -> int:
        return sum(len(ids) for ids, _ in self.segments)


class EpisodeError(RuntimeError):
    """An environment failed: it raised, ran past ``environment.timeout``, or returned something malformed. The
    message names the environment, the call, the prompt row, the sample and the turn; ``call`` is the method
    (``reset``, ``step``, ...) and ``how`` one of ``raised``, ``timed out``, ``malformed``, ``not started`` (the
    rollout's time for calls ran out after a timeout, or too many abandoned calls still run)."""

    def __init__(self, message: str, call: str = "step", how: str = "raised") -> None:
        super().__init__(message)
        self.call, self.how = call, how


def end_failed(episode: Episode, row: int, error: EpisodeError,
               on_error: Callable[[Episode, int, EpisodeError], None] | None, cause=None) -> None:
    """End ``episode`` as failed (abandoned after a timeout: never called again); raise ``error`` (from ``cause``,
    the exception the environment raised) without ``on_error``, else hand it to ``on_error``."""
    episode.done, episode.failed, episode.abandoned = True, True, error.how == "timed out"
    if on_error is None:
        raise error from (cause if isinstance(cause, BaseException) else None)
    on_error(episode, row, error)


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


def abandon_cut_off(episodes: Sequence[Episode], todo: Sequence[int], results: Sequence[tuple[str, object]]) -> None:
    """Mark abandoned each episode of ``todo`` whose call was cut off while running (:meth:`EnvCalls.run` with
    ``fail_fast``): it may still be running, so the object must not be called again, not even ``close``. Done
    before any result raises."""
    for i, (status, started) in zip(todo, results):
        if status == "cut off" and started:
            episodes[i].abandoned = True


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) or isinstance(value, Tensor) and value.numel() == 1


def _check_step(step) -> str | None:
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


def _turn_text(tokenizer, tokens: list[int], control: set[int]) -> str:
    """The text of a policy turn, as the environment reads it: the tokenizer's control tokens (end-of-turn, BOS,
    padding, unknown) are left out, every other token is kept, a call marker that is a special token included."""
    return tokenizer.decode([t for t in tokens if t not in control], skip_special_tokens=False)


def control_ids(tokenizer, eos_ids: Sequence[int]) -> set[int]:
    """The ids :func:`_turn_text` leaves out: ``eos_ids`` and the tokenizer's BOS, EOS, padding and unknown tokens."""
    named = (getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk"))
    return set(eos_ids) | {t for t in named if t is not None}


def run_episodes(generate: Callable, tokenizer, prompt_ids: Tensor, prompt_mask: Tensor,
                 episodes: Sequence[Episode], fmt: TurnFormat, eos_ids: Sequence[int], max_new_tokens: int,
                 max_turns: int, max_context: int | None, where: Sequence[str],
                 on_error: Callable[[Episode, int, EpisodeError], None] | None = None,
                 keep_going: Callable[[bool], bool] | None = None, calls: EnvCalls | None = None,
                 max_reply_tokens: int | None = None) -> None:
    """Play ``episodes`` (one per row of ``prompt_ids``) to their end, in place.

    Args:
        generate: ``(context_ids [L, C], context_mask [L, C], turn) -> ids [L, T']`` or ``(ids, logp [L, T'])``:
            left-padded contexts in, sampled ids (and the engine's log-probs of them) out. The module's engine,
            seeded per turn.
        prompt_ids, prompt_mask: ``[B, P]`` left-padded prompts.
        episodes: ``B`` episodes, already reset.
        eos_ids: the end-of-turn ids: a turn ends at the first of them.
        max_new_tokens: the most tokens of one turn. A turn that reaches it without an end-of-turn token ends
            the episode, cut by ``max_new_tokens`` (also when the environment ended the episode on that turn).
        max_turns: the most policy turns of an episode. An episode still going after them is cut by
            ``max_turns``. The reply that would have opened another turn is not appended.
        max_context: the most tokens of prompt plus transcript (None: no limit). An episode whose next turn
            could pass it is cut by ``context`` instead of taking that turn, and the reply that would have opened
            that turn is dropped.
        where: each row's name for error messages (its prompt row and sample).
        on_error: ``(episode, row, error)`` for an environment that failed; it ends the episode (``failed``). None:
            the :class:`EpisodeError` propagates.
        keep_going: ``(this rank has a live episode) -> any rank has one``, for a policy whose every forward is a
            collective (``synced_gpus``): a rank without live episodes then still takes part in each turn with a
            throw-away row, so the other ranks' collectives pair up. None: ranks finish independently.
        calls: runs each turn's ``step`` calls (concurrency, timeout); None: one after another, no time limit.
        max_reply_tokens: the most tokens of a reply's content; a longer one is cut to its first
            ``max_reply_tokens`` tokens (counted in ``Episode.replies_cut``). None: no limit.
    """
    calls = calls or EnvCalls()
    prompts = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids, prompt_mask)]
    eos = list(eos_ids)
    eos_set, control = set(eos), control_ids(tokenizer, eos)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]

    for turn in range(max_turns):
        live = []
        for i, ep in enumerate(episodes):
            if ep.done:
                continue
            if max_context is not None and len(prompts[i]) + ep.length() + max_new_tokens > max_context:
                ep.cut("context")
                if ep.segments and not ep.segments[-1][1]:  # the reply that would have opened the cut turn
                    ep.segments.pop()
                    ep.messages.pop()
                continue
            live.append(i)
        if stop.check("an episode's turn"):  # several ranks: no more turns, they stop together after the rollout
            live = []
        if keep_going is not None:
            if not keep_going(bool(live)):
                break
        elif not live:
            break
        contexts = [prompts[i] + [t for ids, _ in episodes[i].segments for t in ids] for i in live] or [prompts[0]]
        width = max(map(len, contexts))
        ids = torch.full((len(contexts), width), pad, dtype=torch.long, device=prompt_ids.device)
        mask = torch.zeros((len(contexts), width), dtype=torch.long, device=prompt_ids.device)
        for j, ctx in enumerate(contexts):
            ids[j, width - len(ctx):] = torch.tensor(ctx, device=ids.device)
            mask[j, width - len(ctx):] = 1
        out = generate(ids, mask, turn)
        sampled, logp = (out[0].cpu(), out[1].float().cpu()) if isinstance(out, (tuple, list)) else (out.cpu(), None)
        turns = []
        for j, i in enumerate(live):
            ep, row = episodes[i], sampled[j].tolist()
            ends = [t for t, tok in enumerate(row) if tok in eos_set]
            ended = bool(ends)
            tokens = row[:ends[0] + 1] if ended else row[:max_new_tokens]
            text = _turn_text(tokenizer, tokens, control)
            ep.segments.append((tokens, True))
            if logp is None or ep.logps is None:
                ep.logps = None
            else:
                ep.logps.append(logp[j, :len(tokens)].tolist())
            ep.messages.append({"role": "assistant", "content": text})
            ep.turns += 1
            turns.append(PolicyTurn(tuple(tokens), text, turn, ended))
        # The environments answer this turn together (``environment.workers``), each within the timeout.
        results = calls.run([lambda ep=episodes[i], t=t: ep.env.step(t) for i, t in zip(live, turns)],
                            fail_fast=on_error is None)
        abandon_cut_off(episodes, live, results)
        for i, policy_turn, (status, step) in zip(live, turns, results):
            if status == "cut off":  # on_error raise: another call failed, and raises below
                continue
            ep = episodes[i]
            error = call_error(ep.env, "step", status, step, _check_step(step) if status == "ok" else None,
                               f"on {where[i]}, turn {turn}", calls.timeout)
            if error is not None:
                end_failed(ep, i, error, on_error, step)
                continue
            ep.env_reward += float(step.reward)
            if not policy_turn.ended:
                ep.cut("max_new_tokens")
            elif step.done or step.observation is None:
                ep.done = True
            elif turn == max_turns - 1:
                ep.cut("max_turns")
            else:
                message = step.observation
                content = fmt.content(message)
                content_ids = fmt.data_ids(content[:_CHARS_PER_TOKEN * max_reply_tokens]
                                           if max_reply_tokens is not None else content)
                if max_reply_tokens is not None and (len(content_ids) > max_reply_tokens
                                                     or len(content) > _CHARS_PER_TOKEN * max_reply_tokens):
                    content_ids = content_ids[:max_reply_tokens]
                    content = tokenizer.decode(content_ids, skip_special_tokens=False)
                    ep.replies_cut += 1
                end = tokenizer.convert_ids_to_tokens(policy_turn.token_ids[-1])
                ep.segments.append((fmt.reply_ids(message, end, content_ids), False))
                ep.messages.append({"role": message.role, "content": content})
    for ep in episodes:  # still going after the last turn (or cut before its first)
        if not ep.done:
            ep.cut("max_turns")


def assemble_transcripts(episodes: Sequence[Episode], pad_token_id: int, device=None) -> tuple[Tensor, Tensor, Tensor]:
    """The episodes' transcripts as a rollout's completion.

    Returns:
        ``(completion_ids [B, T], policy_mask [B, T] float, context_mask [B, T] float)``: every token after
        the prompt, right-padded. ``policy_mask`` is 1 on tokens the policy sampled. ``context_mask`` is 1 on
        every transcript token, the policy's and the environment's.
    """
    width = max([ep.length() for ep in episodes] + [1])
    ids = torch.full((len(episodes), width), pad_token_id, dtype=torch.long)
    policy = torch.zeros((len(episodes), width))
    context = torch.zeros((len(episodes), width))
    for i, ep in enumerate(episodes):
        at = 0
        for seg, is_policy in ep.segments:
            ids[i, at:at + len(seg)] = torch.tensor(seg, dtype=torch.long)
            context[i, at:at + len(seg)] = 1
            if is_policy:
                policy[i, at:at + len(seg)] = 1
            at += len(seg)
    return ids.to(device), policy.to(device), context.to(device)


def transcript_logps(episodes: Sequence[Episode], width: int, device=None) -> Tensor | None:
    """``[B, width]`` the engine's log pi_s of each policy token (0 elsewhere), or None when the engine reported
    none for some turn."""
    if any(ep.logps is None or len(ep.logps) != sum(p for _, p in ep.segments) for ep in episodes):
        return None
    out = torch.zeros((len(episodes), width))
    for i, ep in enumerate(episodes):
        at, turns = 0, iter(ep.logps)
        for seg, is_policy in ep.segments:
            if is_policy:
                out[i, at:at + len(seg)] = torch.tensor(next(turns))
            at += len(seg)
    return out.to(device)


class EpisodeSampler:
    """Step 1 of a multi-turn rollout: k episodes per prompt, played through the module's engine.

    Made by :class:`~rloo_lightning.RLOOModule` from ``model.environment``
    (:class:`~rloo_lightning.config.EnvironmentArgs`). The environment class is imported, and its ``init_args``
    checked (:meth:`Environment.check_init_args`), at construction, so a wrong path, a wrong argument or a tool that
    cannot be imported fails before any model is loaded.

    Every call to an environment (``reset``, ``step``, ``final_reward``, ``metrics``, ``close``) is guarded: an
    exception, a call past ``environment.timeout`` or a malformed answer becomes an :class:`EpisodeError` naming the
    environment, the call, the prompt row, the sample and the turn, and ``environment.on_error`` decides what it does.
    A step's failures make one warning line with their counts; each failure goes in full to the ``rloo_lightning``
    logger.
    """

    columns = ("transcript",)  # what a multi-turn rollout adds to the data's columns for the reward functions

    def __init__(self, args) -> None:
        from rloo_lightning.config import parse_on_error

        self.args = args
        self.env_class = import_environment(args.class_path, "environment.class_path")
        self.env_class.check_init_args(dict(args.init_args))
        reserved = set(self.env_class.metric_names) & set(EPISODE_METRICS)
        if reserved:
            raise EnvironmentConfigError(f"environment {args.class_path}: metric_names {sorted(reserved)} are the "
                                         "package's own per-episode metrics; rename them")
        self.on_error = parse_on_error("environment.on_error", args.on_error)
        self.calls = EnvCalls(args.timeout, args.workers)
        self._format: TurnFormat | None = None

    def check_data(self, datamodule) -> None:
        """The environment against the data module (:meth:`Environment.check_data`), before any model loads."""
        self.env_class.check_data(dict(self.args.init_args), datamodule)

    def new_environment(self) -> Environment:
        try:
            return self.env_class(**self.args.init_args)
        except Exception as err:
            raise EnvironmentConfigError(f"environment {self.args.class_path}(**{self.args.init_args!r}) raised "
                                         f"{type(err).__name__}: {err}") from err

    def turn_format(self, tokenizer) -> TurnFormat:
        if self._format is None:
            self._format = TurnFormat.from_tokenizer(tokenizer, plain=self.args.reply_format)
        return self._format

    def sample(self, model, tokenizer, batch: dict, k: int, generation_config, seed: int, engine, grad_free,
               reduce: Callable | None = None):
        """The rollout of ``k`` episodes for each prompt of ``batch``, seeded by ``seed``.

        Episode ``(row r, sample j)`` is reset with ``derive_seed(seed, "env", r, j)``, ``r`` the prompt's row in
        its source (``batch["row_index"]``): ``seed`` itself comes from (sampling.seed, rank, step), so a resumed
        run replays its episodes exactly. Turn ``t`` samples with ``seed`` (t = 0) or ``derive_seed(seed, "turn",
        t)``.
        """
        from rloo_lightning.engines import generates_synced
        from rloo_lightning.models import config_context
        from rloo_lightning.rollout import Episodes, Rollout, normal_tensor, derive_seed, eos_list

        n = batch["input_ids"].shape[0]
        prompt_ids = batch["input_ids"].repeat_interleave(k, dim=0)
        prompt_mask = batch["attention_mask"].repeat_interleave(k, dim=0)
        rows = batch.get("row_index")
        rows = rows.tolist() if isinstance(rows, Tensor) else list(rows) if rows is not None else list(range(n))
        columns = batch["columns"]
        if "transcript" in columns:  # self.columns
            raise ValueError("the data set has a column 'transcript', which multi-turn rollouts fill with each "
                             "episode's messages: rename the column")
        eos = eos_list(generation_config)
        fmt = self.turn_format(tokenizer)
        where = [f"prompt row {rows[i // k]} ({batch['prompt'][i // k]!r:.80}), sample {i % k}" for i in range(n * k)]
        budget = self.args.max_context_tokens or config_context(getattr(model, "config", None))
        failures = _Failures(self.args.class_path, n * k, self.on_error)
        on_error = None if self.on_error[0] == "raise" else failures.add
        episodes = [Episode(self.new_environment()) for _ in range(n * k)]
        self.calls.new_rollout()  # hung calls of this rollout share one more timeout (EnvCalls)

        def guarded(call: str, todo: list[int], make: Callable[[Episode, int], Callable[[], object]],
                    check: Callable[[object], str | None], at: Callable[[int], str]) -> dict[int, object]:
            """Run ``call`` on the episodes ``todo``; the well-formed results by episode, failures to ``on_error``."""
            out = {}
            results = self.calls.run([make(episodes[i], i) for i in todo], fail_fast=on_error is None)
            abandon_cut_off(episodes, todo, results)
            for i, (status, value) in zip(todo, results):
                if status == "cut off":  # on_error raise: another call failed, and raises below
                    continue
                ep = episodes[i]
                error = call_error(ep.env, call, status, value, check(value) if status == "ok" else None, at(i),
                                   self.calls.timeout)
                if error is None:
                    out[i] = value
                    continue
                end_failed(ep, i, error, on_error, value)
            return out

        def row_of(i: int) -> dict:
            return {"prompt": batch["prompt"][i // k], **{c: v[i // k] for c, v in columns.items()},
                    "row_index": rows[i // k], "sample_index": i % k}

        def generate(ids: Tensor, mask: Tensor, turn: int):
            with grad_free:
                out = engine.generate(model, tokenizer, ids, mask, generation_config,
                                      seed if turn == 0 else derive_seed(seed, "turn", turn))
            return tuple(normal_tensor(t) for t in out) if isinstance(out, (tuple, list)) else normal_tensor(out)

        device = prompt_ids.device
        keep_going = None
        if reduce is not None and generates_synced(model):
            keep_going = lambda live: bool(reduce(torch.tensor(float(live), device=device), "max") > 0)  # noqa: E731
        names = tuple(self.env_class.metric_names)
        try:
            guarded("reset", list(range(n * k)),
                    lambda ep, i: lambda: ep.env.reset(row_of(i), derive_seed(seed, "env", rows[i // k], i % k)),
                    lambda value: None, lambda i: f"on {where[i]}, at reset")
            run_episodes(generate, tokenizer, prompt_ids, prompt_mask, episodes, fmt, eos,
                         int(generation_config.max_new_tokens), self.args.max_turns, budget, where,
                         on_error=on_error, keep_going=keep_going, calls=self.calls,
                         max_reply_tokens=self.args.max_reply_tokens)
            scored = [i for i, ep in enumerate(episodes) if not ep.failed]
            finals = guarded("final_reward", scored, lambda ep, i: lambda: ep.env.final_reward(ep.truncated),
                             _check_reward, lambda i: f"on {where[i]}, after turn {episodes[i].turns - 1}")
            for i, value in finals.items():
                episodes[i].env_reward += float(value)
            measured = guarded("metrics", [i for i, ep in enumerate(episodes) if not ep.failed],
                               lambda ep, i: ep.env.metrics, lambda value: _check_metrics(value, names),
                               lambda i: f"on {where[i]}, after turn {episodes[i].turns - 1}")
        finally:
            self._close(episodes, where)
        failed = math.nan if self.on_error[1] is None else self.on_error[1]  # on_error's score
        env_rewards = [failed if ep.failed else ep.env_reward for ep in episodes]
        env_metrics = {name: torch.tensor([float(measured[i].get(name, 0.0)) if i in measured else math.nan
                                           for i in range(len(episodes))]) for name in names}
        env_metrics["replies_cut"] = torch.tensor([float(ep.replies_cut) for ep in episodes])
        failures.report()
        ids, policy, context = assemble_transcripts(episodes, tokenizer.pad_token_id if tokenizer.pad_token_id
                                                    is not None else eos[0], device)
        final = [next((seg for seg, is_policy in reversed(ep.segments) if is_policy), []) for ep in episodes]
        transcripts = [list(ep.messages) for ep in episodes]
        record = Episodes(context_mask=context, final_turn_ids=final,
                          rewards=torch.tensor(env_rewards, dtype=torch.float32, device=device),
                          turns=torch.tensor([ep.turns for ep in episodes], device=device),
                          metrics={name: v.to(device) for name, v in env_metrics.items()},
                          cut_by=[ep.cut_by for ep in episodes])
        last_turns = [next((m["content"] for m in reversed(ep.messages) if m["role"] == "assistant"), "")
                      for ep in episodes]
        return Rollout.sampled(k, batch["input_ids"], batch["attention_mask"], batch["prompt"], columns, ids, policy,
                               torch.tensor([ep.truncated for ep in episodes], device=device), last_turns,
                               transcript_logps(episodes, ids.shape[1], device), record,
                               sample_columns={"transcript": transcripts})

    def _close(self, episodes: Sequence[Episode], where: Sequence[str]) -> None:
        """Close every episode that was not abandoned; a failing close is logged, never raised (it must not hide
        the episode's own error)."""
        todo = [i for i, ep in enumerate(episodes) if not ep.abandoned]
        for i, (status, value) in zip(todo, self.calls.run([episodes[i].env.close for i in todo])):
            if status != "ok":
                what = "did not return in time" if status == "timeout" else f"was not started: {value}" \
                    if status == "not started" else f"failed: {type(value).__name__}: {value}"
                logger.warning("environment %s.close %s on %s", type(episodes[i].env).__name__, what, where[i])


EPISODE_METRICS = ("replies_cut",)


class _Failures:
    """The failures of one rollout's episodes: each to the logger in full as it happens, one warning line at the
    end with their counts (``report``)."""

    def __init__(self, environment: str, episodes: int, on_error: tuple[str, float | None]) -> None:
        self.environment, self.episodes = environment.rsplit(".", 1)[-1], episodes
        self.score = "a missing reward" if on_error[1] is None else f"reward {on_error[1]}"
        self.counts: dict[str, int] = {}
        self.first: str | None = None

    def add(self, episode: Episode, row: int, error: EpisodeError) -> None:
        key = f"{error.call} {error.how}"
        self.counts[key] = self.counts.get(key, 0) + 1
        self.first = self.first or str(error)
        logger.warning("%s; the episode ends with %s (environment.on_error)", error, self.score)

    def report(self) -> None:
        if not self.counts:
            return
        total = sum(self.counts.values())
        kinds = ", ".join(f"{key}: {n}" for key, n in sorted(self.counts.items()))
        warnings.warn(f"{total} of {self.episodes} episodes failed ({kinds}); the first: {self.first}; each ended "
                      f"with {self.score} (environment.on_error); every failure is logged in full to the "
                      "'rloo_lightning' logger", EpisodeWarning, stacklevel=3)


def _check_reward(value) -> str | None:
    if not _is_number(value):
        return f"returned {type(value).__name__} ({value!r:.40}); it must return a number"
    if not math.isfinite(float(value)):
        return f"returned {float(value)}; a reward must be finite"
    return None


def _check_metrics(value, names: Sequence[str]) -> str | None:
    if not isinstance(value, dict):
        return f"returned {type(value).__name__}; it must return a dict of numbers"
    for name in names:
        if name in value and not _is_number(value[name]):
            return f"returned {name}={value[name]!r:.40}; a metric must be a number"
    return None


def import_environment(path: str, option: str) -> type:
    """The :class:`Environment` subclass at import path ``path``; errors are :class:`EnvironmentConfigError`."""
    from rloo_lightning.rewards.protocol import RewardError, _import_object

    try:
        cls = _import_object(path, option)
    except RewardError as err:
        raise EnvironmentConfigError(str(err)) from err.__cause__
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise EnvironmentConfigError(f"{option} {path!r} is not a subclass of rloo_lightning.environments.Environment")
    return cls


class EpisodeWarning(RuntimeWarning):
    """Environments failed and ``environment.on_error`` scored their episodes (one warning per rollout)."""
