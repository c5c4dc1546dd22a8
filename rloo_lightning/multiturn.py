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

import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from rloo_lightning.environments.base import EnvStep, Environment, Message, PolicyTurn

__all__ = ["Episode", "EpisodeError", "EpisodeSampler", "EpisodeWarning", "TurnFormat", "assemble_transcripts",
           "run_episodes", "transcript_logps"]

# Sentinels for reading a chat template's turn markers: plain words, so that no template trims or escapes them.
_A, _O, _U = "QXASSISTANTQX", "QXOBSERVATIONQX", "QXUSERQX"


@dataclass
class TurnFormat:
    """The ids appended around an environment message, read off the chat template once.

    For a reply in role ``r`` with text ``c``, the appended ids are ``before + tokens(c) + after``.
    ``before`` closes the policy's turn (whatever the template writes after an assistant message, less the
    end-of-turn token the policy sampled itself, when the template's closing starts with it) and opens a
    message in role ``r``. ``after`` closes it and opens the next assistant turn, as ``add_generation_prompt``
    does. Without a chat template, ``plain`` gives the markers as text.
    """

    tokenizer: object
    before: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    after: list[int] = field(default_factory=list)
    plain: str | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer, plain: str = "\n{role}: {content}\nassistant: ") -> "TurnFormat":
        """The format of ``tokenizer``: its chat template's markers, or ``plain`` (a ``str.format`` pattern with
        ``{role}`` and ``{content}``) when it has no template."""
        if not getattr(tokenizer, "chat_template", None):
            return cls(tokenizer, plain=plain)
        return cls(tokenizer)

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
        return text[text.index(_A) + len(_A):text.index(_O)], text[text.index(_O) + len(_O):]

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def reply_ids(self, message: Message, end_token: str | None = None) -> list[int]:
        """The ids to append after a policy turn that ended with the end-of-turn token whose text is
        ``end_token`` (None: nothing of the template's closing is left out). The policy wrote that token, so
        where the template closes an assistant message with the same text it is not appended again; a turn ended
        by another end token (a model with several) gets the template's closing after it."""
        if self.plain is not None:
            return self._ids(self.plain.format(role=message.role, content=message.content))
        end = end_token or ""
        key = (message.role, end)
        if key not in self.before:
            between, after = self._render(message.role)
            if end and between.startswith(end):
                between = between[len(end):]
            self.before[key] = self._ids(between)
            self.after = self._ids(after)
        return self.before[key] + self._ids(message.content) + self.after


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
    logps: list[list[float]] | None = field(default_factory=list)  # the engine's log pi_s per policy segment
    failed: bool = False  # the environment raised (``on_error`` scored the episode)

    def length(self) -> int:
        return sum(len(ids) for ids, _ in self.segments)


class EpisodeError(RuntimeError):
    """An environment raised (or returned something that is not an :class:`EnvStep`); the message names the
    environment, the prompt row and the turn."""


def _step(episode: Episode, turn: PolicyTurn, where: str) -> EnvStep:
    name = type(episode.env).__name__
    try:
        step = episode.env.step(turn)
    except Exception as err:
        raise EpisodeError(f"environment {name} failed on {where}, turn {turn.index}: "
                                f"{type(err).__name__}: {err}") from err
    if not isinstance(step, EnvStep):
        raise EpisodeError(f"environment {name}.step returned {type(step).__name__} on {where}, turn "
                                f"{turn.index}; it must return an EnvStep")
    return step


def run_episodes(generate: Callable, tokenizer, prompt_ids: Tensor, prompt_mask: Tensor,
                 episodes: Sequence[Episode], fmt: TurnFormat, eos_ids: Sequence[int], max_new_tokens: int,
                 max_turns: int, max_context: int | None, where: Sequence[str],
                 on_error: Callable[[Episode, int, EpisodeError], None] | None = None,
                 keep_going: Callable[[bool], bool] | None = None) -> None:
    """Play ``episodes`` (one per row of ``prompt_ids``) to their end, in place.

    Args:
        generate: ``(context_ids [L, C], context_mask [L, C], turn) -> ids [L, T']`` or ``(ids, logp [L, T'])``:
            left-padded contexts in, sampled ids (and the engine's log-probs of them) out. The module's engine,
            seeded per turn.
        prompt_ids, prompt_mask: ``[B, P]`` left-padded prompts.
        episodes: ``B`` episodes, already reset.
        eos_ids: the end-of-turn ids: a turn ends at the first of them.
        max_new_tokens: the most tokens of one turn. A turn that reaches it without an end-of-turn token ends
            the episode, flagged truncated (``max_new_tokens``).
        max_turns: the most policy turns of an episode. An episode still going after them is flagged truncated
            (``max_turns``). The reply that would have opened another turn is not appended.
        max_context: the most tokens of prompt plus transcript (None: no limit). An episode whose next turn
            could pass it is flagged truncated (``context``) instead of taking that turn, and the reply that would
            have opened that turn is dropped.
        where: each row's name for error messages (its prompt row).
        on_error: ``(episode, row, error)`` for an environment that raised; it ends the episode (``failed``). None:
            the :class:`EpisodeError` propagates.
        keep_going: ``(this rank has a live episode) -> any rank has one``, for a policy whose every forward is a
            collective (``synced_gpus``): a rank without live episodes then still takes part in each turn with a
            throw-away row, so the other ranks' collectives pair up. None: ranks finish independently.
    """
    prompts = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids, prompt_mask)]
    eos = list(eos_ids)
    eos_set = set(eos)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    for turn in range(max_turns):
        live = []
        for i, ep in enumerate(episodes):
            if ep.done:
                continue
            if max_context is not None and len(prompts[i]) + ep.length() + max_new_tokens > max_context:
                ep.done, ep.truncated, ep.cut_by = True, True, "context"
                if ep.segments and not ep.segments[-1][1]:  # the reply that would have opened the cut turn
                    ep.segments.pop()
                    ep.messages.pop()
                continue
            live.append(i)
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
        for j, i in enumerate(live):
            ep, row = episodes[i], sampled[j].tolist()
            ends = [t for t, tok in enumerate(row) if tok in eos_set]
            ended = bool(ends)
            tokens = row[:ends[0] + 1] if ended else row[:max_new_tokens]
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            ep.segments.append((tokens, True))
            if logp is None or ep.logps is None:
                ep.logps = None
            else:
                ep.logps.append(logp[j, :len(tokens)].tolist())
            ep.messages.append({"role": "assistant", "content": text})
            ep.turns += 1
            try:
                step = _step(ep, PolicyTurn(tuple(tokens), text, turn, ended), where[i])
            except EpisodeError as err:
                if on_error is None:
                    raise
                ep.done, ep.failed = True, True
                on_error(ep, i, err)
                continue
            ep.env_reward += float(step.reward)
            if step.done or step.observation is None:
                ep.done = True
            elif not ended:
                ep.done, ep.truncated, ep.cut_by = True, True, "max_new_tokens"
            elif turn == max_turns - 1:
                ep.done, ep.truncated, ep.cut_by = True, True, "max_turns"
            else:
                reply = fmt.reply_ids(step.observation, tokenizer.convert_ids_to_tokens(tokens[-1]))
                ep.segments.append((reply, False))
                ep.messages.append({"role": step.observation.role, "content": step.observation.content})
    for ep in episodes:  # every episode cut before its first turn
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
    (:class:`~rloo_lightning.config.EnvironmentArgs`). The environment class is imported at construction, so a
    wrong path fails before any model is loaded.
    """

    def __init__(self, args) -> None:
        from rloo_lightning.config import parse_on_error
        from rloo_lightning.rewards.protocol import _import_object

        self.args = args
        self.env_class = _import_object(args.class_path, "environment.class_path")
        if not (isinstance(self.env_class, type) and issubclass(self.env_class, Environment)):
            raise ValueError(f"environment.class_path {args.class_path!r} is not a subclass of "
                             "rloo_lightning.environments.Environment")
        self.on_error = parse_on_error("environment.on_error", args.on_error)
        self._format: TurnFormat | None = None

    def new_environment(self) -> Environment:
        try:
            return self.env_class(**self.args.init_args)
        except Exception as err:
            raise ValueError(f"environment {self.args.class_path}(**{self.args.init_args!r}) raised "
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
        from rloo_lightning.rollout import Rollout, derive_seed

        n = batch["input_ids"].shape[0]
        prompt_ids = batch["input_ids"].repeat_interleave(k, dim=0)
        prompt_mask = batch["attention_mask"].repeat_interleave(k, dim=0)
        rows = batch.get("row_index")
        rows = rows.tolist() if isinstance(rows, Tensor) else list(rows) if rows is not None else list(range(n))
        columns = batch["columns"]
        if "transcript" in columns:
            raise ValueError("the data set has a column 'transcript', which multi-turn rollouts fill with each "
                             "episode's messages: rename the column")
        eos = generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos)
        fmt = self.turn_format(tokenizer)
        where = [f"prompt row {rows[i // k]} ({batch['prompt'][i // k]!r:.80}), sample {i % k}" for i in range(n * k)]
        episodes = []
        for i in range(n * k):
            ep = Episode(self.new_environment())
            row = {"prompt": batch["prompt"][i // k], **{c: v[i // k] for c, v in columns.items()},
                   "row_index": rows[i // k], "sample_index": i % k}
            try:
                ep.env.reset(row, derive_seed(seed, "env", rows[i // k], i % k))
            except Exception as err:
                self._call_failed(ep, i, f" failed to reset on {where[i]}", err)
            episodes.append(ep)

        def generate(ids: Tensor, mask: Tensor, turn: int):
            with grad_free:
                out = engine.generate(model, tokenizer, ids, mask, generation_config,
                                      seed if turn == 0 else derive_seed(seed, "turn", turn))
            return tuple(t.clone() if t.is_inference() else t for t in out) if isinstance(out, (tuple, list)) \
                else (out.clone() if out.is_inference() else out)

        device = prompt_ids.device
        keep_going = None
        if reduce is not None and generates_synced(model):
            keep_going = lambda live: bool(reduce(torch.tensor(float(live), device=device), "max") > 0)  # noqa: E731
        try:
            run_episodes(generate, tokenizer, prompt_ids, prompt_mask, episodes, fmt, eos,
                         int(generation_config.max_new_tokens), self.args.max_turns, self.args.max_context_tokens,
                         where, on_error=None if self.on_error[0] == "raise" else self._failed,
                         keep_going=keep_going)
            for i, ep in enumerate(episodes):
                if not ep.failed:
                    try:
                        ep.env_reward += float(ep.env.final_reward(ep.truncated))
                    except Exception as err:
                        self._call_failed(ep, i, f".final_reward failed on {where[i]}", err)
            failed = math.nan if self.on_error[1] is None else self.on_error[1]  # on_error's score
            env_rewards = [failed if ep.failed else ep.env_reward for ep in episodes]
            names = type(episodes[0].env).metric_names if episodes else ()
            env_metrics = {name: torch.tensor([float(ep.env.metrics().get(name, 0.0)) for ep in episodes])
                           for name in names}
        finally:
            for ep in episodes:
                try:
                    ep.env.close()
                except Exception:  # a failing close must not hide the episode's own error
                    pass
        ids, policy, context = assemble_transcripts(episodes, tokenizer.pad_token_id if tokenizer.pad_token_id
                                                    is not None else eos[0], device)
        final = [next((seg for seg, is_policy in reversed(ep.segments) if is_policy), []) for ep in episodes]
        transcripts = [list(ep.messages) for ep in episodes]
        rollout = Rollout(
            k=k, prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=ids, completion_mask=policy,
            truncated=torch.tensor([ep.truncated for ep in episodes], device=device),
            prompts=[p for p in batch["prompt"] for _ in range(k)],
            completions=[next((m["content"] for m in reversed(ep.messages) if m["role"] == "assistant"), "")
                         for ep in episodes],
            columns={**{c: [v for v in values for _ in range(k)] for c, values in columns.items()},
                     "transcript": transcripts},
            sampler_logp=transcript_logps(episodes, ids.shape[1], device),
            context_mask=context, final_turn_ids=final,
            env_rewards=torch.tensor(env_rewards, dtype=torch.float32, device=device),
            turns=torch.tensor([ep.turns for ep in episodes], device=device),
            env_metrics={name: v.to(device) for name, v in env_metrics.items()},
        )
        return rollout

    def _call_failed(self, episode: Episode, row: int, what: str, err: Exception) -> None:
        """An environment call outside the turn loop raised: raise an :class:`EpisodeError` naming the environment
        and ``what`` (``on_error: raise``), or end the episode as ``on_error`` says."""
        error = EpisodeError(f"environment {type(episode.env).__name__}{what}: {type(err).__name__}: {err}")
        if self.on_error[0] == "raise":
            raise error from err
        self._failed(episode, row, error)

    def _failed(self, episode: Episode, row: int, error: EpisodeError) -> None:
        episode.done, episode.failed = True, True
        score = "a missing reward" if self.on_error[1] is None else f"reward {self.on_error[1]}"
        warnings.warn(f"{error}; the episode ends with {score} (environment.on_error)", EpisodeWarning, stacklevel=2)


class EpisodeWarning(RuntimeWarning):
    """An environment failed and ``environment.on_error`` scored its episode."""
