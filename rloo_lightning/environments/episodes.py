"""Multi-turn episodes, token in and token out: the policy's turns, the environment's replies, one transcript.

Each turn, all live episodes of the batch generate together through the module's engine. Their contexts
are the prompt plus the transcript so far, left-padded. Finished episodes drop out. The policy's tokens are
kept exactly as sampled. Only the environment's reply and the chat template's turn markers are appended,
as ids (:class:`~rloo_lightning.environments.turns.TurnFormat`). The policy's text is never re-rendered or
re-tokenized, so a template that rewrites earlier turns (for example, dropping reasoning from past assistant
messages) changes nothing here. Each episode's state while it plays is a :class:`LiveEpisode`; the loop is
:func:`run_episodes`.

The transcript becomes the rollout's completion: ``completion_ids`` holds every token after the prompt, and
``completion_mask`` is 1 only on the tokens the policy sampled. Environment and template tokens are context.
The model attends to them, but they get zero gradient and no KL, because every loss and KL term in the
package is masked by ``completion_mask``.
"""


from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from rloo_lightning.environments.base import Environment, PolicyTurn
from rloo_lightning.environments.calls import EnvCalls, EpisodeError, call_error, check_step
from rloo_lightning.environments.turns import TurnFormat
from rloo_lightning.runtime import sigterm

__all__ = ["CUT_KINDS", "LiveEpisode", "abandon_cut_off", "assemble_transcripts", "control_ids", "end_failed",
           "run_episodes", "transcript_logps"]

# A reply's text is cut to this many characters per allowed token before it is tokenized, so that a reply of
# megabytes costs no more to encode than one at the limit.
_CHARS_PER_TOKEN = 16



CUT_KINDS = ("max_new_tokens", "max_turns", "context")


@dataclass
class LiveEpisode:
    """One episode's state while it plays (its environment, its transcript so far); the record of a finished
    rollout's episodes is :class:`~rloo_lightning.rollout.Episodes`. The transcript is segments of ids, each the
    policy's (``True``) or the environment's.

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


def end_failed(episode: LiveEpisode, row: int, error: EpisodeError,
               on_error: Callable[[LiveEpisode, int, EpisodeError], None] | None, cause=None) -> None:
    """End ``episode`` as failed (abandoned after a timeout: never called again); raise ``error`` (from ``cause``,
    the exception the environment raised) without ``on_error``, else hand it to ``on_error``."""
    episode.done, episode.failed, episode.abandoned = True, True, error.how == "timed out"
    if on_error is None:
        raise error from (cause if isinstance(cause, BaseException) else None)
    on_error(episode, row, error)



def abandon_cut_off(episodes: Sequence[LiveEpisode], todo: Sequence[int],
                    results: Sequence[tuple[str, object]]) -> None:
    """Mark abandoned each episode of ``todo`` whose call was cut off while running (:meth:`EnvCalls.run` with
    ``fail_fast``): it may still be running, so the object must not be called again, not even ``close``. Done
    before any result raises."""
    for i, (status, started) in zip(todo, results):
        if status == "cut off" and started:
            episodes[i].abandoned = True



def _turn_text(tokenizer, tokens: list[int], control: set[int]) -> str:
    """The text of a policy turn, as the environment reads it: the tokenizer's control tokens (end-of-turn, BOS,
    padding, unknown) are left out, every other token is kept, a call marker that is a special token included."""
    return tokenizer.decode([t for t in tokens if t not in control], skip_special_tokens=False)


def control_ids(tokenizer, eos_ids: Sequence[int]) -> set[int]:
    """The ids :func:`_turn_text` leaves out: ``eos_ids`` and the tokenizer's BOS, EOS, padding and unknown tokens."""
    named = (getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk"))
    return set(eos_ids) | {t for t in named if t is not None}


def run_episodes(generate: Callable, tokenizer, prompt_ids: Tensor, prompt_mask: Tensor,
                 episodes: Sequence[LiveEpisode], fmt: TurnFormat, eos_ids: Sequence[int], max_new_tokens: int,
                 max_turns: int, max_context: int | None, where: Sequence[str],
                 on_error: Callable[[LiveEpisode, int, EpisodeError], None] | None = None,
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
            ``max_reply_tokens`` tokens (counted in ``LiveEpisode.replies_cut``). None: no limit.
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
        if sigterm.check("an episode's turn"):  # several ranks: no more turns, they stop together after the rollout
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
            error = call_error(ep.env, "step", status, step, check_step(step) if status == "ok" else None,
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


def assemble_transcripts(episodes: Sequence[LiveEpisode], pad_token_id: int,
                         device=None) -> tuple[Tensor, Tensor, Tensor]:
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


def transcript_logps(episodes: Sequence[LiveEpisode], width: int, device=None) -> Tensor | None:
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
