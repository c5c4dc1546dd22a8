"""The rollout record and generation: repeat prompts, sample, masks, decode; the sampler protocol behind
``RLOOModule.sample`` (:class:`Sampler`) and its single-turn sampler."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch import Tensor
from transformers import GenerationConfig

from rloo_lightning.engines import GenerationEngine, HFGenerateEngine
from rloo_lightning.algo.logprobs import completion_mask

__all__ = ["Rollout", "Episodes", "eos_list", "concat_groups", "sampling_config", "default_eos_ids", "derive_seed",
           "generate_rollout", "rollout_from_ids", "stop_string_ends", "generation_configs", "normal_tensor",
           "GenerationContext",
           "Sampler", "CompletionSampler"]


@dataclass
class Episodes:
    """A multi-turn rollout's per-episode record (``environment.class_path``,
    :mod:`rloo_lightning.environments.sampler`).

    Such a rollout holds each episode's whole transcript in ``completion_ids``; ``completion_mask`` is 1 only on
    the tokens the policy sampled, so every loss and KL term covers those alone.

    Attributes:
        context_mask: ``[B, T]`` float, 1 on every transcript token (the policy's and the environment's).
        final_turn_ids: each episode's last policy turn, as sampled (the reward functions' ``completion_ids``).
        rewards: ``[B]`` the environment's reward of each episode (NaN: missing, ``environment.on_error``).
        turns: ``[B]`` policy turns of each episode.
        metrics: ``{name: [B]}`` the environment's per-episode metrics (``Environment.metric_names``; NaN for an
            episode that failed), and the package's ``replies_cut``.
        cut_by: each episode's truncation kind: ``none``, ``max_new_tokens`` (a turn without its end token),
            ``max_turns``, ``context``.
    """

    context_mask: Tensor
    final_turn_ids: list[list[int]]
    rewards: Tensor
    turns: Tensor
    metrics: dict[str, Tensor]
    cut_by: list[str]

    def select(self, rows: list[int], width: int) -> Episodes:
        """These rows, the context mask right-padded with 0 to ``width`` columns."""
        pad = width - self.context_mask.shape[1]
        return Episodes(context_mask=torch.nn.functional.pad(self.context_mask[rows], (0, pad)),
                        final_turn_ids=[self.final_turn_ids[i] for i in rows], rewards=self.rewards[rows],
                        turns=self.turns[rows], metrics={n: v[rows] for n, v in self.metrics.items()},
                        cut_by=[self.cut_by[i] for i in rows])

    @staticmethod
    def cat(parts: list[Episodes]) -> Episodes:
        return Episodes(context_mask=torch.cat([p.context_mask for p in parts]),
                        final_turn_ids=[ids for p in parts for ids in p.final_turn_ids],
                        rewards=torch.cat([p.rewards for p in parts]), turns=torch.cat([p.turns for p in parts]),
                        metrics={n: torch.cat([p.metrics[n] for p in parts]) for n in parts[0].metrics},
                        cut_by=[kind for p in parts for kind in p.cut_by])


@dataclass
class Rollout:
    """One rollout: ``B = N*k`` completions, prompt-major (the k samples of prompt p at p*k..p*k+k-1).

    Built once by :meth:`sampled` (single- and multi-turn alike); each later field is assigned by one step of
    ``RLOOModule.training_step`` / ``rollout_loss``, named below. Callbacks see the record as step 6 starts, before the
    advantages (:class:`rloo_lightning.callbacks.RolloutHook`) and may edit ``keep`` or ``baseline_rewards``.

    Attributes:
        k: samples per prompt.
        prompt_ids, prompt_mask: ``[B, P]`` left-padded prompt tokens (each prompt repeated k times).
        completion_ids: ``[B, T]`` sampled tokens (padding after the end).
        completion_mask: ``[B, T]`` float, 1 up to and including the first EOS.
        truncated: ``[B]`` bool, no EOS within ``max_new_tokens`` (an episode: cut for any reason, see
            ``episodes.cut_by``).
        prompts, completions: ``B`` strings (completion text without the EOS; an episode's: its last policy turn).
        columns: the dataset's extra columns, each a list of ``B`` values (an episode's: also ``transcript``).
        sampler_logp: ``[B, T]`` log pi_s of each sampled token under the engine's own distribution (0 off the
            mask), when the engine reports it; None for an engine that samples from pi_theta itself.
        episodes: the per-episode record of a multi-turn rollout (:class:`Episodes`), None for a single-turn one.
        scores: step 2, ``{reward name: [B]}`` per reward function (NaN: no reward).
        rewards: step 2, ``[B]`` the task reward r: the weighted sum of ``scores`` (plus the environment's), with
            the ``shaping`` penalties; no KL term.
        ref_logp: step 3, ``[B, T]`` reference log-probs (None when beta == 0).
        token_kl, kl: step 4, ``[B, T]`` per-token ``logp - ref_logp`` (detached, 0 off the mask) and ``[B]`` its
            sum, the sequence KL log pi(y)/pi_ref(y); None when beta == 0.
        baseline_rewards: step 4, ``[B]`` the reward R the baseline and advantages are computed from: ``r - beta*kl``
            (``kl.placement: reward``, the paper) or ``r``, standardised if ``advantage.normalize_rewards``.
        mismatch: step 5, ``{name: (sum, count)}`` of :func:`~rloo_lightning.algo.correction.mismatch_sums`.
        is_weights: step 5, ``[B]`` or ``[B, T]`` detached importance weights pi_theta/pi_s
            (``correction.level``), else None.
        keep: step 6, ``[B]`` bool; rows set False (by ``shaping.mask_truncated_completions`` or a callback) leave
            the loss (advantage 0), which is averaged over the kept rows.
        advantages: step 6, ``[B]`` advantages. token_advantages: step 6, ``[B, T]`` (``kl.placement:
            token_reward`` only).
        clip_stats: step 7, ``{name: (sum, count)}`` clip fractions of a reused rollout's update.
        old_logp: step 7, ``[B, T]`` the sampling policy's log-probs, kept after the first update when the rollout
            is reused (``update.updates_per_rollout > 1``): the later updates' importance ratio.
    """

    k: int
    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    truncated: Tensor
    prompts: list[str]
    completions: list[str]
    columns: dict[str, list] = field(default_factory=dict)
    sampler_logp: Tensor | None = None
    episodes: Episodes | None = None
    scores: dict[str, Tensor] = field(default_factory=dict)
    rewards: Tensor | None = None
    ref_logp: Tensor | None = None
    token_kl: Tensor | None = None
    kl: Tensor | None = None
    baseline_rewards: Tensor | None = None
    mismatch: dict = field(default_factory=dict)
    is_weights: Tensor | None = None
    keep: Tensor | None = None
    advantages: Tensor | None = None
    token_advantages: Tensor | None = None
    clip_stats: dict = field(default_factory=dict)
    old_logp: Tensor | None = None

    @classmethod
    def sampled(cls, k: int, prompt_ids: Tensor, prompt_mask: Tensor, prompts: list[str], columns: dict[str, list],
                completion_ids: Tensor, completion_mask: Tensor, truncated: Tensor, completions: list[str],
                sampler_logp: Tensor | None = None, episodes: Episodes | None = None,
                sample_columns: dict[str, list] | None = None, source: str = "the engine") -> Rollout:
        """The one constructor: a rollout of ``k`` samples for each of ``N`` prompts.

        Args:
            prompt_ids, prompt_mask: ``[N, P]`` left-padded prompts, repeated here k times (prompt-major).
            prompts, columns: ``N`` prompt strings and the data's columns (``N`` values each), repeated alike.
            completion_ids, completion_mask, truncated: ``[B, T]``, ``[B, T]``, ``[B]``.
            completions: ``B`` strings.
            sampler_logp: ``[B, T]`` the engine's log-probs or None; set to 0 off the mask, where -inf (a pad the
                sampler ruled out) may stand.
            episodes: a multi-turn rollout's :class:`Episodes`.
            sample_columns: columns of ``B`` values, one per sample (an episode's ``transcript``).
            source: what sampled, for the error on misshapen log-probs.

        Tensors made under ``torch.inference_mode`` (an engine's output) are copied out: the loss's autograd
        graph uses them later, which inference tensors cannot enter.
        """
        if sampler_logp is not None:
            if sampler_logp.shape != completion_ids.shape:
                raise ValueError(f"{source} returned log-probs of shape {tuple(sampler_logp.shape)} for ids of "
                                 f"shape {tuple(completion_ids.shape)}")
            sampler_logp = torch.where(completion_mask.bool(), normal_tensor(sampler_logp).float(),
                                       torch.zeros_like(completion_mask))
        return cls(
            k=k,
            prompt_ids=prompt_ids.repeat_interleave(k, dim=0),
            prompt_mask=prompt_mask.repeat_interleave(k, dim=0),
            completion_ids=normal_tensor(completion_ids),
            completion_mask=completion_mask,
            truncated=truncated,
            prompts=[p for p in prompts for _ in range(k)],
            completions=completions,
            columns={**{name: [v for v in values for _ in range(k)] for name, values in columns.items()},
                     **(sample_columns or {})},
            sampler_logp=sampler_logp,
            episodes=episodes,
        )

    @classmethod
    def from_state(cls, fields: dict) -> Rollout:
        """A rollout from ``dataclasses.asdict`` of one (a checkpoint's stored rollout, ``RolloutReuse``)."""
        fields = dict(fields)
        if isinstance(fields.get("episodes"), dict):
            fields["episodes"] = Episodes(**fields["episodes"])
        return cls(**fields)

    @property
    def num_prompts(self) -> int:
        return self.completion_ids.shape[0] // self.k

    @property
    def loss_mask(self) -> Tensor:
        """``[B, T]`` the tokens the loss and its denominators cover: the completion mask of the kept rows."""
        return self.completion_mask if self.keep is None else self.completion_mask * self.keep[:, None]

    @property
    def missing_eos(self) -> Tensor:
        """``[B]`` bool: the completion (an episode: one of its turns) ended without an end-of-turn token. For a
        single-turn rollout this is ``truncated``; an episode cut by ``max_turns`` or the context budget has its
        end tokens and is not counted."""
        if self.episodes is None:
            return self.truncated
        return torch.tensor([kind == "max_new_tokens" for kind in self.episodes.cut_by],
                            device=self.truncated.device)

    def completion_token_lists(self) -> list[list[int]]:
        """Each completion's token ids, up to and including its EOS (an episode's: its last policy turn)."""
        if self.episodes is not None:
            return [list(ids) for ids in self.episodes.final_turn_ids]
        lengths = self.completion_mask.sum(1).long().tolist()
        return [row[:n] for row, n in zip(self.completion_ids.tolist(), lengths)]


def normal_tensor(t: Tensor) -> Tensor:
    """``t``, copied out of inference mode if it was made there."""
    return t.clone() if t.is_inference() else t


def eos_list(generation_config: GenerationConfig) -> list[int]:
    """The config's end-of-sequence ids as a list (transformers allows an int or a list)."""
    eos = generation_config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos)


def concat_groups(parts: list[tuple[Rollout, list[int]]], pad_token_id: int) -> Rollout:
    """A scored rollout made of chosen prompt groups of several scored rollouts, in order.

    Prompts stay left-padded and completions right-padded to the widest part; only the fields
    set before the loss (the sample, its episodes, scores and rewards) are carried.

    Args:
        parts: ``(rollout, group indices)`` pairs; every rollout has the same ``k`` and columns.
    """
    k = parts[0][0].k
    rows = [(r, [g * k + j for g in groups for j in range(k)]) for r, groups in parts if groups]
    if not rows:
        raise ValueError("concat_groups: no groups chosen")
    prompt_w = max(r.prompt_ids.shape[1] for r, _ in rows)
    comp_w = max(r.completion_ids.shape[1] for r, _ in rows)

    def cat(get, width=None, value=0, left=False):
        pieces = [get(r)[idx] for r, idx in rows]
        if width is not None:
            pieces = [torch.nn.functional.pad(p, (width - p.shape[1], 0) if left else (0, width - p.shape[1]),
                                              value=value) for p in pieces]
        return torch.cat(pieces)

    first = rows[0][0]
    return Rollout(
        k=k,
        prompt_ids=cat(lambda r: r.prompt_ids, prompt_w, pad_token_id, left=True),
        prompt_mask=cat(lambda r: r.prompt_mask, prompt_w, 0, left=True),
        completion_ids=cat(lambda r: r.completion_ids, comp_w, pad_token_id),
        completion_mask=cat(lambda r: r.completion_mask, comp_w, 0),
        truncated=cat(lambda r: r.truncated),
        prompts=[r.prompts[i] for r, idx in rows for i in idx],
        completions=[r.completions[i] for r, idx in rows for i in idx],
        columns={c: [r.columns[c][i] for r, idx in rows for i in idx] for c in first.columns},
        sampler_logp=None if first.sampler_logp is None else cat(lambda r: r.sampler_logp, comp_w, 0.0),
        episodes=None if first.episodes is None else Episodes.cat([r.episodes.select(idx, comp_w)
                                                                   for r, idx in rows]),
        scores={n: cat(lambda r, n=n: r.scores[n]) for n in first.scores},
        rewards=cat(lambda r: r.rewards),
    )


def sampling_config(
    max_new_tokens: int,
    eos_token_ids: list[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    do_sample: bool = True,
    stop_strings: list[str] | None = None,
) -> GenerationConfig:
    """An explicit generation config: every sampling field set, so that nothing is inherited.

    transformers fills each field left ``None`` from the model's shipped ``generation_config``
    and then from global defaults (``top_k=50``); a sampler truncated that way is not pi_theta,
    and the REINFORCE estimator would be biased. Hence all fields are given values here.
    """
    return GenerationConfig(
        do_sample=do_sample,
        # Greedy ignores the sampling fields; None there only silences transformers' warning.
        temperature=temperature if do_sample else None,
        top_k=top_k if do_sample else None,
        top_p=top_p if do_sample else None,
        min_p=None,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=repetition_penalty,
        no_repeat_ngram_size=0,
        length_penalty=1.0,
        num_beams=1,
        num_return_sequences=1,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=list(eos_token_ids),
        stop_strings=list(stop_strings) if stop_strings else None,
        pad_token_id=pad_token_id,
        bad_words_ids=None,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        forced_bos_token_id=None,
        forced_eos_token_id=None,
        use_cache=True,
        renormalize_logits=False,
    )


def generation_configs(args, eos_token_ids: list[int], pad_token_id: int) -> tuple[GenerationConfig, GenerationConfig]:
    """The training sampler's config and the greedy one, from a :class:`~rloo_lightning.config.SamplingArgs`."""
    common = dict(max_new_tokens=args.max_new_tokens, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                  stop_strings=args.stop_strings)
    sampled = sampling_config(**common, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              repetition_penalty=args.repetition_penalty)
    return sampled, sampling_config(**common, do_sample=False)


def default_eos_ids(tokenizer, shipped: GenerationConfig | None) -> list[int]:
    """The tokenizer's EOS plus the shipped generation config's (a chat model's end-of-turn), in order."""
    ids = [tokenizer.eos_token_id]
    extra = shipped.eos_token_id if shipped is not None else None
    ids += [extra] if isinstance(extra, int) else list(extra or [])
    return list(dict.fromkeys(i for i in ids if i is not None))


def stop_string_ends(
    tokenizer,
    completion_ids: Tensor,
    mask: Tensor,
    stop_strings: list[str],
    prompt_ids: Tensor | None = None,
    prompt_mask: Tensor | None = None,
) -> Tensor:
    """Length of each completion up to and including the token that completes a stop string.

    A stop string may begin in the prompt (a chat prompt ending in ``"\n"`` and the stop ``"\n\n"``);
    transformers stops there too, so the end of the prompt is searched with the completion, and
    only matches that end inside the completion count.

    Args:
        completion_ids, mask: ``[B, T]``.
        prompt_ids, prompt_mask: ``[B, P]`` left-padded prompts, optional.

    Returns:
        ``[B]`` long: that length, or -1 where no stop string ends within the mask. Found by a
        binary search over prefixes (once a prefix holds a match, every longer one does).
    """
    longest = max(map(len, stop_strings))
    ends = torch.full((completion_ids.shape[0],), -1, dtype=torch.long)
    for i, (row, n) in enumerate(zip(completion_ids.tolist(), mask.sum(1).long().tolist())):
        tail: list[int] = []
        if prompt_ids is not None:
            real = prompt_ids[i][prompt_mask[i].bool()] if prompt_mask is not None else prompt_ids[i]
            tail = real.tolist()[-longest:]  # every token is at least one character
        base = len(tokenizer.decode(tail, skip_special_tokens=False))

        def has(m: int, tail=tail, row=row, base=base) -> bool:
            text = tokenizer.decode(tail + row[:m], skip_special_tokens=False)
            for stop in stop_strings:
                at = text.find(stop, max(0, base - len(stop) + 1))
                if at != -1 and at + len(stop) > base:
                    return True
            return False

        if not has(n):
            continue
        lo, hi = 1, n
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if has(mid) else (mid + 1, hi)
        ends[i] = lo
    return ends


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from parts such as (seed, rank, step): stable across runs and Python versions."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@torch.no_grad()
def generate_rollout(
    model,
    tokenizer,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompts: list[str],
    columns: dict[str, list],
    k: int,
    generation_config: GenerationConfig,
    seed: int,
    engine: GenerationEngine | None = None,
    grad_free=None,
) -> Rollout:
    """Sample ``k`` completions per prompt with the explicit config, from a seeded RNG stream.

    Args:
        model: the Hugging Face causal LM itself (not a strategy wrapper: DDP has no ``generate``).
        input_ids, attention_mask: ``[N, P]`` left-padded prompts.
        k: completions per prompt; the k copies of a prompt are contiguous (prompt-major).
        seed: the sampling seed; the global RNG is left as it was.
        engine: what samples (the module passes its own; default here :class:`HFGenerateEngine`).
        grad_free: the context the engine runs in (default ``torch.no_grad``; the module passes
            ``torch.inference_mode`` for an unsharded policy). Its ids are copied out of it: tensors
            made here enter the autograd graph later, which inference tensors cannot.
    """
    engine = engine or HFGenerateEngine()
    prompt_ids, prompt_mask = input_ids.repeat_interleave(k, dim=0), attention_mask.repeat_interleave(k, dim=0)
    with grad_free if grad_free is not None else torch.no_grad():
        completion_ids = engine.generate(model, tokenizer, prompt_ids, prompt_mask, generation_config, seed)
    return rollout_from_ids(tokenizer, input_ids, attention_mask, prompts, columns, k, generation_config,
                            completion_ids, type(engine).__name__)


def rollout_from_ids(tokenizer, input_ids: Tensor, attention_mask: Tensor, prompts: list[str],
                     columns: dict[str, list], k: int, generation_config: GenerationConfig, completion_ids,
                     engine_name: str) -> Rollout:
    """The rollout of what an engine returned (``[B, T']`` ids, or ``(ids, logprobs)``) for ``N`` prompts ``[N, P]``
    repeated ``k`` times: masks (first EOS, stop strings), truncation, texts."""
    prompt_ids, prompt_mask = input_ids.repeat_interleave(k, dim=0), attention_mask.repeat_interleave(k, dim=0)
    sampler_logp = None
    if isinstance(completion_ids, (tuple, list)):  # the engine reported log pi_s of what it sampled
        completion_ids, sampler_logp = completion_ids
    eos = eos_list(generation_config)
    mask = completion_mask(completion_ids, eos)
    # Ended by EOS: an EOS inside the mask (after a stop string, generate pads, and pad may be EOS).
    ended = (torch.isin(completion_ids, torch.tensor(eos, device=completion_ids.device)) & mask.bool()).any(1)
    if generation_config.stop_strings:
        ends = stop_string_ends(tokenizer, completion_ids, mask, list(generation_config.stop_strings),
                                prompt_ids, prompt_mask).to(mask.device)
        stopped = ends >= 0
        positions = torch.arange(mask.shape[1], device=mask.device)
        mask = torch.where(stopped[:, None], (positions[None] < ends[:, None]).float(), mask)
        ended = ended | stopped
    lengths = mask.sum(1).long().tolist()
    texts = tokenizer.batch_decode([row[:n] for row, n in zip(completion_ids.tolist(), lengths)],
                                   skip_special_tokens=True)
    return Rollout.sampled(k, input_ids, attention_mask, prompts, columns, completion_ids, mask, ~ended, texts,
                           sampler_logp, source=f"{engine_name}.generate")


@dataclass
class GenerationContext:
    """What a :class:`Sampler` samples with, the module's: the policy (the Hugging Face model itself), its tokenizer,
    the engine, the context the engine runs in (``torch.inference_mode`` or ``no_grad``) and the reduction over
    ranks (``reduce(tensor, op)``; a multi-turn rollout keeps ranks that generate in step turning together)."""

    model: torch.nn.Module
    tokenizer: Any
    engine: GenerationEngine
    grad_free: Any
    reduce: Callable[[Tensor, str], Tensor] | None = None


class Sampler(Protocol):
    """Step 1 behind ``RLOOModule.sample``, single-turn (:class:`CompletionSampler`) or multi-turn
    (:class:`~rloo_lightning.environments.sampler.EpisodeSampler`): the rollout of ``k`` samples for each prompt of
    ``batch`` (``input_ids``, ``attention_mask``, ``prompt``, ``columns``, optionally ``row_index``), seeded by
    ``seed``."""

    def sample(self, using: GenerationContext, batch: dict, k: int, generation_config: GenerationConfig,
               seed: int) -> Rollout: ...


class CompletionSampler:
    """The single-turn :class:`Sampler`: one completion per sample, from the engine (:func:`generate_rollout`)."""

    def sample(self, using: GenerationContext, batch: dict, k: int, generation_config: GenerationConfig,
               seed: int) -> Rollout:
        return generate_rollout(using.model, using.tokenizer, batch["input_ids"], batch["attention_mask"],
                                batch["prompt"], batch["columns"], k, generation_config, seed, engine=using.engine,
                                grad_free=using.grad_free)

    def submit(self, using: GenerationContext, batch: dict, k: int, generation_config: GenerationConfig,
               seed: int) -> tuple:
        """Start the sample of :meth:`sample` with the engine's ``submit`` (``rollout.lag``); the handle
        for :meth:`collect`."""
        prompt_ids = batch["input_ids"].repeat_interleave(k, dim=0)
        prompt_mask = batch["attention_mask"].repeat_interleave(k, dim=0)
        with using.grad_free:
            handle = using.engine.submit(using.model, using.tokenizer, prompt_ids, prompt_mask, generation_config,
                                         seed)
        return handle, batch, k, generation_config

    def collect(self, using: GenerationContext, pending: tuple) -> tuple[Rollout, float | None]:
        """The rollout of a :meth:`submit`, and the engine's seconds on it (None: not known)."""
        handle, batch, k, generation_config = pending
        ids = using.engine.collect(handle)
        rollout = rollout_from_ids(using.tokenizer, batch["input_ids"], batch["attention_mask"], batch["prompt"],
                                   batch["columns"], k, generation_config, ids, type(using.engine).__name__)
        return rollout, getattr(handle, "seconds", None)
