"""RLOOModule's options, one small typed group per concern.

On the command line and in YAML they nest under the module: ``--model.kl.beta 0.05``,
``model: {sampling: {k: 4}}``; in Python each group is a dataclass or a plain dict
(``RLOOModule("tiny:reverse", rewards={"funcs": [...]}, kl={"beta": 0.1})``). Every group checks
its own fields when it is built and names the option in its error. Defaults are the paper's
(Ahmadian et al. 2024); every other choice is an explicit option, documented with where it comes from.

This module defines the groups of the RL step (rewards, shaping, sampling, kl, advantage, update, correction,
dynamic_sampling) and ``GROUPS``; the groups of what runs around it (validation, predict, policy, environment, run)
are defined in :mod:`rloo_lightning.run_config`, how groups are checked, built and stored in
:mod:`rloo_lightning.options`. Every name of ``__all__`` imports from here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from rloo_lightning.algo.advantages import BaselineName
from rloo_lightning.algo.kl import KLEstimator, KLPlacement
from rloo_lightning.algo.losses import AggregationMode, ClipMode
from rloo_lightning.options import (
    Options,
    as_group,
    check_choices,
    check_learning_rate,
    check_options,
    check_range,
    parse_on_error,
    set_field,
    to_primitives,
)
from rloo_lightning.run_config import EnvironmentArgs, PolicyArgs, PredictArgs, RunArgs, ValidationArgs

__all__ = [
    "RewardArgs",
    "ShapingArgs",
    "SamplingArgs",
    "KLArgs",
    "AdvantageArgs",
    "UpdateArgs",
    "CorrectionArgs",
    "RolloutArgs",
    "DynamicSamplingArgs",
    "ValidationArgs",
    "PolicyArgs",
    "PredictArgs",
    "EnvironmentArgs",
    "RunArgs",
    "GROUPS",
    "Options",
    "check_options",
    "check_learning_rate",
    "as_group",
    "to_primitives",
    "parse_on_error",
]


@dataclass(frozen=True)
class RewardArgs:
    """What scores a completion.

    Args:
        funcs: reward functions: import paths ``"pkg.module.fn"`` or ``{class_path: pkg.module.Class,
            init_args: {...}}`` (see :mod:`rloo_lightning.rewards`); importing runs their code. Required by
            ``fit``, ``validate`` and ``test``; ``predict`` runs without (it then writes no scores).
        weights: one weight per reward function (default: all 1); the task reward r is the weighted sum.
        timeout: seconds one reward call may run; it then runs in a worker process that is killed on
            timeout, and the call is scored by ``on_error``. None = no limit.
        workers: worker processes that run the reward functions in parallel (0 = in this process).
        on_error: what a reward exception or timeout scores: ``raise``, ``none`` (a missing reward, left
            out of the baseline) or a number; a warning names the function and the prompt.
        chunk_size: completions per worker call (default: the batch split over the workers).
        stop_after_missing_steps: stop the run with an error naming the source after this many training steps
            in a row without a single reward (``train/reward_missing`` = 1: every value None, failed or timed out
            under ``on_error: none``, or every episode failed); 0 = train on regardless.
    """

    prefix: ClassVar[str] = "rewards"
    funcs: list[str | dict] = field(default_factory=list)
    weights: list[float] | None = None
    timeout: float | None = None
    workers: int = 0
    on_error: str | float = "raise"
    chunk_size: int | None = None
    stop_after_missing_steps: int = 10

    def __post_init__(self) -> None:
        if self.stop_after_missing_steps < 0:
            raise ValueError(f"rewards.stop_after_missing_steps must be >= 0 (0 = never stop), got "
                             f"{self.stop_after_missing_steps}")
        set_field(self, "funcs", list(self.funcs))
        if self.weights is not None:
            set_field(self, "weights", [float(w) for w in self.weights])


@dataclass(frozen=True)
class ShapingArgs:
    """Training-reward shaping before the KL term and the baseline; all off by default (validation is unshaped).

    Args:
        missing_eos_penalty: subtracted from the reward of a completion with no EOS (TRL <= 0.21); 0 = off.
        overlong_buffer: DAPO's soft overlong punishment (Yu et al. 2025): a completion longer than
            ``sampling.max_new_tokens - overlong_buffer`` tokens loses up to ``overlong_factor``, linearly; 0 = off.
        overlong_factor: the largest overlong penalty.
        reward_clip: ``[low, high]`` clip of the task reward after the penalties (TRL ``reward_clip_range``,
            OpenRLHF); None = off.
        mask_truncated_completions: completions without EOS leave the loss and their group's baseline
            (TRL ``mask_truncated_completions``, DAPO's overlong filtering).
    """

    prefix: ClassVar[str] = "shaping"
    missing_eos_penalty: float = 0.0
    overlong_buffer: int = 0
    overlong_factor: float = 1.0
    reward_clip: tuple[float, float] | None = None
    mask_truncated_completions: bool = False

    def __post_init__(self) -> None:
        if self.overlong_buffer < 0:
            raise ValueError(f"shaping.overlong_buffer must be >= 0, got {self.overlong_buffer}")
        set_field(self, "reward_clip", check_range("shaping.reward_clip", self.reward_clip))


@dataclass(frozen=True)
class SamplingArgs:
    """How the k completions of each prompt are sampled (step 1).

    Args:
        k: completions per prompt (>= 2 for the leave-one-out baseline). The paper uses 2 and 4.
        max_new_tokens: completion budget; a completion without EOS by then is truncated.
        temperature: sampling temperature; the log-probs use the same one, so that the gradient is of
            the distribution that was sampled.
        top_k: 0 = off. Anything else samples from a truncated distribution that is *not* pi_theta and
            biases the estimator; for ablations only.
        top_p: 1.0 = off. Same caveat as ``top_k``.
        repetition_penalty: 1.0 = off. Same caveat as ``top_k``.
        seed: base of the sampling seeds; each step samples with a seed derived from (seed, rank,
            global step), so a resumed run samples what an uninterrupted one would.
        eos_token_ids: token ids that end a completion (default: the tokenizer's EOS plus those of the
            model's shipped generation config, e.g. a chat model's end-of-turn token).
        stop_strings: strings that end a completion; the completion mask ends with the token that
            completes the first one.
    """

    prefix: ClassVar[str] = "sampling"
    k: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0
    eos_token_ids: list[int] | None = None
    stop_strings: list[str] | None = None

    def __post_init__(self) -> None:
        if self.k < 2:
            raise ValueError(f"sampling.k must be >= 2 (the leave-one-out baseline needs another sample), "
                             f"got {self.k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ValueError(f"sampling.temperature must be > 0, got {self.temperature}")
        if self.stop_strings is not None and (not self.stop_strings or not all(self.stop_strings)):
            raise ValueError(f"sampling.stop_strings must be non-empty strings, got {self.stop_strings!r}")


@dataclass(frozen=True)
class KLArgs:
    """The KL term to the reference policy (steps 3-4).

    Args:
        beta: KL coefficient. ``R = r - beta * sum_t (logp_t - ref_logp_t)``, detached, before the
            baseline (paper Sec. 2.3). ``beta = 0`` loads no reference model.
        estimator: per-token KL estimate: ``k1`` = ``logp - ref_logp`` (the paper, TRL), ``k2`` =
            ``(logp - ref_logp)^2 / 2``, ``k3`` = ``exp(ref_logp - logp) - (ref_logp - logp) - 1``
            (Schulman 2020; GRPO, verl ``low_var_kl``). Only k1 keeps ``reward`` placement unbiased.
        placement: where ``beta * KL`` enters. ``reward``: the sequence sum subtracted from the reward
            before the baseline (the paper, TRL; unbiased with k1). ``token_reward`` (OpenRLHF): the
            baseline on the task reward alone, then ``-beta*kl_t`` at every token and the advantage at
            the last one, summed to go into token advantages. ``loss`` (GRPO, verl ``use_kl_loss``):
            ``beta * KL`` with its gradient added to the loss, aggregated as the loss is.
        clamp: clamp each per-token KL estimate to ``[-c, c]`` (OpenRLHF: 10); None = off.
        ref_sync_steps: every this many steps mix the policy into the reference (TR-DPO, TRL
            ``sync_ref_model``): ``ref = alpha*policy + (1-alpha)*ref``. 0 = off (the paper: the
            reference is the initial policy). The reference is then checkpointed too.
        ref_sync_alpha: the ``alpha`` of ``ref_sync_steps`` (TRL ``ref_model_mixup_alpha``: 0.6).
    """

    prefix: ClassVar[str] = "kl"
    beta: float = 0.05
    estimator: KLEstimator = "k1"
    placement: KLPlacement = "reward"
    clamp: float | None = None
    ref_sync_steps: int = 0
    ref_sync_alpha: float = 0.6

    def __post_init__(self) -> None:
        if self.beta < 0:
            raise ValueError(f"kl.beta must be >= 0, got {self.beta}")
        check_choices(self)
        if self.clamp is not None and self.clamp <= 0:
            raise ValueError(f"kl.clamp must be > 0 or None, got {self.clamp}")
        if self.ref_sync_steps < 0 or not 0 < self.ref_sync_alpha <= 1:
            raise ValueError(f"kl.ref_sync_steps must be >= 0 and kl.ref_sync_alpha in (0, 1], got "
                             f"{self.ref_sync_steps}, {self.ref_sync_alpha}")


@dataclass(frozen=True)
class AdvantageArgs:
    """The baseline and what is done to the advantages (step 6).

    Args:
        baseline: ``leave_one_out`` (the paper: mean of the other k-1 samples of the prompt); ``none``
            (vanilla REINFORCE); ``moving_average`` (an exponential moving average of earlier batches'
            mean reward, ``baseline_decay``; the paper's "REINFORCE w/ baseline"); ``group_mean_std``
            (GRPO: ``(R - group mean) / (group std + 1e-4)``, biased); ``group_mean`` (Dr.GRPO: the
            self-inclusive mean, = ``(k-1)/k`` x leave-one-out).
        baseline_decay: weight of the past in the ``moving_average`` baseline.
        normalize_rewards: standardise the rewards over the global batch before the baseline
            (``(R - mean) / (std + 1e-4)``; TRL <= 0.21 / OpenRLHF ``normalize_reward`` style).
        whiten: standardise the advantages over the global batch (TRL ``normalize_advantages``).
            A rescale per batch: changes the step size, biased.
        clip: ``[low, high]`` clip of the advantages after the baseline (OpenRLHF clips at +-10); None = off.
    """

    prefix: ClassVar[str] = "advantage"
    baseline: BaselineName = "leave_one_out"
    baseline_decay: float = 0.9
    normalize_rewards: bool = False
    whiten: bool = False
    clip: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        check_choices(self)
        if not 0 <= self.baseline_decay < 1:
            raise ValueError(f"advantage.baseline_decay must be in [0, 1), got {self.baseline_decay}")
        set_field(self, "clip", check_range("advantage.clip", self.clip))


@dataclass(frozen=True)
class UpdateArgs:
    """The loss and the optimizer step (step 7).

    Args:
        loss_aggregation: how per-token terms become the loss (verl's ``loss_agg_mode`` in brackets):
            ``seq_sum`` (the paper, TRL; verl ``seq-mean-token-sum``): sum over tokens, mean over
            sequences; ``token_mean`` (verl default, OpenRLHF): mean over all tokens of the batch;
            ``seq_mean_token_mean`` (original GRPO): mean over sequences of each one's token mean;
            ``seq_mean_token_sum_norm`` (Dr.GRPO): token sum / (sequences x ``loss_norm_constant``).
            All but ``seq_sum`` weigh sequences by length and bias the sequence-level gradient; the
            denominators are global over ranks.
        loss_norm_constant: the constant of ``seq_mean_token_sum_norm`` (default: ``sampling.max_new_tokens``).
        updates_per_rollout: optimizer steps per rollout (TRL ``num_iterations``, verl ``ppo_epochs``).
            1 (default) is on-policy: no importance ratio, no clip. With n > 1 the rollout is stored
            and the next n-1 steps update on it again with a clipped importance-weighted surrogate
            (``clip_mode``); PromptDataModule repeats each batch n times (the CLI links this option),
            and a checkpoint taken mid-way holds the rollout.
        clip_mode: ``sequence`` (TRL: one ratio ``exp(sum_t logp - old_logp)`` per completion) or
            ``token`` (verl / OpenRLHF: one ratio per token, aggregated by ``loss_aggregation``).
        clip_eps_low: the clip range is ``[1 - clip_eps_low, 1 + clip_eps_high]``.
        clip_eps_high: see ``clip_eps_low``.
        dual_clip: verl's dual clip constant ``c > 1`` for negative advantages (``clip_mode: token``).
        micro_batch_size: completions per forward/backward pass of the update (None = the whole
            rollout at once). The rollout is still sampled whole and there is still one optimizer step
            per rollout: the same update as unsplit, with the activation memory of one micro-batch.
            Lightning's ``accumulate_grad_batches=n`` is different and composes with it: n rollouts
            (each sampled from the same, not yet updated policy, so still on-policy) per optimizer step.
            A multiple of ``sampling.k`` keeps every micro-batch eligible for ``share_prompt``.
        share_prompt: run each prompt once per group in the policy and reference forwards, its KV cache
            serving the group's k completions (``forward.shared_prompt_logits``): the same log-probs and
            gradient up to float rounding, for ``(k-1)/k`` less of the prompt positions' compute, at the cost
            of a second forward call. ``auto`` (default) shares when the compute saved is worth more than that
            call, ``parameters x (k-1) x distinct prompt tokens >= forward.SHARE_MIN_WORK`` (SmolLM2-135M at
            4 prompts x k = 4: yes, 33 % off the policy's forward + backward; the quickstart's tiny model: no,
            where sharing costs 4 %; ``benchmarks/generation.md``); ``always``; ``never``. Used only where it applies
            (a micro-batch of whole groups, a Hugging Face model that returns its cache, no activation
            checkpointing in training); elsewhere the forward runs each sequence whole.
        warmup_ratio: fraction of the total steps for the linear warm-up of the default constant-rate
            schedule (the paper: 3%). Ignored when ``lr_scheduler`` is given.
        on_nonfinite: what a NaN/inf loss or gradient does: ``stop`` raises ``NonFiniteError`` (naming the
            step and the rollout statistics) before the optimizer step, so no poisoned weights reach a
            checkpoint; ``skip`` drops that update and counts it in ``train/skipped_steps``.
    """

    prefix: ClassVar[str] = "update"
    loss_aggregation: AggregationMode = "seq_sum"
    loss_norm_constant: float | None = None
    updates_per_rollout: int = 1
    clip_mode: ClipMode = "sequence"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float | None = None
    micro_batch_size: int | None = None
    share_prompt: Literal["auto", "always", "never"] = "auto"
    warmup_ratio: float = 0.03
    on_nonfinite: Literal["stop", "skip"] = "stop"

    def __post_init__(self) -> None:
        check_choices(self)
        if self.loss_norm_constant is not None and self.loss_norm_constant <= 0:
            raise ValueError(f"update.loss_norm_constant must be > 0 or None, got {self.loss_norm_constant}")
        if self.updates_per_rollout < 1:
            raise ValueError(f"update.updates_per_rollout must be >= 1, got {self.updates_per_rollout}")
        if self.clip_eps_low < 0 or self.clip_eps_high < 0 or self.clip_eps_low >= 1:
            raise ValueError(f"update.clip_eps_low must be in [0, 1) and update.clip_eps_high >= 0, got "
                             f"{self.clip_eps_low}, {self.clip_eps_high}")
        if self.dual_clip is not None and (self.dual_clip <= 1 or self.clip_mode != "token"):
            raise ValueError(f"update.dual_clip must be > 1 and needs update.clip_mode='token', got "
                             f"dual_clip={self.dual_clip}, clip_mode={self.clip_mode!r}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"update.micro_batch_size must be >= 1 (sequences per forward/backward) or None, "
                             f"got {self.micro_batch_size}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"update.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")

    def warmup_steps(self, total_steps: int) -> int:
        """The default schedule's warm-up for a run of ``total_steps`` optimizer steps: ``warmup_ratio`` of them,
        rounded down (``update.warmup_constant_schedule``; the first step runs at 1 / warm-up of the rate)."""
        return int(self.warmup_ratio * total_steps)


@dataclass(frozen=True)
class CorrectionArgs:
    """Importance correction for a sampler that is not exactly pi_theta (an engine that reports its log-probs).

    Off by default with the engines that sample from pi_theta itself (as the paper does). When the engine reports
    log pi_s of each sampled token, ``train/mismatch/*`` is logged whatever these options say. Each option's formula,
    source, bias and variance: ``docs/correction.md``. Ratios r_t = pi_theta(y_t|.) / pi_s(y_t|.) over the policy's
    tokens only (an episode's environment tokens are off the completion mask).

    Args:
        level: ``auto`` (the default): the engine's own choice, its ``default_correction`` (``none`` for the
            engines of :mod:`rloo_lightning.engines` but vLLM; ``token`` for
            :class:`~rloo_lightning.engines.vllm.VLLMEngine`; ``token`` with any engine when
            ``rollout.lag >= 1``); ``none``; ``sequence``: one detached weight
            w_i = pi_theta(y_i) / pi_s(y_i) = prod_t r_t multiplies
            (R_i - b_i) grad log pi_theta(y_i): unbiased when untruncated (``cap: null``), but its variance
            grows fast with the mismatch and the length; ``token``: w_it = r_t
            per token: far lower variance, biased (it reweights each token but not the prefix it follows);
            ``geometric``: one weight g_i = exp(mean_t log r_t), the geometric mean of the token ratios
            (length-invariant, biased: not an importance weight); ``topr``: TOPR (Le Roux et al. 2025): weight 1
            where R_i - b_i >= 0, min(w_i, 1) where it is negative (mode and cap do not apply).
        mode: ``truncate``: min(w, cap) (TIS): bounded variance, biased toward under-weighting the samples
            pi_theta favours; ``mask``: w inside [lower, cap], 0 outside (the sample or token leaves the
            loss; MIS): removes outliers, biased by what it drops; ``reject``: 1 inside [lower, cap], 0 outside (a
            filter without weights: ``level: geometric, mode: reject`` is Geo-Mask).
        cap: the upper bound of the weight (TIS's C; verl uses 2); null: none.
        lower: ``mask`` and ``reject`` modes' lower bound (default 1 / cap).
        reject: a sequence-level rejection on top of the weights: a sample whose ``sequence`` (prod_t r_t) or
            ``geometric`` (exp(mean_t log r_t)) ratio lies outside [reject_lower, reject_upper] gets weight 0
            (verl's rollout rejection sampling; with ``level: token``: token TIS with the sequence dropped, NeMo-RL's
            seq-mask-tis); ``none`` (the default).
        reject_lower: the rejection's lower bound (default 1 / reject_upper).
        reject_upper: the rejection's upper bound; null: none.
    """

    prefix: ClassVar[str] = "correction"
    level: Literal["auto", "none", "sequence", "token", "geometric", "topr"] = "auto"
    mode: Literal["truncate", "mask", "reject"] = "truncate"
    cap: float | None = 2.0
    lower: float | None = None
    reject: Literal["none", "sequence", "geometric"] = "none"
    reject_lower: float | None = None
    reject_upper: float | None = 2.0

    def __post_init__(self) -> None:
        check_choices(self)
        for name, upper, lower in (("", self.cap, self.lower), ("reject_", self.reject_upper, self.reject_lower)):
            bound = "cap" if not name else "reject_upper"
            if upper is not None and upper <= 0:
                raise ValueError(f"correction.{bound} must be > 0 or null, got {upper}")
            if lower is not None and not (0 <= lower < (upper if upper is not None else float("inf"))):
                raise ValueError(f"correction.{name}lower must be in [0, correction.{bound}), got {lower}")
        if self.level == "topr" and self.mode != "truncate":
            raise ValueError(f"correction.level 'topr' truncates at 1 (the paper); correction.mode must be "
                             f"'truncate', got {self.mode!r}")
        if self.reject != "none" and self.level in ("auto", "none"):
            raise ValueError(f"correction.reject filters a correction's weights: set correction.level (not "
                             f"{self.level!r}); a filter alone is correction.mode 'reject' (Geo-Mask: level geometric)")

    def for_engine(self, engine, stale: bool = False) -> CorrectionArgs:
        """These options with ``level: auto`` replaced by ``engine``'s ``default_correction``; when it has none,
        ``token`` for stale rollouts (``rollout.lag >= 1``: the sampler is an older pi_theta) and ``none``
        otherwise."""
        if self.level != "auto":
            return self
        return dataclasses.replace(self, level=getattr(engine, "default_correction", None)
                                   or ("token" if stale else "none"))


@dataclass(frozen=True)
class RolloutArgs:
    """When each step's rollout is sampled (step 1): by the step itself (the paper), or ahead of it from older
    weights, while the trainer computes the steps before (asynchronous RLOO; ``docs/async.md``).

    Args:
        lag: the lag K, in optimizer steps. 0 (the default): step g samples from the weights it
            updates (on-policy). K >= 1: step g's rollout is sampled from the weights of step g - K exactly (the
            first K steps from the initial weights), submitted to the engine at step g - K and generated while
            steps g - K .. g - 1 train; a fixed lag, not "at most K" (TRL's ``max_staleness``, prime-rl's
            ``max_off_policy_steps``), so that a run and its resume sample the same tokens. The stale samples are
            corrected against pi_theta at the update: ``correction.level: auto`` becomes token-level truncated
            weights (cap 2). With ``update.updates_per_rollout`` U the last update on a rollout is K + U - 1 steps
            after its weights. Needs a data module with ``train_batch(position)`` (``PromptDataModule``), and an
            engine that reports its log-probs (the default engine then turns them on).
    """

    prefix: ClassVar[str] = "rollout"
    lag: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.lag, bool) or not isinstance(self.lag, int) or self.lag < 0:
            raise ValueError(f"rollout.lag must be an integer >= 0, got {self.lag!r}")


@dataclass(frozen=True)
class DynamicSamplingArgs:
    """DAPO's dynamic sampling (Yu et al. 2025; OpenRLHF ``dynamic_filtering``, verl ``filter_groups``).

    A prompt group whose task rewards are all equal has zero advantages and adds no gradient; with
    ``enabled``, more prompts are drawn (the data module's ``sample_batch``) until the batch has
    ``batch_size`` groups whose rewards differ. Every rank runs the same number of rounds; extra
    prompts come from a generator seeded by (seed, rank, step, round), so a resume draws the same
    ones. Off by default: it changes which prompts the gradient averages over.

    Args:
        enabled: turn dynamic sampling on.
        max_rounds: extra generation rounds per step at most; when used up, a warning says so and the
            batch is topped up with uninformative groups.
        atol: a group whose reward spread is ``<= atol`` counts as uninformative.
    """

    prefix: ClassVar[str] = "dynamic_sampling"
    enabled: bool = False
    max_rounds: int = 4
    atol: float = 0.0

    def __post_init__(self) -> None:
        if self.max_rounds < 1 or self.atol < 0:
            raise ValueError(f"dynamic_sampling.max_rounds must be >= 1 and dynamic_sampling.atol >= 0, got "
                             f"{self.max_rounds}, {self.atol}")


GROUPS: dict[str, type] = {
    "rewards": RewardArgs,
    "sampling": SamplingArgs,
    "shaping": ShapingArgs,
    "kl": KLArgs,
    "advantage": AdvantageArgs,
    "update": UpdateArgs,
    "correction": CorrectionArgs,
    "rollout": RolloutArgs,
    "dynamic_sampling": DynamicSamplingArgs,
    "validation": ValidationArgs,
    "policy": PolicyArgs,
    "predict": PredictArgs,
    "environment": EnvironmentArgs,
    "run": RunArgs,
}

