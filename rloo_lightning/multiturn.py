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

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from rloo_lightning.environments.base import EnvStep, Environment, Message, PolicyTurn

__all__ = ["Episode", "TurnFormat", "assemble_transcripts", "run_episodes"]

# Sentinels for reading a chat template's turn markers: plain words, so that no template trims or escapes them.
_A, _O, _U = "QXASSISTANTQX", "QXOBSERVATIONQX", "QXUSERQX"


@dataclass
class TurnFormat:
    """The ids appended around an environment message, read off the chat template once.

    For a reply in role ``r`` with text ``c``, the appended ids are ``before[r] + tokens(c) + after``.
    ``before[r]`` closes the policy's turn (whatever the template writes after an assistant message, less the
    end-of-turn token the policy sampled itself) and opens a message in role ``r``. ``after`` closes it and
    opens the next assistant turn, as ``add_generation_prompt`` does. Without a chat template, ``plain``
    gives the markers as text.
    """

    tokenizer: object
    before: dict[str, list[int]] = field(default_factory=dict)
    after: list[int] = field(default_factory=list)
    plain: str | None = None
    _strip: str = ""

    @classmethod
    def from_tokenizer(cls, tokenizer, eos_text: str | None = None, plain: str = "\n{role}: {content}\nassistant: "
                       ) -> "TurnFormat":
        """The format of ``tokenizer``: its chat template's markers, or ``plain`` (a ``str.format`` pattern with
        ``{role}`` and ``{content}``) when it has no template. ``eos_text`` is the text of the end-of-turn token
        the policy samples (stripped from the template's marker, since the policy wrote it)."""
        if not getattr(tokenizer, "chat_template", None):
            return cls(tokenizer, plain=plain)
        return cls(tokenizer, _strip=eos_text or "")

    def _render(self, role: str) -> tuple[str, str]:
        """The template's text between an assistant message and a ``role`` message, and after the latter."""
        messages = [{"role": "user", "content": _U}, {"role": "assistant", "content": _A},
                    {"role": role, "content": _O}]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as err:
            raise ValueError(f"the chat template cannot render a {role!r} message after an assistant turn: {err}"
                             ) from err
        if _A not in text or _O not in text:
            raise ValueError(f"the chat template drops the content of an assistant or {role!r} message; it cannot "
                             "carry a multi-turn episode")
        between = text[text.index(_A) + len(_A):text.index(_O)]
        if self._strip and between.startswith(self._strip):
            between = between[len(self._strip):]
        return between, text[text.index(_O) + len(_O):]

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def reply_ids(self, message: Message) -> list[int]:
        """The ids to append after a policy turn that ended with its end-of-turn token."""
        if self.plain is not None:
            return self._ids(self.plain.format(role=message.role, content=message.content))
        if message.role not in self.before:
            between, after = self._render(message.role)
            self.before[message.role] = self._ids(between)
            self.after = self._ids(after)
        return self.before[message.role] + self._ids(message.content) + self.after


@dataclass
class Episode:
    """One episode's transcript: segments of ids, each the policy's (``True``) or the environment's."""

    env: Environment
    segments: list[tuple[list[int], bool]] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    env_reward: float = 0.0
    turns: int = 0
    done: bool = False
    truncated: bool = False
    cut_by: str | None = None  # "max_turns", "context", "max_new_tokens"

    def length(self) -> int:
        return sum(len(ids) for ids, _ in self.segments)


def _step(episode: Episode, turn: PolicyTurn, where: str) -> EnvStep:
    try:
        step = episode.env.step(turn)
    except Exception as err:
        raise RuntimeError(f"environment {type(episode.env).__name__} failed on {where}, turn {turn.index}: "
                           f"{type(err).__name__}: {err}") from err
    if not isinstance(step, EnvStep):
        raise TypeError(f"environment {type(episode.env).__name__}.step returned {type(step).__name__} on {where}; "
                        "it must return an EnvStep")
    return step


def run_episodes(generate: Callable[[Tensor, Tensor, int], Tensor], tokenizer, prompt_ids: Tensor, prompt_mask: Tensor,
                 episodes: Sequence[Episode], fmt: TurnFormat, eos_ids: Sequence[int], max_new_tokens: int,
                 max_turns: int, max_context: int | None, where: Sequence[str]) -> None:
    """Play ``episodes`` (one per row of ``prompt_ids``) to their end, in place.

    Args:
        generate: ``(context_ids [L, C], context_mask [L, C], turn) -> ids [L, T']``, left-padded contexts in and
            sampled ids out (the module's engine, seeded per turn).
        prompt_ids, prompt_mask: ``[B, P]`` left-padded prompts.
        episodes: ``B`` episodes, already reset.
        eos_ids: the end-of-turn ids: a turn ends at the first of them.
        max_new_tokens: the most tokens of one turn. A turn that reaches it without an end-of-turn token ends
            the episode, flagged truncated (``max_new_tokens``).
        max_turns: the most policy turns of an episode. An episode still going after them is flagged truncated
            (``max_turns``). The reply that would have opened another turn is not appended.
        max_context: the most tokens of prompt plus transcript (None: no limit). An episode whose next turn
            could pass it is flagged truncated (``context``) instead of taking that turn.
        where: each row's name for error messages (its prompt row).
    """
    prompts = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids, prompt_mask)]
    eos = list(eos_ids)
    eos_set = set(eos)
    for turn in range(max_turns):
        live = []
        for i, ep in enumerate(episodes):
            if ep.done:
                continue
            if max_context is not None and len(prompts[i]) + ep.length() + max_new_tokens > max_context:
                ep.done, ep.truncated, ep.cut_by = True, True, "context"
                continue
            live.append(i)
        if not live:
            break
        contexts = [prompts[i] + [t for ids, _ in episodes[i].segments for t in ids] for i in live]
        width = max(map(len, contexts))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
        ids = torch.full((len(live), width), pad, dtype=torch.long, device=prompt_ids.device)
        mask = torch.zeros((len(live), width), dtype=torch.long, device=prompt_ids.device)
        for j, ctx in enumerate(contexts):
            ids[j, width - len(ctx):] = torch.tensor(ctx, device=ids.device)
            mask[j, width - len(ctx):] = 1
        sampled = generate(ids, mask, turn).cpu()
        for j, i in enumerate(live):
            ep, row = episodes[i], sampled[j].tolist()
            ends = [t for t, tok in enumerate(row) if tok in eos_set]
            ended = bool(ends)
            tokens = row[:ends[0] + 1] if ended else row[:max_new_tokens]
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            ep.segments.append((tokens, True))
            ep.messages.append({"role": "assistant", "content": text})
            ep.turns += 1
            step = _step(ep, PolicyTurn(tuple(tokens), text, turn, ended), where[i])
            ep.env_reward += float(step.reward)
            if step.done or step.observation is None:
                ep.done = True
            elif not ended:
                ep.done, ep.truncated, ep.cut_by = True, True, "max_new_tokens"
            elif turn == max_turns - 1:
                ep.done, ep.truncated, ep.cut_by = True, True, "max_turns"
            else:
                reply = fmt.reply_ids(step.observation)
                ep.segments.append((reply, False))
                ep.messages.append({"role": step.observation.role, "content": step.observation.content})
    for ep in episodes:  # max_turns == 0 or every episode cut before its first turn
        if not ep.done:
            ep.done, ep.truncated, ep.cut_by = True, True, "max_turns"


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
