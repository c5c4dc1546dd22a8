"""RLOOModule's options, one small typed group per concern.

On the command line and in YAML they nest under the module: ``--model.kl.beta 0.05``,
``model: {sampling: {k: 4}}``; in Python each group is a dataclass or a plain dict
(``RLOOModule("tiny:reverse", rewards={"funcs": [...]}, kl={"beta": 0.1})``). Every group checks
its own fields when it is built and names the option in its error. Defaults are the paper's
(Ahmadian et al. 2024); every other choice is an explicit option, documented with where it comes from.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from rloo_lightning.advantages import BaselineName
from rloo_lightning.kl import KLEstimator, KLPlacement
from rloo_lightning.losses import AggregationMode, ClipMode

__all__ = [
    "RewardArgs",
    "ShapingArgs",
    "SamplingArgs",
    "KLArgs",
    "AdvantageArgs",
    "UpdateArgs",
    "CorrectionArgs",
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


@functools.cache
def _choices(cls: type) -> dict[str, tuple]:
    """The fields of a group typed ``Literal[...]`` (optionally ``| None``) and their allowed values.

    The type is the one spelling of an option's names: those of a registry (``advantages.BASELINES``,
    ``kl.KL_ESTIMATORS``, ``losses.AGGREGATION_MODES``) are built from its keys."""
    hints = typing.get_type_hints(cls)
    found = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        options = [hint] + list(typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType)
                                else [])
        literal = [a for a in options if typing.get_origin(a) is Literal]
        if literal:
            found[f.name] = typing.get_args(literal[0]) + ((None,) if type(None) in typing.get_args(hint) else ())
    return found


def _check_choices(group: Any) -> None:
    """Every ``Literal`` field of ``group`` holds one of its values; the error names the option."""
    for name, allowed in _choices(type(group)).items():
        value = getattr(group, name)
        if value not in allowed:
            shown = ", ".join(map(repr, [a for a in allowed if a is not None]))
            raise ValueError(f"{group.prefix}.{name} must be one of {shown}; got {value!r}")


def _range(option: str, value: Any) -> tuple[float, float] | None:
    """A ``[low, high]`` pair with low < high (as a tuple), or None."""
    if value is None:
        return None
    if len(value) != 2 or not value[0] < value[1]:
        raise ValueError(f"{option} must be [low, high] with low < high, got {value!r}")
    return (float(value[0]), float(value[1]))


def parse_on_error(option: str, value: str | float | None) -> tuple[str, float | None]:
    """An ``on_error`` option: ``("raise", None)``, ``("value", None)`` (a missing reward) or ``("value", x)``."""
    if value is None:
        return "value", None
    if isinstance(value, bool):
        raise ValueError(f"{option} must be 'raise', 'none' or a float, got {value!r}")
    if isinstance(value, str) and value.strip().lower() == "raise":
        return "raise", None
    if isinstance(value, str) and value.strip().lower() in ("none", "null", "nan", "missing"):
        return "value", None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{option} must be 'raise', 'none' (missing reward) or a float, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{option} must be finite (use 'none' for a missing reward), got {value!r}")
    return "value", number


def _set(group: Any, name: str, value: Any) -> None:
    """Normalise a field of a frozen group in its ``__post_init__`` (e.g. a YAML list to a tuple)."""
    object.__setattr__(group, name, value)


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
        _set(self, "funcs", list(self.funcs))
        if self.weights is not None:
            _set(self, "weights", [float(w) for w in self.weights])


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
        _set(self, "reward_clip", _range("shaping.reward_clip", self.reward_clip))


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
        _check_choices(self)
        if self.clamp is not None and self.clamp <= 0:
            raise ValueError(f"kl.clamp must be > 0 or None, got {self.clamp}")
        if self.ref_sync_steps < 0 or not 0 < self.ref_sync_alpha <= 1:
            raise ValueError(f"kl.ref_sync_steps must be >= 0 and kl.ref_sync_alpha in (0, 1], got "
                             f"{self.ref_sync_steps}, {self.ref_sync_alpha}")


@dataclass(frozen=True)
class AdvantageArgs:
    """The baseline and what is done to the advantages (step 5).

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
        _check_choices(self)
        if not 0 <= self.baseline_decay < 1:
            raise ValueError(f"advantage.baseline_decay must be in [0, 1), got {self.baseline_decay}")
        _set(self, "clip", _range("advantage.clip", self.clip))


@dataclass(frozen=True)
class UpdateArgs:
    """The loss and the optimizer step (step 6).

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
            serving the group's k completions (``logprobs.shared_prompt_logits``): the same log-probs and
            gradient up to float rounding, for ``(k-1)/k`` less of the prompt positions' compute, at the cost
            of a second forward call. ``auto`` (default) shares when the compute saved is worth more than that
            call, ``parameters x (k-1) x distinct prompt tokens >= logprobs.SHARE_MIN_WORK`` (SmolLM2-135M at
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
        _check_choices(self)
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
        rounded down (``module.warmup_constant_schedule``; the first step runs at 1 / warm-up of the rate)."""
        return int(self.warmup_ratio * total_steps)


@dataclass(frozen=True)
class CorrectionArgs:
    """Importance correction for a sampler that is not exactly pi_theta (an engine that reports its log-probs).

    Off by default with the engines that sample from pi_theta itself (as the paper does). When the engine reports
    log pi_s of each sampled token, ``train/mismatch/*`` is logged whatever these options say.

    Args:
        level: ``auto`` (the default): the engine's own choice, its ``default_correction`` (``none`` for the
            engines of :mod:`rloo_lightning.engines` and :mod:`rloo_lightning.decode`; ``token`` for
            :class:`~rloo_lightning.vllm_engine.VLLMEngine`); ``none``; ``sequence``: one detached weight
            w_i = pi_theta(y_i) / pi_s(y_i) multiplies
            (R_i - b_i) grad log pi_theta(y_i): unbiased when untruncated (``cap: null``), but its variance
            grows fast with the mismatch and the length; ``token``: w_it = pi_theta(y_it|.) / pi_s(y_it|.)
            per token: far lower variance, biased (it reweights each token but not the prefix it follows).
        mode: ``truncate``: min(w, cap) (TIS): bounded variance, biased toward under-weighting the samples
            pi_theta favours; ``mask``: w inside [lower, cap], 0 outside (the sample or token leaves the
            loss): removes outliers, biased by what it drops.
        cap: the upper bound of the weight (TIS's C; verl uses 2); null: none.
        lower: ``mask`` mode's lower bound (default 1 / cap).
    """

    prefix: ClassVar[str] = "correction"
    level: Literal["auto", "none", "sequence", "token"] = "auto"
    mode: Literal["truncate", "mask"] = "truncate"
    cap: float | None = 2.0
    lower: float | None = None

    def __post_init__(self) -> None:
        _check_choices(self)
        if self.cap is not None and self.cap <= 0:
            raise ValueError(f"correction.cap must be > 0 or null, got {self.cap}")
        if self.lower is not None and not (0 <= self.lower < (self.cap if self.cap is not None else float("inf"))):
            raise ValueError(f"correction.lower must be in [0, correction.cap), got {self.lower}")

    def for_engine(self, engine) -> CorrectionArgs:
        """These options with ``level: auto`` replaced by ``engine``'s ``default_correction`` (``none`` if it has
        none)."""
        if self.level != "auto":
            return self
        return dataclasses.replace(self, level=getattr(engine, "default_correction", None) or "none")


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


@dataclass(frozen=True)
class ValidationArgs:
    """What a validation pass measures (``val/*``).

    Args:
        at_start: run a validation pass before the first update and log it at step 0 (Lightning's
            sanity check does not log).
        greedy: also evaluate greedy decoding: ``val/reward_greedy`` and ``val/accuracy_greedy``.
        num_samples: completions sampled per validation prompt (training sampler); ``val/reward`` is their mean.
        pass_k: log ``val/pass@<k>`` for each k (each <= ``num_samples``), with the unbiased estimator of
            Chen et al. 2021.
        success_threshold: a completion whose reward is >= this counts as a success (accuracy, pass@k).
    """

    prefix: ClassVar[str] = "validation"
    at_start: bool = True
    greedy: bool = True
    num_samples: int = 1
    pass_k: list[int] | None = None
    success_threshold: float = 1.0

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"validation.num_samples must be >= 1, got {self.num_samples}")
        for pk in self.pass_k or []:
            if not 1 <= pk <= self.num_samples:
                raise ValueError(f"validation.pass_k={self.pass_k}: each k must be in [1, validation.num_samples="
                                 f"{self.num_samples}]")


@dataclass(frozen=True)
class PredictArgs:
    """What ``rloo-lightning predict`` writes: completions for ``data.predict_file``, one JSON line each.

    Args:
        num_samples: completions per prompt, sampled by the training sampler (``sampling``), seeded by
            (``sampling.seed``, rank, batch).
        greedy: greedy decoding instead (then one completion per prompt).
        output_file: the JSONL file written (default ``<log dir>/predictions.jsonl``; with several
            processes each rank writes ``<name>.rank<N>.jsonl``). An existing file is not overwritten.
    """

    prefix: ClassVar[str] = "predict"
    num_samples: int = 1
    greedy: bool = False
    output_file: str | None = None

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"predict.num_samples must be >= 1, got {self.num_samples}")
        if self.greedy and self.num_samples != 1:
            raise ValueError(f"predict.greedy gives one completion per prompt; predict.num_samples="
                             f"{self.num_samples} must be 1")


@dataclass(frozen=True)
class PolicyArgs:
    """How the policy is loaded and trained.

    Args:
        gguf_file: a GGUF file inside ``model_name_or_path`` (dequantized on load; needs ``gguf``).
        trust_remote_code: executes code shipped with the model; off unless set.
        gradient_checkpointing: recompute activations in the backward of the update (less memory, one
            more forward). Generation runs in eval mode, where transformers keeps the KV cache.
        disable_dropout: turn every dropout off in the policy (and reference), so that the log-probs of
            the update are those of the sampler.
        lora: train a LoRA adapter (``peft``) instead of the whole policy: the keyword arguments of
            ``peft.LoraConfig``, e.g. ``{r: 16, lora_alpha: 32, target_modules: all-linear}``
            (``task_type`` is set here). The reference is then the base model with the adapter
            disabled; checkpoints hold the adapter (and optimizer state) only. None = full training.
        lora_export: what ``save_pretrained`` (and ``HFExport``) writes for a LoRA policy: ``merged``
            (the base with the adapter merged in) or ``adapter`` (the adapter alone).
    """

    prefix: ClassVar[str] = "policy"
    gguf_file: str | None = None
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    disable_dropout: bool = True
    lora: dict | None = None
    lora_export: Literal["merged", "adapter"] = "merged"

    def __post_init__(self) -> None:
        _check_choices(self)
        if self.lora is not None and (not isinstance(self.lora, dict) or not self.lora):
            raise ValueError(f"policy.lora must be a non-empty mapping of peft.LoraConfig arguments, got {self.lora!r}")
        if self.lora is not None and "task_type" in self.lora:
            raise ValueError("policy.lora: task_type is set by RLOOModule (CAUSAL_LM); remove it")


@dataclass(frozen=True)
class EnvironmentArgs:
    """Multi-turn episodes: the policy acts in an environment over several turns (see
    :mod:`rloo_lightning.environments` and ``docs/multiturn.md``). Off by default: one completion per sample,
    the paper's setting.

    Args:
        class_path: the :class:`~rloo_lightning.environments.Environment` subclass, an import path
            ``pkg.module.Class`` (importing runs its code). One instance is made per episode, with ``init_args``.
            None = single-turn.
        init_args: keyword arguments of the class.
        max_turns: the most policy turns of an episode. An episode still going after them ends, flagged
            truncated; the environment still scores it.
        max_context_tokens: the most tokens of prompt plus transcript. An episode whose next turn (of up to
            ``sampling.max_new_tokens``) could pass it ends before that turn, cut by ``context``. None = the
            model's context (its config's ``max_position_embeddings``; no limit for a model that states none).
        max_reply_tokens: the most tokens of one environment or tool message's content; a longer one is cut to
            its first ``max_reply_tokens`` tokens (``train/replies_cut`` counts them per episode).
        timeout: seconds one environment call (``reset``, ``step``, ``final_reward``, ``metrics``, ``close``) may
            run. A call past it is abandoned (it runs on in a background thread; the object is never called
            again) and its episode is scored by ``on_error``. Hung calls do not add up: with ``on_error: raise``
            the first timeout ends the step; otherwise, once a call has timed out, the rollout waits at most one
            more ``timeout`` on its calls in all, then abandons those still running and fails those not started
            (``not started``). At most ``max(16, 4 * workers)`` abandoned calls run on at once; past that a call
            fails without starting. None = no limit: a call that hangs hangs the run.
        workers: how many episodes' calls run at once, in threads (a turn's ``step`` calls, the resets, ...).
            Transcripts are the same for any number. Raise it for environments that wait (sandboxes, services);
            their state must then be their own (not shared between objects).
        on_error: what an environment failure does (an exception, a call past ``timeout``, or a malformed
            answer: an observation that is not a Message, a reward that is not a finite number): ``raise`` (an
            error naming the environment, the call, the prompt row, the sample and the turn), ``none`` (the
            episode ends with a missing reward: it leaves its group's baseline and the loss) or a number (the
            episode ends with that reward). One warning line per step counts the failures; each is logged in full
            to the ``rloo_lightning`` logger.
        reply_format: for a tokenizer without a chat template, the text appended after the policy's turn for
            an environment message: a ``str.format`` pattern with ``{content}`` (and optionally ``{role}``).
            With a chat template the template's own markers are used.

    Each episode carries ``cut_by``: ``none``, ``max_new_tokens`` (a turn, the last included, ended without an
    end-of-turn token, also when the environment ended the episode on it), ``max_turns`` or ``context``; each
    kind's share is logged as ``train/cut/<kind>``. Every cut episode is ``truncated``:
    ``shaping.mask_truncated_completions`` leaves it out of the loss and of its group's baseline. Only
    ``max_new_tokens`` counts as a missing EOS (``shaping.missing_eos_penalty``, ``train/clipped_ratio``).
    """

    prefix: ClassVar[str] = "environment"
    class_path: str | None = None
    init_args: dict = field(default_factory=dict)
    max_turns: int = 4
    max_context_tokens: int | None = None
    max_reply_tokens: int = 1024
    timeout: float | None = 60.0
    workers: int = 1
    on_error: str | float = "raise"
    reply_format: str = "\n{role}: {content}\nassistant: "

    def __post_init__(self) -> None:
        if self.class_path is not None and (not isinstance(self.class_path, str) or "." not in self.class_path):
            raise ValueError(f"environment.class_path must be an import path 'package.module.Class', got "
                             f"{self.class_path!r}")
        if not isinstance(self.init_args, dict):
            raise ValueError(f"environment.init_args must be a mapping, got {self.init_args!r}")
        if self.max_turns < 1:
            raise ValueError(f"environment.max_turns must be >= 1, got {self.max_turns}")
        if self.max_context_tokens is not None and self.max_context_tokens < 1:
            raise ValueError(f"environment.max_context_tokens must be >= 1 or null, got {self.max_context_tokens}")
        if isinstance(self.max_reply_tokens, bool) or not isinstance(self.max_reply_tokens, int) \
                or self.max_reply_tokens < 1:
            raise ValueError(f"environment.max_reply_tokens must be an integer >= 1, got {self.max_reply_tokens!r}")
        if self.timeout is not None and (isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float))
                                         or not math.isfinite(self.timeout) or self.timeout <= 0):
            raise ValueError(f"environment.timeout must be a number of seconds > 0, or null, got {self.timeout!r}")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"environment.workers must be an integer >= 1, got {self.workers!r}")
        parse_on_error("environment.on_error", self.on_error)
        try:
            self.reply_format.format(role="user", content="x")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"environment.reply_format must be a str.format pattern with {{content}} (and "
                             f"optionally {{role}}), got {self.reply_format!r}: {err!r}") from None
        if "{content}" not in self.reply_format:
            raise ValueError(f"environment.reply_format must contain {{content}}, got {self.reply_format!r}")


@dataclass(frozen=True)
class RunArgs:
    """What a fit writes besides the weights' progress.

    Args:
        checkpoint_every_n_steps: besides the end of fit (always), write ``last.ckpt`` every N optimizer steps;
            0 = off.
        time_phases: time the phases of each step (generation, reward, policy forward, reference) and write them
            as ``time/<phase>`` to the loggers.
    """

    prefix: ClassVar[str] = "run"
    checkpoint_every_n_steps: int = 0
    time_phases: bool = False

    def __post_init__(self) -> None:
        if self.checkpoint_every_n_steps < 0:
            raise ValueError(f"run.checkpoint_every_n_steps must be >= 0, got {self.checkpoint_every_n_steps}")


GROUPS: dict[str, type] = {
    "rewards": RewardArgs,
    "sampling": SamplingArgs,
    "shaping": ShapingArgs,
    "kl": KLArgs,
    "advantage": AdvantageArgs,
    "update": UpdateArgs,
    "correction": CorrectionArgs,
    "dynamic_sampling": DynamicSamplingArgs,
    "validation": ValidationArgs,
    "policy": PolicyArgs,
    "predict": PredictArgs,
    "environment": EnvironmentArgs,
    "run": RunArgs,
}

class Options:
    """The module's option groups, read as ``module.cfg.kl.beta``."""

    def __init__(self, **groups: Any) -> None:
        self.__dict__.update(groups)

    def __repr__(self) -> str:
        return "Options(" + ", ".join(f"{name}={group!r}" for name, group in self.__dict__.items()) + ")"


def check_options(c: Options) -> None:
    """Checks that involve more than one group, with errors that name each option."""
    if not 0 <= c.shaping.overlong_buffer < c.sampling.max_new_tokens:
        raise ValueError(f"shaping.overlong_buffer must be in [0, sampling.max_new_tokens="
                         f"{c.sampling.max_new_tokens}), got {c.shaping.overlong_buffer}")
    if c.correction.level != "none" and c.kl.placement == "loss":
        raise ValueError("correction.level needs kl.placement 'reward' or 'token_reward': with 'loss' the KL term's "
                         "gradient would stay uncorrected")
    if c.correction.level == "token" and c.update.updates_per_rollout > 1 and c.update.clip_mode == "sequence":
        raise ValueError("correction.level='token' gives token advantages; with update.updates_per_rollout > 1 "
                         "use update.clip_mode='token'")
    if c.update.updates_per_rollout > 1 and c.kl.placement == "token_reward" and c.update.clip_mode == "sequence":
        raise ValueError("kl.placement='token_reward' gives token advantages; with update.updates_per_rollout > 1 "
                         "use update.clip_mode='token'")
    if c.environment.class_path is not None:
        if c.sampling.stop_strings:
            raise ValueError("sampling.stop_strings are not supported with environment.class_path: a policy turn ends "
                             "at an EOS id (sampling.eos_token_ids)")
        if c.shaping.overlong_buffer:
            raise ValueError("shaping.overlong_buffer measures one completion against sampling.max_new_tokens; an "
                             "episode has several turns: set it to 0 with environment.class_path")
    if c.kl.ref_sync_steps and (c.kl.beta == 0 or c.policy.lora):
        raise ValueError("kl.ref_sync_steps needs a reference of its own: kl.beta > 0 and no policy.lora (under "
                         "LoRA the reference is the frozen base, which cannot move)")


def check_learning_rate(lr: Any, option: str) -> None:
    """A learning rate must be a finite number > 0; the error names ``option``, as the user set it
    (``model.optimizer.init_args.lr in my.yaml``). A value that is no plain number (a tensor) is left alone."""
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        return
    if not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"{option} must be a finite number > 0, got {lr}")


def as_group(cls: type, value: Any) -> Any:
    """``value`` as an instance of the group ``cls``: an instance, a dict of its fields, or None (defaults).

    An unknown key fails with the group's prefix and the closest field name.
    """
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    if dataclasses.is_dataclass(value):  # the same group from another import (e.g. a namespace)
        value = dataclasses.asdict(value)
    if not isinstance(value, dict):
        raise TypeError(f"{cls.prefix} must be a {cls.__name__} or a mapping of its fields, got {value!r}")
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in value:
        if key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=1)
            hint = f"; did you mean {cls.prefix}.{close[0]}?" if close else f"; valid: {', '.join(sorted(fields))}"
            raise ValueError(f"unknown option {cls.prefix}.{key}{hint}")
    return cls(**value)


def to_primitives(value: Any) -> Any:
    """A group (or anything nested in one) as plain dicts, lists and scalars, as stored in checkpoints."""
    if dataclasses.is_dataclass(value):
        return {f.name: to_primitives(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_primitives(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_primitives(v) for v in value]
    return value
