"""RLOOModule: rollout in ``training_step``, leave-one-out advantages, sequence-level REINFORCE loss."""

from __future__ import annotations

import copy
import dataclasses
from typing import Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchmetrics import MeanMetric

from rloo_lightning.objectives import group_std, masked_sum, pass_at_k, token_entropy, token_logprobs
from rloo_lightning.rewards import RewardSet
from rloo_lightning.rewards.model import RewardModel
from rloo_lightning.rewards.shaping import clip_rewards, missing_eos_penalty, overlong_penalty
from rloo_lightning.rollout import (
    Rollout,
    concat_groups,
    default_eos_ids,
    GenerationEngine,
    HFGenerateEngine,
    derive_seed,
    generate_rollout,
    sampling_config,
)
from rloo_lightning.timing import PhaseTimer
from rloo_lightning.variants import (
    AGGREGATION_MODES,
    BASELINES,
    KL_ESTIMATORS,
    MovingAverageBaseline,
    _check_choice,
    aggregate_token_loss,
    baseline_advantages,
    informative_groups,
    kl_per_token,
    mix_into_reference,
    reward_to_go,
    sequence_clipped_surrogate,
    token_clipped_surrogate,
    token_rewards_after_baseline,
    whiten,
)

__all__ = ["RLOOModule", "NonFiniteError", "warmup_constant_schedule"]


def warmup_constant_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int):
    """Linear warm-up from ~0 to the base rate over ``warmup_steps``, then constant (the paper's schedule)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / max(1, warmup_steps))
    )


class NonFiniteError(FloatingPointError):
    """A NaN/inf loss or gradient, with the step and the rollout statistics that led to it."""


class _Frozen:
    """Holds a frozen model outside the registered submodules: never trained, wrapped or checkpointed."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval().requires_grad_(False)


def _lora_config(options: dict):
    """``peft.LoraConfig`` for a causal LM from the ``lora`` option, with errors that name it."""
    if not isinstance(options, dict) or not options:
        raise ValueError(f"lora must be a non-empty mapping of peft.LoraConfig arguments, got {options!r}")
    try:
        from peft import LoraConfig
    except ImportError as err:
        raise ImportError("the lora option needs peft: pip install 'rloo-lightning[lora]'") from err
    if "task_type" in options:
        raise ValueError("lora: task_type is set by RLOOModule (CAUSAL_LM); remove it")
    try:
        return LoraConfig(task_type="CAUSAL_LM", **options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"lora={options!r} is not a valid peft.LoraConfig: {err}") from err


class RLOOModule(LightningModule):
    """RLOO (Ahmadian et al. 2024) for a Hugging Face causal LM.

    Each training step samples ``k`` completions for each prompt of the batch, scores them,
    folds the sequence KL to the reference into the reward, forms leave-one-out advantages and
    takes one on-policy REINFORCE step (no importance ratio, no clip).

    Args:
        model_name_or_path: policy to train: hub id, local directory, or ``tiny:<task>``.
        reward_funcs: reward functions: import paths ``"pkg.module.fn"`` or
            ``{class_path: pkg.module.Class, init_args: {...}}`` (see :mod:`rloo_lightning.rewards`);
            importing executes their code.
        reward_weights: one weight per reward function (default: all 1).
        reward_timeout: seconds one reward call may run; it then runs in a worker process that is
            killed on timeout and the call scored by ``reward_on_error``. None = no limit.
        reward_workers: worker processes that run the reward functions in parallel (0 = in this process).
        reward_on_error: what a reward exception or timeout scores: ``raise``, ``none`` (a missing
            reward, left out of the baseline) or a number; a warning names the function and prompt.
        reward_chunk_size: completions per worker call (default: the batch split over the workers).
        missing_eos_penalty: subtracted from the reward of a completion with no EOS (TRL <= 0.21's
            ``missing_eos_penalty``); 0 = off.
        overlong_buffer: DAPO's soft overlong punishment (Yu et al. 2025): a completion longer than
            ``max_new_tokens - overlong_buffer`` tokens loses up to ``overlong_factor``, linearly; 0 = off.
        overlong_factor: the largest overlong penalty.
        reward_clip: ``[low, high]`` clip of the task reward after the penalties, before the KL term
            (TRL ``reward_clip_range``, OpenRLHF); None = off.
        mask_truncated_completions: completions without EOS leave the loss and their group's
            baseline (TRL ``mask_truncated_completions``, DAPO's overlong filtering).
        k: completions per prompt (>= 2). The paper uses 2 and 4.
        beta: KL coefficient. ``R = r - beta * sum_t (logp_t - ref_logp_t)``, detached, before the
            baseline (paper Sec. 2.3). ``beta = 0`` loads no reference model.
        max_new_tokens: completion budget; a completion without EOS by then is truncated.
        temperature: sampling temperature; log-probs use the same one, so that the gradient is of
            the distribution that was sampled.
        top_k: 0 = off. Anything else samples from a truncated distribution that is *not* pi_theta
            and biases the estimator; for ablations only.
        top_p: 1.0 = off. Same caveat as ``top_k``.
        repetition_penalty: 1.0 = off. Same caveat as ``top_k``.
        seed: base of the sampling seeds; each step samples with a seed derived from
            (seed, rank, global step), so a resumed run samples what an uninterrupted one would.
        disable_dropout: turn every dropout off in the policy (and reference), so that the log-probs
            of the update are those of the sampler.
        warmup_ratio: fraction of the total steps for the linear warm-up of the default
            constant-rate schedule (the paper: 3%). Ignored when ``lr_scheduler`` is given.
        validate_at_start: run a validation pass before the first update and log it at step 0
            (Lightning's sanity check does not log).
        val_greedy: also evaluate greedy decoding: ``val/reward_greedy`` and ``val/accuracy_greedy``.
        val_num_samples: completions sampled per validation prompt (training sampler); ``val/reward``
            is their mean.
        val_pass_k: log ``val/pass@<k>`` for each k (each <= ``val_num_samples``), with the unbiased
            estimator of Chen et al. 2021: ``1 - C(n-c, k) / C(n, k)`` for c successes in n samples.
        success_threshold: a completion whose reward is >= this counts as a success (accuracy, pass@k).
        eos_token_ids: token ids that end a completion (default: the tokenizer's EOS plus those of the
            model's shipped generation config, e.g. a chat model's end-of-turn token).
        stop_strings: strings that end a completion; the completion mask ends with the token that
            completes the first one.
        gradient_checkpointing: recompute activations in the backward of the update (less memory,
            one more forward). Generation runs in eval mode, where transformers does not checkpoint
            and keeps the KV cache (in train mode checkpointing would silently turn the cache off).
        micro_batch_size: completions per forward/backward pass of the update (None = the whole
            rollout at once). The rollout is still sampled whole and there is still one optimizer
            step per rollout: the same update as unsplit, with the activation memory of one
            micro-batch. With a KL term the policy runs one extra forward without grad (the
            sequence KL of every completion is needed before any advantage exists). Lightning's
            ``accumulate_grad_batches=n`` is different and composes with it: n rollouts (each
            sampled from the same, not yet updated policy, so still on-policy) per optimizer step.
        lora: train a LoRA adapter (``peft``, ``pip install rloo-lightning[lora]``) instead of the whole
            policy: the keyword arguments of ``peft.LoraConfig``, e.g. ``{r: 16, lora_alpha: 32,
            target_modules: all-linear}`` (``task_type`` is set here). The reference policy is then
            the base model with the adapter disabled, so only one copy of the base weights is
            resident; checkpoints hold the adapter (and optimizer state) only. None = full training.
        lora_export: what :meth:`save_pretrained` (and ``HFExport``) writes for a LoRA policy:
            ``merged`` (the base with the adapter merged in: a plain model) or ``adapter`` (the
            adapter alone, loadable with ``peft.PeftModel.from_pretrained``).
        baseline: the baseline subtracted from the reward (step 5). ``leave_one_out`` (the paper:
            mean of the other k-1 samples of the prompt); ``none`` (vanilla REINFORCE);
            ``moving_average`` (REINFORCE with an exponential moving average of earlier batches'
            mean reward, ``baseline_decay``; the paper's "REINFORCE w/ baseline"); ``group_mean_std``
            (GRPO: ``(R - group mean) / (group std + 1e-4)``, biased); ``group_mean`` (Dr.GRPO:
            the self-inclusive mean, = ``(k-1)/k`` x leave-one-out).
        baseline_decay: weight of the past in the ``moving_average`` baseline.
        kl_estimator: per-token KL estimate: ``k1`` = ``logp - ref_logp`` (the paper, TRL), ``k2`` =
            ``(logp - ref_logp)^2 / 2``, ``k3`` = ``exp(ref_logp - logp) - (ref_logp - logp) - 1``
            (Schulman 2020; GRPO, verl ``low_var_kl``). Only k1 keeps ``reward`` placement unbiased.
        kl_placement: where ``beta * KL`` enters. ``reward``: the sequence sum subtracted from the
            reward before the baseline (the paper, TRL; unbiased with k1). ``token_reward``
            (OpenRLHF): the baseline on the task reward alone, then ``-beta*kl_t`` at every token and
            the advantage at the last one, summed to go into token advantages. ``loss`` (GRPO,
            verl ``use_kl_loss``): ``beta * KL`` with its gradient added to the loss, aggregated as
            the loss is (use ``kl_estimator: k3`` to match them).
        kl_clamp: clamp each per-token KL estimate to ``[-c, c]`` (OpenRLHF: 10); None = off.
        loss_aggregation: how per-token terms become the loss (verl's ``loss_agg_mode`` in brackets):
            ``seq_sum`` (the paper, TRL; verl ``seq-mean-token-sum``): sum over tokens, mean over
            sequences; ``token_mean`` (verl default, OpenRLHF): mean over all tokens of the batch;
            ``seq_mean_token_mean`` (original GRPO): mean over sequences of each one's token
            mean; ``seq_mean_token_sum_norm`` (Dr.GRPO): token sum / (sequences x
            ``loss_norm_constant``). All but ``seq_sum`` weigh sequences by length and bias the
            sequence-level gradient; the denominators are global over ranks.
        loss_norm_constant: the constant of ``seq_mean_token_sum_norm`` (default: ``max_new_tokens``).
        normalize_rewards: standardise the rewards over the global batch before the baseline
            (``(R - mean) / (std + 1e-4)``; TRL <= 0.21 / OpenRLHF ``normalize_reward`` style).
        whiten_advantages: standardise the advantages over the global batch (TRL
            ``normalize_advantages``). A rescale per batch: changes the step size, biased.
        advantage_clip: ``[low, high]`` clip of the advantages after the baseline (OpenRLHF clips
            at +-10); ``reward_clip`` clips before it. None = off.
        updates_per_rollout: optimizer steps per rollout (TRL ``num_iterations``, verl
            ``ppo_epochs``). 1 (default) is on-policy: no importance ratio, no clip. With n > 1 the
            rollout is stored and the next n-1 steps update on it again with a clipped
            importance-weighted surrogate (``clip_mode``); PromptDataModule repeats each batch n
            times (the CLI links this option), and a checkpoint taken mid-way holds the rollout.
        clip_mode: ``sequence`` (TRL: one ratio ``exp(sum_t logp - old_logp)`` per completion) or
            ``token`` (verl / OpenRLHF: one ratio per token, aggregated by ``loss_aggregation``).
        clip_eps_low, clip_eps_high: the clip range ``[1 - eps_low, 1 + eps_high]``.
        dual_clip: verl's dual clip constant ``c > 1`` for negative advantages (``clip_mode: token``).
        dynamic_sampling: DAPO's dynamic sampling (Yu et al. 2025; OpenRLHF ``dynamic_filtering``,
            verl ``filter_groups``): a prompt group whose task rewards are all equal has zero
            advantages and adds no gradient; draw more prompts (the data module's
            ``sample_batch``) until the batch has ``batch_size`` groups whose rewards differ, and
            train on those. Every rank runs the same number of rounds (generation stays
            synchronised); extra prompts come from a generator seeded by (seed, rank, step,
            round), so a resume draws the same ones. Off by default: it changes which prompts the
            gradient averages over (biased toward hard-but-solvable prompts, as intended by DAPO).
        dynamic_sampling_max_rounds: extra generation rounds per step at most; when they are used
            up, a warning says so and the batch is topped up with uninformative groups.
        dynamic_sampling_atol: a group whose reward spread is ``<= atol`` counts as uninformative.
        ref_sync_steps: every this many steps mix the policy into the reference (TR-DPO, TRL
            ``sync_ref_model``): ``ref = alpha*policy + (1-alpha)*ref``. 0 = off (the paper: the
            reference is the initial policy). The reference is then checkpointed too.
        ref_sync_alpha: the ``alpha`` of ``ref_sync_steps`` (TRL ``ref_model_mixup_alpha``: 0.6).
        on_nonfinite: what a NaN/inf loss or gradient does: ``stop`` raises :class:`NonFiniteError`
            (naming the step and the rollout statistics that led to it) before the optimizer step,
            so no poisoned weights reach a checkpoint; ``skip`` drops that update (no parameter or
            optimizer-state change) and counts it in ``train/skipped_steps``.
        generation_engine: what samples the completions (:class:`~rloo_lightning.rollout.GenerationEngine`;
            default: the policy's own ``generate`` with the KV cache). In YAML:
            ``{class_path: my.Engine, init_args: {...}}``. Not saved in checkpoints' hyperparameters.
        time_phases: time the phases of each step (generation, reward, policy_forward, reference)
            and write them as ``time/<phase>`` to the loggers (directly, every ``log_every_n_steps``;
            not in ``callback_metrics``); read by :class:`~rloo_lightning.timing.StepTimer`.
            Off: the timer is a shared no-op context.
        gguf_file: a GGUF file inside ``model_name_or_path`` (dequantized on load; needs ``gguf``).
        trust_remote_code: executes code shipped with the model; off unless set.
        optimizer: optimizer factory (default AdamW, lr 1e-6 as in the paper).
        lr_scheduler: scheduler factory (default: linear warm-up then constant).
    """

    def __init__(
        self,
        model_name_or_path: str,
        reward_funcs: list[str | dict],
        reward_weights: list[float] | None = None,
        reward_timeout: float | None = None,
        reward_workers: int = 0,
        reward_on_error: str | float = "raise",
        reward_chunk_size: int | None = None,
        missing_eos_penalty: float = 0.0,
        overlong_buffer: int = 0,
        overlong_factor: float = 1.0,
        reward_clip: tuple[float, float] | None = None,
        mask_truncated_completions: bool = False,
        k: int = 4,
        beta: float = 0.05,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        seed: int = 0,
        disable_dropout: bool = True,
        warmup_ratio: float = 0.03,
        validate_at_start: bool = True,
        val_greedy: bool = True,
        val_num_samples: int = 1,
        val_pass_k: list[int] | None = None,
        success_threshold: float = 1.0,
        eos_token_ids: list[int] | None = None,
        stop_strings: list[str] | None = None,
        gradient_checkpointing: bool = False,
        micro_batch_size: int | None = None,
        lora: dict | None = None,
        lora_export: Literal["merged", "adapter"] = "merged",
        baseline: Literal["leave_one_out", "none", "moving_average", "group_mean_std", "group_mean"] = "leave_one_out",
        baseline_decay: float = 0.9,
        kl_estimator: Literal["k1", "k2", "k3"] = "k1",
        kl_placement: Literal["reward", "token_reward", "loss"] = "reward",
        kl_clamp: float | None = None,
        loss_aggregation: Literal[
            "seq_sum", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "seq_sum",
        loss_norm_constant: float | None = None,
        normalize_rewards: bool = False,
        whiten_advantages: bool = False,
        advantage_clip: tuple[float, float] | None = None,
        updates_per_rollout: int = 1,
        clip_mode: Literal["sequence", "token"] = "sequence",
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        dual_clip: float | None = None,
        dynamic_sampling: bool = False,
        dynamic_sampling_max_rounds: int = 4,
        dynamic_sampling_atol: float = 0.0,
        ref_sync_steps: int = 0,
        ref_sync_alpha: float = 0.6,
        on_nonfinite: Literal["stop", "skip"] = "stop",
        generation_engine: GenerationEngine | None = None,
        time_phases: bool = False,
        gguf_file: str | None = None,
        trust_remote_code: bool = False,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__()
        if k < 2:
            raise ValueError(f"k must be >= 2 (the leave-one-out baseline needs another sample), got k={k}")
        if beta < 0:
            raise ValueError(f"beta must be >= 0, got {beta}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not 0 <= warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {warmup_ratio}")
        if val_num_samples < 1:
            raise ValueError(f"val_num_samples must be >= 1, got {val_num_samples}")
        for pk in val_pass_k or []:
            if not 1 <= pk <= val_num_samples:
                raise ValueError(f"val_pass_k={val_pass_k}: each k must be in [1, val_num_samples={val_num_samples}]")
        if not 0 <= overlong_buffer < max_new_tokens:
            raise ValueError(f"overlong_buffer must be in [0, max_new_tokens={max_new_tokens}), got {overlong_buffer}")
        if reward_clip is not None and not reward_clip[0] < reward_clip[1]:
            raise ValueError(f"reward_clip must be [low, high] with low < high, got {reward_clip}")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 (sequences per forward/backward) or None, "
                             f"got {micro_batch_size}")
        if lora is not None:
            _lora_config(lora)  # peft missing or a wrong key fails now, before any model is loaded
        if lora_export not in ("merged", "adapter"):
            raise ValueError(f"lora_export must be 'merged' or 'adapter', got {lora_export!r}")
        _check_choice("baseline", baseline, BASELINES)
        _check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
        _check_choice("kl_placement", kl_placement, ("reward", "token_reward", "loss"))
        _check_choice("loss_aggregation", loss_aggregation, AGGREGATION_MODES)
        _check_choice("clip_mode", clip_mode, ("sequence", "token"))
        if not 0 <= baseline_decay < 1:
            raise ValueError(f"baseline_decay must be in [0, 1), got {baseline_decay}")
        if kl_clamp is not None and kl_clamp <= 0:
            raise ValueError(f"kl_clamp must be > 0 or None, got {kl_clamp}")
        if loss_norm_constant is not None and loss_norm_constant <= 0:
            raise ValueError(f"loss_norm_constant must be > 0 or None, got {loss_norm_constant}")
        if advantage_clip is not None and not advantage_clip[0] < advantage_clip[1]:
            raise ValueError(f"advantage_clip must be [low, high] with low < high, got {advantage_clip}")
        if updates_per_rollout < 1:
            raise ValueError(f"updates_per_rollout must be >= 1, got {updates_per_rollout}")
        if clip_eps_low < 0 or clip_eps_high < 0 or clip_eps_low >= 1:
            raise ValueError(f"clip_eps_low must be in [0, 1) and clip_eps_high >= 0, got {clip_eps_low}, "
                             f"{clip_eps_high}")
        if dual_clip is not None and (dual_clip <= 1 or clip_mode != "token"):
            raise ValueError(f"dual_clip must be > 1 and needs clip_mode='token', got dual_clip={dual_clip}, "
                             f"clip_mode={clip_mode!r}")
        if updates_per_rollout > 1 and kl_placement == "token_reward" and clip_mode == "sequence":
            raise ValueError("kl_placement='token_reward' gives token advantages; with updates_per_rollout > 1 "
                             "use clip_mode='token'")
        if dynamic_sampling_max_rounds < 1 or dynamic_sampling_atol < 0:
            raise ValueError(f"dynamic_sampling_max_rounds must be >= 1 and dynamic_sampling_atol >= 0, got "
                             f"{dynamic_sampling_max_rounds}, {dynamic_sampling_atol}")
        if ref_sync_steps < 0 or not 0 < ref_sync_alpha <= 1:
            raise ValueError(f"ref_sync_steps must be >= 0 and ref_sync_alpha in (0, 1], got {ref_sync_steps}, "
                             f"{ref_sync_alpha}")
        if ref_sync_steps and (beta == 0 or lora):
            raise ValueError("ref_sync_steps needs a reference of its own: beta > 0 and no lora (under LoRA the "
                             "reference is the frozen base, which cannot move)")
        if on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite must be 'stop' or 'skip', got {on_nonfinite!r}")
        if stop_strings is not None and (not stop_strings or not all(stop_strings)):
            raise ValueError(f"stop_strings must be non-empty strings, got {stop_strings!r}")
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler", "generation_engine"])
        self.engine = generation_engine or HFGenerateEngine()
        self.timer = PhaseTimer(enabled=time_phases)
        # Resolve reward import paths now: a typo fails before any model is loaded.
        self.rewards = RewardSet.from_specs(reward_funcs, reward_weights, timeout=reward_timeout,
                                            num_workers=reward_workers, on_error=reward_on_error,
                                            chunk_size=reward_chunk_size)
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.policy: torch.nn.Module | None = None
        self.tokenizer = None
        self._ref: _Frozen | None = None
        self.skipped_steps = 0
        self._grad_stash: list[Tensor | None] | None = None  # micro-batch gradients awaiting the backward
        self._stored_rollout: Rollout | None = None  # updates_per_rollout > 1: the rollout being reused
        self._rollout_updates = 0
        self._warned_reuse = False
        self._moving_average = MovingAverageBaseline(baseline_decay) if baseline == "moving_average" else None
        self._last_stats: dict[str, float] = {}
        # The KL coefficient in use; a buffer so that an adaptive controller's value is checkpointed.
        self.register_buffer("beta", torch.tensor(float(beta)))
        names = ["reward"] + (["reward_greedy", "accuracy_greedy"] if val_greedy else [])
        names += [f"pass@{pk}" for pk in val_pass_k or []]
        # logged as val/<name>
        self.val_metrics = torch.nn.ModuleDict({n: MeanMetric(nan_strategy="ignore") for n in names})

    # -- models --------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Load policy, tokenizer and (if beta > 0) reference; idempotent (Lightning may call it twice)."""
        if self.policy is not None:
            return
        from rloo_lightning.models import load_causal_lm, load_tokenizer
        from rloo_lightning.sharding import is_zero3, pretrained_init_context, replicated_init_context, shard_policy

        hp = self.hparams
        strategy = self._trainer.strategy if self._trainer is not None else None
        self.tokenizer = load_tokenizer(hp.model_name_or_path, gguf_file=hp.gguf_file,
                                        trust_remote_code=hp.trust_remote_code)
        load = dict(gguf_file=hp.gguf_file, trust_remote_code=hp.trust_remote_code)
        with pretrained_init_context(strategy):  # ZeRO-3: loaded into its partitions; else a no-op
            self.policy = load_causal_lm(hp.model_name_or_path, **load)
        if hp.beta > 0 and not hp.lora:
            # The reference is the initial policy: a copy, not a second load (a GGUF load dequantizes).
            # Under LoRA it is the same model with the adapter disabled (see reference_logprobs).
            # Sharded strategies: the copy is made BEFORE the policy is sharded (FSDP2 below, FSDP in
            # strategy.setup), so the reference is a whole frozen replica on every rank, never wrapped.
            # ZeRO-3 partitions the policy as it loads, so there the reference is loaded again, whole.
            if is_zero3(strategy):
                with replicated_init_context(strategy):
                    self._ref = _Frozen(load_causal_lm(hp.model_name_or_path, **load))
            else:
                self._ref = _Frozen(copy.deepcopy(self.policy))
        if hp.gradient_checkpointing:
            # Non-reentrant: works with inputs that need no grad and with DDP; only active in train mode.
            kwargs = {"use_reentrant": False}
            if hasattr(self.policy, "activation_checkpointing_enable"):  # transformers >= 5.x's name
                self.policy.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if hp.lora:
            from peft import get_peft_model

            self.policy = get_peft_model(self.policy, _lora_config(hp.lora))
        # from_pretrained returns eval mode and Lightning does not call .train(): set it.
        self.policy.train()
        if hp.disable_dropout:
            for model in (self.policy, self._ref.model if self._ref else None):
                for m in model.modules() if model is not None else ():
                    if isinstance(m, torch.nn.Dropout):
                        m.p = 0.0
        if self.device_mesh is not None:
            # ModelParallelStrategy: FSDP2 on the policy alone (each decoder layer, then the root), over the
            # data-parallel mesh; the reference above was copied before this and stays whole.
            shard_policy(self.policy, self.device_mesh)
        self.eos_token_ids = hp.eos_token_ids or default_eos_ids(self.tokenizer, self.policy.generation_config)
        common = dict(max_new_tokens=hp.max_new_tokens, eos_token_ids=self.eos_token_ids,
                      pad_token_id=self.tokenizer.pad_token_id, stop_strings=hp.stop_strings)
        self.generation_config = sampling_config(**common, temperature=hp.temperature, top_k=hp.top_k,
                                                 top_p=hp.top_p, repetition_penalty=hp.repetition_penalty)
        self.greedy_config = sampling_config(**common, do_sample=False)
        for fn in self.rewards.funcs:
            if isinstance(fn, RewardModel):
                with replicated_init_context(strategy):  # ZeRO-3: built whole, outside zero.Init
                    fn.load()  # a wrong reward model (e.g. several labels) fails before training starts

    def teardown(self, stage: str) -> None:
        self.rewards.close()

    @property
    def reference(self) -> torch.nn.Module | None:
        """The frozen reference policy on this module's device, in the policy's dtype (None when beta == 0)."""
        if self._ref is None:
            return None
        ref, policy = next(self._ref.model.parameters()), next(self.policy.parameters())
        if ref.device != self.device or ref.dtype != policy.dtype:
            # Follow the policy: Lightning moves it (and casts it under ``bf16-true``) after
            # configure_model, and never sees the unregistered reference. Same dtype, so that
            # KL = 0 at step 0 and one precision's rounding does not show up as KL.
            self._ref.model.to(device=self.device, dtype=policy.dtype)
        return self._ref.model

    @property
    def has_reference(self) -> bool:
        """True when a KL term is computed (beta > 0 at construction)."""
        return self._ref is not None or bool(self.hparams.lora and self.hparams.beta > 0)

    def reference_logprobs(self, rollout: Rollout, chunks: list[slice]) -> Tensor:
        """``[B, T]`` log-probs of the completions under the reference, ``chunks`` rows at a time.

        Under LoRA the reference is the policy with its adapter disabled (``peft``'s
        ``disable_adapter``), which is exactly the initial policy because the adapter starts at 0.
        """
        with self._grad_free():
            if self._ref is not None:
                logp = torch.cat([self.sequence_logprobs(self.reference, rollout, rows)[0] for rows in chunks])
            else:
                with self.policy.disable_adapter():
                    logp = torch.cat([self.sequence_logprobs(self.policy, rollout, rows)[0] for rows in chunks])
        return logp.clone() if logp.is_inference() else logp  # a normal tensor: the loss may save it

    def _grad_free(self):
        """The context for forwards whose outputs never need a gradient (sampling, the reference).

        ``torch.inference_mode`` where the policy is not sharded: it skips autograd's per-op bookkeeping
        (version counters, view tracking) that ``no_grad`` keeps, about 10 % of a small model's forward on
        CPU. ``no_grad`` under FSDP2 / FSDP / ZeRO-3, whose gathered parameters must stay usable by training.
        """
        from rloo_lightning.sharding import generation_path

        strategy = self._trainer.strategy if self._trainer is not None else None
        return torch.inference_mode() if generation_path(self.policy, strategy) == "none" else torch.no_grad()

    def configure_callbacks(self):
        from rloo_lightning.callbacks import ValidateAtStart

        return [ValidateAtStart()] if self.hparams.validate_at_start else []

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if self.optimizer_factory is None:
            optimizer = torch.optim.AdamW(params, lr=1e-6)
        else:
            optimizer = self.optimizer_factory(params)
        if self.scheduler_factory is not None:
            scheduler = self.scheduler_factory(optimizer)
        else:
            total = self.trainer.estimated_stepping_batches
            scheduler = warmup_constant_schedule(optimizer, int(self.hparams.warmup_ratio * total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- the pieces of a step ------------------------------------------------------------------
    def sampling_seed(self, stream: str, step: int) -> int:
        """Seed of one generation call, from (seed, rank, stream, step)."""
        return derive_seed(self.hparams.seed, self.global_rank, stream, step)

    def rollout(self, batch: dict, k: int, seed: int, greedy: bool = False) -> Rollout:
        """Sample ``k`` completions per prompt of ``batch`` from the policy."""
        from rloo_lightning.sharding import gathered_for_generation

        # Sharded policies (FSDP2, FSDP, ZeRO-3): parameters gathered once for the whole generate call, so that
        # ranks stopping at different lengths issue no collectives (no deadlock); a no-op otherwise.
        with gathered_for_generation(self.policy, self._trainer.strategy if self._trainer is not None else None):
            return generate_rollout(
                self.policy, self.tokenizer, batch["input_ids"], batch["attention_mask"],
                batch["prompt"], batch["columns"], k,
                self.greedy_config if greedy else self.generation_config, seed, engine=self.engine,
                grad_free=self._grad_free(),
            )

    def micro_batches(self, num_sequences: int) -> list[slice]:
        """Row slices of a rollout for the forward/backward passes (``micro_batch_size`` rows each)."""
        size = self.hparams.micro_batch_size or num_sequences
        return [slice(s, min(s + size, num_sequences)) for s in range(0, num_sequences, size)]

    def completion_logits(
        self, model: torch.nn.Module, rollout: Rollout, rows: slice = slice(None), trim: bool = False
    ) -> Tensor:
        """Logits ``[b, T', V]`` predicting each completion token of ``rows``, prompt and all in one forward.

        Position ids come from the attention mask, so left padding does not shift positions. With
        ``trim``, columns that are padding in every row (the prompts' common left padding, the tail
        after the longest completion) are cut before the forward, and ``T'`` is the longest
        completion of ``rows``; otherwise ``T' = T``.
        """
        prompt_ids, prompt_mask = rollout.prompt_ids[rows], rollout.prompt_mask[rows]
        completion_ids = rollout.completion_ids[rows]
        width = completion_ids.shape[1]
        if trim:
            start = int(prompt_mask.any(0).int().argmax())  # first column with a real prompt token
            prompt_ids, prompt_mask = prompt_ids[:, start:], prompt_mask[:, start:]
            width = int(rollout.completion_mask[rows].sum(1).max().clamp(min=1))
            completion_ids = completion_ids[:, :width]
        ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attn = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
        position_ids = (attn.cumsum(1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=attn, position_ids=position_ids, use_cache=False,
                    logits_to_keep=width + 1)
        return out.logits[:, :-1]

    def sequence_logprobs(
        self, model: torch.nn.Module, rollout: Rollout, rows: slice = slice(None), with_entropy: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Per-token log-probs ``[b, T]`` (fp32, sampling temperature) of the completions in ``rows``,
        and their entropies (a metric, no grad) when ``with_entropy``; 0 past each row's end."""
        logits = self.completion_logits(model, rollout, rows, trim=True)
        tokens = rollout.completion_ids[rows][:, : logits.shape[1]]
        pad = (0, rollout.completion_ids.shape[1] - logits.shape[1])
        logp = torch.nn.functional.pad(token_logprobs(logits, tokens, self.hparams.temperature), pad)
        entropy = None
        if with_entropy:
            entropy = torch.nn.functional.pad(token_entropy(logits.detach(), self.hparams.temperature), pad)
        return logp, entropy

    def score(self, rollout: Rollout) -> None:
        """Fill ``rollout.scores`` and ``rollout.rewards`` (the weighted task reward r)."""
        total, per_func = self.rewards.score(
            rollout.prompts, rollout.completions, rollout.completion_token_lists(), rollout.columns
        )
        rollout.rewards = total.to(self.device)
        rollout.scores = {name: v.to(self.device) for name, v in per_func.items()}

    def shape_rewards(self, rollout: Rollout) -> None:
        """Training-reward shaping, all off by default: DAPO overlong penalty, missing-EOS penalty, clip.

        Validation metrics use the unshaped reward.
        """
        hp = self.hparams
        r = rollout.rewards
        if hp.overlong_buffer > 0:
            lengths = rollout.completion_mask.sum(1)
            r = r + overlong_penalty(lengths, hp.max_new_tokens, hp.overlong_buffer, hp.overlong_factor)
        if hp.missing_eos_penalty:
            r = missing_eos_penalty(r, rollout.truncated, hp.missing_eos_penalty)
        if hp.reward_clip is not None:
            r = clip_rewards(r, *hp.reward_clip)
        rollout.rewards = r

    # -- training ------------------------------------------------------------------------------
    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        hp = self.hparams
        if self._reusable_rollout(batch) is not None:
            # updates_per_rollout > 1: another update on the stored rollout (ratio + clip, step 6).
            rollout = self._stored_rollout
        else:
            # 1. Rollout: k samples per prompt from pi_theta itself (explicit sampler, seeded by step).
            with self.timer("generation"):
                rollout = self.rollout(batch, hp.k, self.sampling_seed("train", self.global_step))
            # 2. Rewards: weighted sum of the reward functions (NaN = missing), then the optional shaping.
            with self.timer("reward"):
                self.score(rollout)
                self.shape_rewards(rollout)
            if hp.dynamic_sampling:
                rollout = self._informative_rollout(rollout, len(batch["prompt"]))
        # 3.-6. Log-probs, KL, advantages, loss.
        loss, entropy = self.rollout_loss(rollout)
        if hp.updates_per_rollout > 1:
            self._stored_rollout, self._rollout_updates = rollout, self._rollout_updates + 1
        self._last_stats = self._log_train_metrics(rollout, rollout.advantages, entropy, loss)
        if self.timer.enabled:
            self._log_phase_times(self.timer.totals)
        if not self._finite_everywhere(loss):
            self._on_nonfinite("loss")
            return None  # every rank skips together: no backward, no optimizer step
        return loss

    def _log_phase_times(self, totals: dict[str, float]) -> None:
        """``time/<phase>`` seconds straight to the trainer's loggers, every ``log_every_n_steps`` steps.

        Not through ``self.log``: its per-key bookkeeping (about half a millisecond a key on CPU) would
        make the timers the largest cost they measure. So they are not in ``trainer.callback_metrics``.
        """
        trainer = self._trainer
        if trainer is None or not trainer.loggers or self.global_step % max(trainer.log_every_n_steps, 1):
            return
        metrics = {f"time/{phase}": seconds for phase, seconds in totals.items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=self.global_step)

    def _informative_rollout(self, rollout: Rollout, num_groups: int) -> Rollout:
        """Dynamic sampling: more rounds of prompts until ``num_groups`` groups have differing rewards.

        All ranks take part in every round while any rank is short (one all-reduce per round), so a
        sharded ``generate`` never waits on a rank that stopped early.
        """
        hp = self.hparams
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if not hasattr(datamodule, "sample_batch"):
            raise ValueError("dynamic_sampling needs a data module with sample_batch(num_prompts, seed), "
                             "such as PromptDataModule")
        step = self.global_step
        parts, found, first_informative, rounds = [], 0, None, 0
        candidate = rollout
        while True:
            informative = informative_groups(candidate.rewards, hp.k, hp.dynamic_sampling_atol)
            if first_informative is None:
                first_informative = informative
            take = informative.nonzero().flatten().tolist()[: num_groups - found]
            parts.append((candidate, take))
            found += len(take)
            short = self.reduce_across_ranks(torch.tensor(float(found < num_groups), device=self.device),
                                             "max")
            if short == 0 or rounds == hp.dynamic_sampling_max_rounds:
                break
            rounds += 1
            seed = derive_seed(hp.seed, self.global_rank, "dynamic", step, rounds)
            extra = datamodule.sample_batch(num_groups, seed)
            extra = {key: v.to(self.device) if isinstance(v, Tensor) else v for key, v in extra.items()}
            with self.timer("generation"):
                candidate = self.rollout(extra, hp.k, self.sampling_seed(f"dynamic{rounds}", step))
            with self.timer("reward"):
                self.score(candidate)
                self.shape_rewards(candidate)
        counts = self.reduce_across_ranks(
            torch.tensor([float(first_informative.sum()), float(found), float(num_groups)], device=self.device))
        if counts[1] < counts[2]:
            rank_zero_warn(f"dynamic_sampling: step {step}: {int(counts[1])} of {int(counts[2])} groups (all ranks) "
                           f"informative after dynamic_sampling_max_rounds={hp.dynamic_sampling_max_rounds} extra "
                           "rounds; the batch is topped up with uninformative groups (advantage 0)")
        if found < num_groups:
            filler = (~first_informative).nonzero().flatten()
            parts.append((rollout, filler.tolist()[: num_groups - found]))
        self.log("train/dynamic_sampling_rounds", float(rounds), batch_size=num_groups)
        self.log("train/informative_groups", float(counts[0] / counts[2]), batch_size=num_groups)
        return concat_groups(parts, self.tokenizer.pad_token_id)

    def _reusable_rollout(self, batch: dict) -> Rollout | None:
        """The stored rollout if it has updates left (``updates_per_rollout``), else None."""
        if self._stored_rollout is None or self._rollout_updates >= self.hparams.updates_per_rollout:
            self._stored_rollout, self._rollout_updates = None, 0
            return None
        stored = self._stored_rollout
        if list(batch["prompt"]) != stored.prompts[:: stored.k] and not self._warned_reuse:
            self._warned_reuse = True
            rank_zero_warn("updates_per_rollout > 1: this batch's prompts are not the stored rollout's and are "
                           "skipped; PromptDataModule repeats each batch updates_per_rollout times (the CLI links it)")
        return stored

    def rollout_loss(self, rollout: Rollout) -> tuple[Tensor, Tensor]:
        """Steps 3-6 of a training step on a scored rollout; returns the loss and per-token entropy ``[B, T]``.

        Separate from :meth:`training_step` so that a fixed rollout can be injected (tests, DDP checks).
        A stored rollout's later updates (``updates_per_rollout > 1``) only go through step 6.
        """
        hp = self.hparams
        mask = rollout.completion_mask
        chunks = self.micro_batches(mask.shape[0])
        self._grad_stash = None
        fresh = rollout.old_logp is None  # set after the first of several updates on one rollout

        # 3. Log-probs of the completion: policy with grad, reference without, same temperature.
        #    Micro-batched, the KL of step 4 needs every sequence's log-prob before any loss can be
        #    formed, so the policy runs here without grad (only if that is needed) and again with
        #    grad, one micro-batch at a time, in step 6.
        logp = entropy = policy_logp = None
        with self.timer("policy_forward"):
            if len(chunks) == 1:
                logp, entropy = self.sequence_logprobs(self.policy, rollout, with_entropy=True)
                policy_logp = logp.detach()
            elif fresh and (self.has_reference or hp.updates_per_rollout > 1):
                with torch.no_grad():
                    policy_logp = torch.cat([self.sequence_logprobs(self.policy, rollout, rows)[0] for rows in chunks])

        if fresh:
            self._advantages(rollout, policy_logp, chunks)

        # 6. Sequence-level REINFORCE: -mean_i A_i * sum_t m_t logp_t over the kept sequences
        #    (loss_aggregation, kl_placement and updates_per_rollout change this; see _update_loss).
        denominators = self._loss_denominators(rollout)
        rollout.clip_stats = {}
        if logp is not None:
            loss = self._update_loss(rollout, slice(None), logp, denominators)
        else:
            with self.timer("policy_forward"):  # the micro-batches' forwards and all but the last backward
                loss, entropy = self._micro_batched_loss(rollout, chunks, denominators)
        if fresh and hp.updates_per_rollout > 1:
            rollout.old_logp = policy_logp  # pi_theta_old of the later updates on this rollout

        if fresh:
            self._call_rollout_hooks("on_rollout_end", rollout)
        return loss, entropy

    def _advantages(self, rollout: Rollout, policy_logp: Tensor | None, chunks: list[slice]) -> None:
        """Steps 4-5: KL to the reference, reward transforms, the baseline; fills the rollout's fields."""
        hp = self.hparams
        mask = rollout.completion_mask

        # 4. KL on the sequence (k1 by default), detached, folded into the reward *before* the baseline:
        #    R = r - beta * log pi(y)/pi_ref(y) (paper Sec. 2.3), unbiased for E[r] - beta*KL.
        #    kl_placement moves it after the baseline (OpenRLHF) or into the loss (GRPO/verl).
        rollout.shaped_rewards = rollout.rewards
        if self.has_reference:
            with self.timer("reference"):
                rollout.ref_logp = self.reference_logprobs(rollout, chunks)
            rollout.token_kl = kl_per_token(policy_logp, rollout.ref_logp, hp.kl_estimator, hp.kl_clamp) * mask
            rollout.kl = rollout.token_kl.sum(1)
            if hp.kl_placement == "reward":
                rollout.shaped_rewards = rollout.rewards - self.beta * rollout.kl
        if hp.normalize_rewards:  # statistics over every rank's valid rewards
            rollout.shaped_rewards = whiten(rollout.shaped_rewards, reduce=self.reduce_across_ranks)
        rollout.keep = torch.ones_like(rollout.rewards, dtype=torch.bool)
        if hp.mask_truncated_completions:
            rollout.keep &= ~rollout.truncated
        self._call_rollout_hooks("on_rollout", rollout)

        # 5. Leave-one-out advantages per prompt group: A_i = R_i - mean_{j != i} R_j (``baseline``).
        #    Rows a callback dropped count as missing: out of the baseline, advantage 0.
        rewards = torch.where(rollout.keep, rollout.shaped_rewards, torch.full_like(rollout.rewards, torch.nan))
        batch_mean = None
        if hp.baseline == "moving_average":  # every rank folds in the same global mean
            valid = ~torch.isnan(rewards)
            sums = self.reduce_across_ranks(torch.stack([torch.nan_to_num(rewards).sum(), valid.sum().float()]))
            batch_mean = float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")
        advantages = baseline_advantages(rewards, hp.k, hp.baseline, moving_average=self._moving_average,
                                         batch_mean=batch_mean)
        if hp.advantage_clip is not None:
            advantages = advantages.clamp(*hp.advantage_clip)
        if hp.whiten_advantages:  # over every rank's kept rows; dropped rows keep advantage 0
            advantages = whiten(advantages, mask=rollout.keep, reduce=self.reduce_across_ranks)
        rollout.advantages = advantages
        if hp.kl_placement == "token_reward" and rollout.token_kl is not None:
            # OpenRLHF: -beta*kl_t at every token, the advantage at the last one, summed to go (gamma = 1).
            loss_mask = mask * rollout.keep[:, None]
            rollout.token_advantages = reward_to_go(
                token_rewards_after_baseline(advantages, rollout.token_kl, loss_mask, float(self.beta)), loss_mask)

    def _loss_denominators(self, rollout: Rollout) -> dict:
        """Global divisors of the loss: kept sequences and kept tokens over all ranks, per rank (one all-reduce).

        DDP averages gradients over ranks, so dividing each rank's sum by (global count / world
        size) makes the update the mean over every kept sequence (or token) of the global batch,
        however they are spread. If nothing is kept the loss is an exact zero that still touches
        the graph (no DDP hang).
        """
        kept = torch.stack([rollout.keep.sum().float(), (rollout.completion_mask * rollout.keep[:, None]).sum()])
        sequences, tokens = self.reduce_across_ranks(kept, "sum") / self.world_size
        return {"num_sequences": torch.where(sequences > 0, sequences, torch.ones_like(sequences)),
                "num_tokens": tokens.clamp(min=1e-8),
                "norm_constant": self.hparams.loss_norm_constant or self.hparams.max_new_tokens}

    def _update_loss(self, rollout: Rollout, rows: slice, logp: Tensor, denominators: dict) -> Tensor:
        """Step 6 for the sequences ``rows`` of the rollout, given their log-probs ``[b, T]`` (with grad).

        Default: the paper's ``-sum_i A_i sum_t m_t logp_t / S``. On a stored rollout's later
        updates (``updates_per_rollout > 1``) a clipped importance-weighted surrogate replaces it;
        on the first one the ratio would be exactly 1 and the surrogate's gradient is this one.
        """
        hp = self.hparams
        mask = rollout.completion_mask[rows] * rollout.keep[rows, None]
        token_adv = rollout.token_advantages
        advantages = token_adv[rows] if token_adv is not None else rollout.advantages[rows, None]
        mode = hp.loss_aggregation
        if rollout.old_logp is None:
            per_token = -advantages.detach() * logp
            loss = aggregate_token_loss(per_token, mask, mode, **denominators)
        elif hp.clip_mode == "sequence":  # TRL: one ratio per completion
            per_sequence, stats = sequence_clipped_surrogate(rollout.advantages[rows], logp, rollout.old_logp[rows],
                                                             mask, hp.clip_eps_low, hp.clip_eps_high)
            loss = per_sequence.sum() / denominators["num_sequences"]
            self._add_clip_stats(rollout, stats, mask.shape[0])
        else:  # verl / OpenRLHF: one ratio per token, optional dual clip
            per_token, stats = token_clipped_surrogate(advantages, logp, rollout.old_logp[rows], mask,
                                                       hp.clip_eps_low, hp.clip_eps_high, hp.dual_clip)
            loss = aggregate_token_loss(per_token, mask, mode, **denominators)
            self._add_clip_stats(rollout, stats, mask.sum())
        if hp.kl_placement == "loss" and rollout.ref_logp is not None:
            # GRPO / verl use_kl_loss: beta * KL estimate with its gradient, aggregated like the loss.
            kl = kl_per_token(logp, rollout.ref_logp[rows], hp.kl_estimator, hp.kl_clamp)
            loss = loss + self.beta * aggregate_token_loss(kl, mask, mode, **denominators)
        return loss

    @staticmethod
    def _add_clip_stats(rollout: Rollout, stats: dict, weight) -> None:
        for name in ("clip_low", "clip_high", "clip_region", "ratio_mean"):
            if name in stats:
                s, c = rollout.clip_stats.get(name, (0.0, 0.0))
                rollout.clip_stats[name] = (s + stats[name].detach() * weight, c + weight)

    def _micro_batched_loss(self, rollout: Rollout, chunks: list[slice], denominators: dict) -> tuple[Tensor, Tensor]:
        """Step 6 one micro-batch at a time: the same loss and gradient as the whole rollout at once.

        The loss is a sum over sequences divided by counts fixed beforehand, so it splits into a
        sum of micro-batch losses. Every micro-batch but the last is differentiated here and its
        gradient held back (see :meth:`_backward_early`); the last one's loss is returned for
        Lightning's backward, plus the others' values (detached) so that the logged loss is the total.
        """
        entropies, earlier = [], torch.zeros((), device=self.device)
        for i, rows in enumerate(chunks):
            logp, entropy = self.sequence_logprobs(self.policy, rollout, rows, with_entropy=True)
            entropies.append(entropy)
            loss = self._update_loss(rollout, rows, logp, denominators)
            if i < len(chunks) - 1:
                self._backward_early(loss)
                earlier = earlier + loss.detach()
        return loss + earlier, torch.cat(entropies)

    def _backward_early(self, loss: Tensor) -> None:
        """Gradient of one micro-batch, kept until Lightning's backward of the last one.

        Not ``loss.backward()``: Lightning zeroes the gradients *after* ``training_step`` returns,
        and under DDP the first backward after the forward would all-reduce a partial gradient.
        ``autograd.grad`` fires neither DDP's hooks nor writes ``.grad``; :meth:`on_before_backward`
        adds the sum into ``.grad`` just before the last micro-batch's backward, whose all-reduce
        then carries the whole rollout's gradient. FSDP2 modules get a real backward with gradient
        synchronisation off instead (their gradients accumulate unsharded until the last one).
        """
        scaler = getattr(self.trainer.precision_plugin, "scaler", None) if self._trainer is not None else None
        if scaler is not None:  # fp16 AMP scales the loss Lightning backpropagates: scale ours alike
            loss = scaler.scale(loss)
        if hasattr(self.policy, "set_requires_gradient_sync"):
            self.policy.set_requires_gradient_sync(False)
            try:
                loss.backward()
            finally:
                self.policy.set_requires_gradient_sync(True)
            return
        params = [p for p in self.policy.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        if self._grad_stash is None:
            self._grad_stash = list(grads)
        else:
            self._grad_stash = [s if g is None else g if s is None else s.add_(g)
                                for s, g in zip(self._grad_stash, grads)]

    def on_before_backward(self, loss: Tensor) -> None:
        if self._grad_stash is None:
            return
        params = [p for p in self.policy.parameters() if p.requires_grad]
        for p, g in zip(params, self._grad_stash):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        self._grad_stash = None

    @property
    def world_size(self) -> int:
        return self.trainer.world_size if self._trainer is not None else 1

    def reduce_across_ranks(self, tensor: Tensor, op: str = "sum") -> Tensor:
        """``tensor`` reduced over all ranks (``sum``, ``min``, ``max``); itself on one process."""
        if self.world_size == 1:
            return tensor
        return self.trainer.strategy.reduce(tensor, reduce_op=op)

    def _call_rollout_hooks(self, hook: str, rollout: Rollout) -> None:
        """Call ``on_rollout`` (may edit) or ``on_rollout_end`` (read-only) on each RolloutHook callback."""
        from rloo_lightning.callbacks import RolloutHook

        for callback in self.trainer.callbacks if self._trainer is not None else []:
            if isinstance(callback, RolloutHook):
                if hook == "on_rollout":
                    callback.on_rollout(self.trainer, self, rollout)
                else:
                    callback.on_rollout_end(self.trainer, self, rollout)

    # -- NaN/inf guard -------------------------------------------------------------------------
    def _finite_everywhere(self, *tensors: Tensor) -> bool:
        """True if every tensor is finite on every rank (one all-reduce, so all ranks agree)."""
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # FSDP2: this rank's shard
        ok = torch.stack([torch.isfinite(t.detach()).all() for t in local]).all().float()
        return bool(self.reduce_across_ranks(ok, "min") > 0)

    def _on_nonfinite(self, what: str) -> None:
        stats = ", ".join(f"{k}={v:.4g}" for k, v in self._last_stats.items())
        message = f"non-finite {what} at step {self.global_step}; rollout statistics: {stats}"
        if self.hparams.on_nonfinite == "stop":
            raise NonFiniteError(message + " (on_nonfinite=stop: no update applied, no checkpoint written)")
        self.skipped_steps += 1
        rank_zero_warn(message + " (on_nonfinite=skip: update dropped)")
        self.log("train/skipped_steps", float(self.skipped_steps))

    def _frozen_base_keys(self) -> set[str]:
        """State-dict keys of the frozen base weights under LoRA (none otherwise)."""
        if not self.hparams.lora:
            return set()
        # From the state dict, not named_parameters: a tied lm_head is a key of its own there.
        return {f"policy.{n}" for n, t in self.policy.state_dict(keep_vars=True).items() if not t.requires_grad}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["rloo_skipped_steps"] = self.skipped_steps
        if self._moving_average is not None:
            checkpoint["rloo_moving_average"] = self._moving_average.state_dict()
        if self._stored_rollout is not None and self._rollout_updates < self.hparams.updates_per_rollout:
            # a checkpoint between two updates on one rollout: the resumed run goes on with it
            checkpoint["rloo_rollout"] = {"updates": self._rollout_updates,
                                          "fields": dataclasses.asdict(self._stored_rollout)}
        if self.hparams.ref_sync_steps and self._ref is not None:
            checkpoint["rloo_reference"] = self._ref.model.state_dict()  # it moves: keep it
        # LoRA: the base weights are the model on disk; the checkpoint holds the adapter only.
        for key in self._frozen_base_keys():
            checkpoint["state_dict"].pop(key, None)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.skipped_steps = checkpoint.get("rloo_skipped_steps", 0)
        if self._moving_average is not None and "rloo_moving_average" in checkpoint:
            self._moving_average.load_state_dict(checkpoint["rloo_moving_average"])
        if "rloo_rollout" in checkpoint:
            self._stored_rollout = Rollout(**checkpoint["rloo_rollout"]["fields"])
            self._rollout_updates = checkpoint["rloo_rollout"]["updates"]
        if "rloo_reference" in checkpoint and self._ref is not None:
            self._ref.model.load_state_dict(checkpoint["rloo_reference"])
        base = self._frozen_base_keys()  # configure_model has run: these are the base model's weights
        if base:
            current = self.state_dict()
            for key in base - checkpoint["state_dict"].keys():
                checkpoint["state_dict"][key] = current[key]

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        hp = self.hparams
        step = self.global_step
        if hp.ref_sync_steps and step > 0 and step % hp.ref_sync_steps == 0 and self.reference is not None:
            # TR-DPO / TRL sync_ref_model: the reference trails the policy. Done at the start of the
            # step (= after the previous optimizer step), so a checkpoint written at the end of the
            # previous step and a run resumed from it mix at the same point.
            # A sharded (FSDP2) policy's parameters are gathered first: the reference is replicated.
            policy = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in self.policy.parameters()]
            mix_into_reference(self.reference.parameters(), policy, hp.ref_sync_alpha)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        accumulate = self.trainer.accumulate_grad_batches if self._trainer is not None else 1
        if (batch_idx + 1) % accumulate == 0:  # an optimizer step happened: an engine with its own copy resyncs
            self.engine.on_weights_updated(self.policy)

    def on_before_optimizer_step(self, optimizer) -> None:
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        if grads and not self._finite_everywhere(*grads):
            self._on_nonfinite("gradient")
            # A parameter without .grad is left alone by torch optimizers: no update, no state change.
            for p in self.policy.parameters():
                p.grad = None

    # -- metrics -------------------------------------------------------------------------------
    def _log_train_metrics(
        self, rollout: Rollout, advantages: Tensor, entropy: Tensor, loss: Tensor
    ) -> dict[str, float]:
        """Log step metrics, each an exact global mean: sums and counts are all-reduced, not means."""
        mask, k = rollout.completion_mask, rollout.k
        valid = ~torch.isnan(rollout.rewards)
        stds = group_std(rollout.rewards, k)
        num_groups = torch.tensor(stds.shape[0])
        ones = torch.ones_like(rollout.rewards)
        sums = {
            # name: (sum, count)
            "train/reward": (torch.nan_to_num(rollout.rewards).sum(), valid.sum()),
            "train/reward_std": (stds.sum(), num_groups),
            "train/zero_std_groups": ((stds == 0).sum(), num_groups),
            "train/advantage_abs": (advantages.abs().sum(), ones.sum()),
            "train/completion_length": (mask.sum(), ones.sum()),
            "train/clipped_ratio": (rollout.truncated.sum(), ones.sum()),
            "train/entropy": (masked_sum(entropy, mask).sum(), mask.sum()),
            "train/loss": (loss.detach(), torch.tensor(1.0)),
        }
        if rollout.kl is not None:
            sums["train/kl"] = (rollout.kl.sum(), ones.sum())
        for name, (total, count) in (rollout.clip_stats or {}).items():
            sums[f"train/{name}"] = (torch.as_tensor(total), torch.as_tensor(count))
        for name, values in rollout.scores.items():
            ok = ~torch.isnan(values)
            sums[f"train/score/{name}"] = (torch.nan_to_num(values).sum(), ok.sum())
        names = list(sums)
        stacked = torch.stack([torch.stack([s.float().to(self.device), c.float().to(self.device)])
                               for s, c in sums.values()])
        stacked = self.reduce_across_ranks(stacked, "sum")
        means = (stacked[:, 0] / stacked[:, 1].clamp(min=1)).tolist()
        metrics = dict(zip(names, means))
        for name, value in metrics.items():
            self.log(name, value, prog_bar=name in ("train/reward", "train/kl"), batch_size=len(rollout.prompts))
        return metrics

    # -- validation ----------------------------------------------------------------------------
    def evaluate_batch(self, batch: dict, batch_idx: int) -> dict[str, Tensor]:
        """Per-prompt validation values: mean reward of ``val_num_samples`` sampled completions,
        pass@k, and greedy reward and accuracy. Keys are ``val_metrics`` names.

        The sampling seed depends on the batch only, not the step: every evaluation draws the
        same random stream, so that val curves compare policies rather than noise.
        """
        hp = self.hparams
        n = hp.val_num_samples
        sampled = self.rollout(batch, n, self.sampling_seed("val", batch_idx))
        self.score(sampled)
        rewards = sampled.rewards.view(-1, n)
        out = {"reward": rewards.nanmean(1)}
        successes = (rewards >= hp.success_threshold).sum(1)
        for pk in hp.val_pass_k or []:
            out[f"pass@{pk}"] = pass_at_k(successes, n, pk)
        if hp.val_greedy:
            greedy = self.rollout(batch, 1, 0, greedy=True)
            self.score(greedy)
            out["reward_greedy"] = greedy.rewards
            out["accuracy_greedy"] = (greedy.rewards >= hp.success_threshold).float()
        return out

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        for name, values in self.evaluate_batch(batch, batch_idx).items():
            metric = self.val_metrics[name]
            metric.update(values)
            self.log(f"val/{name}", metric, prog_bar=name == "reward",
                     batch_size=len(batch["prompt"]))

    # -- export --------------------------------------------------------------------------------
    def save_pretrained(self, directory: str) -> None:
        """Write the policy and tokenizer in Hugging Face format (``from_pretrained`` loads it).

        A LoRA policy is written merged into its base or as the adapter alone (``lora_export``).
        Under FSDP2 every rank must call this (the full weights are gathered, a collective); rank 0 writes.
        """
        model = self.policy
        sharded = any(hasattr(p, "full_tensor") for p in model.parameters())
        full_state = None
        if sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self._trainer is not None and not self.trainer.is_global_zero:
            return
        if self.hparams.lora and self.hparams.lora_export == "adapter":
            model.save_pretrained(directory)  # adapter_config.json + adapter weights
            self.tokenizer.save_pretrained(directory)
            return
        if self.hparams.lora:
            model = copy.deepcopy(model).merge_and_unload()
        if self.hparams.gguf_file or sharded:
            # A GGUF-loaded model refuses save_pretrained, and a sharded one holds shards: rebuild it
            # from its config and copy the (gathered) weights in.
            from transformers import AutoModelForCausalLM

            config = copy.deepcopy(model.config)
            # The weights written are dequantized: a kept `quantization_config: gguf` would make the
            # export look quantized (HF's Trainer then refuses to fine-tune it).
            if getattr(config, "quantization_config", None) is not None:
                del config.quantization_config
            rebuilt = AutoModelForCausalLM.from_config(config)
            rebuilt.load_state_dict(full_state if sharded else model.state_dict())
            model = rebuilt
        model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)
