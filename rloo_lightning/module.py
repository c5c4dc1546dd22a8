"""RLOOModule, the RL: ``training_step`` read top to bottom in numbered steps (rollout, rewards, log-probs, KL, sampler
correction, leave-one-out advantages, the REINFORCE loss, metrics), the pieces it calls and the hooks around its update.
The rest of a Lightning module around a sampled LM (models, engine checks, evaluation, export) is its base,
:class:`~rloo_lightning.policy_module.PolicyModule`."""

from __future__ import annotations

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor
from torchmetrics import MeanMetric

from rloo_lightning.algo.advantages import AdvantageEstimator
from rloo_lightning.algo.correction import importance_weights, mismatch_sums, weighted_advantages
from rloo_lightning.algo.correction import topr_advantages, with_rejection
from rloo_lightning.algo.kl import KLTerm
from rloo_lightning.algo.losses import PolicyLoss
from rloo_lightning.algo.shaping import shape_rewards
from rloo_lightning.callbacks.base import ValidateAtStart, call_rollout_hooks
from rloo_lightning.callbacks.checkpoint import FinalCheckpoint, ended_optimizer_step, start_next_epoch
from rloo_lightning.callbacks.predict import PredictionWriter
from rloo_lightning.callbacks.runtime import ProcessRuntime
from rloo_lightning.config import (
    AdvantageArgs, CorrectionArgs, DynamicSamplingArgs, EnvironmentArgs, KLArgs, PolicyArgs, PredictArgs, RewardArgs,
    RolloutArgs, RunArgs, SamplingArgs, ShapingArgs, UpdateArgs, ValidationArgs, GROUPS, Options, as_group,
    to_primitives,
)
from rloo_lightning.dynamic_sampling import informative_rollout
from rloo_lightning.engines import GenerationEngine, build_engine, engine_spec
from rloo_lightning.engines.decode import DecodeLoopEngine
from rloo_lightning.environments.sampler import EpisodeSampler
from rloo_lightning.metrics import (
    MissingRewardWatch, NoSignalWatch, global_means, log_step_metrics, single_values, train_metric_sums,
    write_to_loggers,
)
from rloo_lightning.models.policy import lora_config
from rloo_lightning.pipeline import RolloutPipeline, resumed_rollouts_ahead
from rloo_lightning.policy_module import PolicyModule
from rloo_lightning.reference import ReferencePolicy
from rloo_lightning.rewards import RewardSet
from rloo_lightning.rollout import CompletionSampler, GenerationContext, Rollout, derive_seed
from rloo_lightning.runtime import framework
from rloo_lightning.runtime.timing import PhaseTimer
from rloo_lightning.update import (
    GradientStash, NonFiniteError, NonFiniteGuard, PolicyUpdate, RolloutReuse, loss_denominators, micro_batches,
)

__all__ = ["RLOOModule", "NonFiniteError"]


class RLOOModule(PolicyModule):
    """RLOO (Ahmadian et al. 2024) for a Hugging Face causal LM.

    Each training step samples ``k`` completions for each prompt of the batch, scores them, folds
    the sequence KL to the reference into the reward, forms leave-one-out advantages and takes one
    on-policy REINFORCE step (no importance ratio, no clip). Every option is a field of one group
    (:mod:`rloo_lightning.config`); ``rloo-lightning fit --help`` lists them with their help.

    Args:
        model_name_or_path: policy to train: hub id, local directory, or ``tiny:<task>``.
        rewards: what scores a completion (``RewardArgs``: ``funcs`` is required, except by ``predict``).
        sampling: how completions are sampled (``SamplingArgs``: ``k``, ``max_new_tokens``, ``temperature``...).
        shaping: training-reward shaping, all off by default (``ShapingArgs``).
        kl: the KL term and the reference (``KLArgs``: ``beta``, ``estimator``, ``placement``...).
        advantage: the baseline and advantage transforms (``AdvantageArgs``).
        update: the loss, rollout reuse, micro-batching, NaN handling, warm-up (``UpdateArgs``).
        correction: importance correction for an engine that is not exactly pi_theta, off by default
            (``CorrectionArgs``).
        rollout: when each step's rollout is sampled: by the step (default) or ``lag`` steps ahead,
            from older weights, while the steps between train (``RolloutArgs``).
        dynamic_sampling: DAPO's dynamic sampling, off by default (``DynamicSamplingArgs``).
        validation: what ``val/*`` measures (``ValidationArgs``).
        policy: loading and training the policy: GGUF, LoRA, gradient checkpointing (``PolicyArgs``).
        predict: what ``predict`` samples and where it writes (``PredictArgs``).
        environment: multi-turn episodes in an environment, off by default (``EnvironmentArgs``).
        generation_engine: what samples the completions (:class:`~rloo_lightning.engines.GenerationEngine`;
            default: :class:`~rloo_lightning.engines.decode.DecodeLoopEngine`, a decode loop over the policy's KV cache;
            :class:`~rloo_lightning.engines.HFGenerateEngine` is the policy's own ``generate``). In YAML
            ``{class_path: my.Engine, init_args: {...}}``.
        run: what a fit writes besides the weights: ``last.ckpt`` every N steps, phase times (``RunArgs``).
        optimizer: optimizer factory (default AdamW, lr 1e-6 as in the paper).
        lr_scheduler: scheduler factory (default: linear warm-up then constant).
    """

    def __init__(
        self,
        model_name_or_path: str,
        rewards: RewardArgs,
        sampling: SamplingArgs = SamplingArgs(),
        shaping: ShapingArgs = ShapingArgs(),
        kl: KLArgs = KLArgs(),
        advantage: AdvantageArgs = AdvantageArgs(),
        update: UpdateArgs = UpdateArgs(),
        correction: CorrectionArgs = CorrectionArgs(),
        rollout: RolloutArgs = RolloutArgs(),
        dynamic_sampling: DynamicSamplingArgs = DynamicSamplingArgs(),
        validation: ValidationArgs = ValidationArgs(),
        policy: PolicyArgs = PolicyArgs(),
        predict: PredictArgs = PredictArgs(),
        environment: EnvironmentArgs = EnvironmentArgs(),
        run: RunArgs = RunArgs(),
        generation_engine: GenerationEngine | None = None,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__()
        given = dict(rewards=rewards, sampling=sampling, shaping=shaping, kl=kl, advantage=advantage, update=update,
                     correction=correction, rollout=rollout, dynamic_sampling=dynamic_sampling,
                     validation=validation, policy=policy, predict=predict, environment=environment, run=run)
        cfg = {name: as_group(GROUPS[name], value) for name, value in given.items()}
        if isinstance(generation_engine, dict):  # load_from_checkpoint: the engine as the checkpoint names it
            generation_engine = build_engine(generation_engine)
        # The engine is part of the run: the checkpoint names it, so that validate, test, predict and a resume
        # rebuild it (None: the default engine; an engine that cannot be named is said at fit start).
        engine_args, self._engine_unnamed = engine_spec(generation_engine) if generation_engine else (None, None)
        # Options are stored as given (correction.level auto stays auto) and resolved here, for this engine.
        self.cfg = Options(**cfg)
        self._correction_given = cfg["correction"]
        # Stale rollouts (rollout.lag) are corrected from the sampler's log-probs: the default engine
        # then reports them.
        self.use_engine(generation_engine or DecodeLoopEngine(return_logprobs=self.cfg.rollout.lag > 0))
        if self.cfg.policy.lora is not None:
            lora_config(self.cfg.policy.lora)  # peft missing or a wrong key fails now, before any model is loaded
        # Checkpoints hold plain dicts of primitives: load_from_checkpoint rebuilds the groups from them.
        self.save_hyperparameters({"model_name_or_path": model_name_or_path, **to_primitives(cfg),
                                   "generation_engine": engine_args})
        #: Set by the CLI when the engine was rebuilt from the checkpoint rather than given: validate, test and
        #: predict then fall back to the default engine when it cannot run here (see :meth:`setup`).
        self.engine_from_checkpoint = False
        c = self.cfg
        self.timer = PhaseTimer(enabled=c.run.time_phases)
        # Reward import paths resolve now: a typo fails before any model is loaded. None: predict without scores.
        self.rewards = RewardSet.from_specs(c.rewards.funcs, c.rewards.weights, timeout=c.rewards.timeout,
                                            num_workers=c.rewards.workers, on_error=c.rewards.on_error,
                                            chunk_size=c.rewards.chunk_size) if c.rewards.funcs else None
        # Multi-turn: the environment class is imported now, for the same reason.
        self.episodes = EpisodeSampler(c.environment) if c.environment.class_path else None
        self.sampler = self.episodes if self.episodes is not None else CompletionSampler()  # step 1, behind sample
        # The options plug in as small objects at their point of the step (6: advantages, 7: the loss).
        self.advantage_estimator = AdvantageEstimator.from_args(c.advantage, c.sampling.k)
        self.kl_term = KLTerm.from_args(c.kl)
        self.policy_loss = PolicyLoss.from_args(c.update, c.kl)
        self.reuse = RolloutReuse(c.update.updates_per_rollout)
        # rollout.lag K >= 1: the rollouts ahead, sampled K steps before the step that trains on them.
        lag = c.rollout.lag
        self.pipeline = RolloutPipeline(lag, c.update.updates_per_rollout, host=self) if lag else None
        self.grad_stash = GradientStash()
        self.optimizer_factory, self.scheduler_factory = optimizer, lr_scheduler
        self.policy: torch.nn.Module | None = None
        self.tokenizer = None
        self.ref: ReferencePolicy | None = None  # pi_ref when beta > 0 (reference.py), set by attach
        self.guard = NonFiniteGuard(c.update.on_nonfinite)
        self._last_stats: dict[str, float] = {}
        self.no_signal = NoSignalWatch()
        self.missing_rewards = MissingRewardWatch(c.rewards.stop_after_missing_steps)
        # The KL coefficient in use; a buffer so that an adaptive controller's value is checkpointed.
        self.register_buffer("beta", torch.tensor(float(c.kl.beta)))
        names = ["reward"] + (["reward_greedy", "accuracy_greedy"] if c.validation.greedy else [])
        names += [f"pass@{pk}" for pk in c.validation.pass_k or []]
        self.val_metrics = torch.nn.ModuleDict({n: MeanMetric(nan_strategy="ignore") for n in names})  # val/<name>
        self.test_metrics = torch.nn.ModuleDict({n: MeanMetric(nan_strategy="ignore") for n in names})  # test/<name>

    def configure_callbacks(self):
        # A resumable last.ckpt of the final step whatever the validation cadence (never replaces a ModelCheckpoint).
        callbacks = [FinalCheckpoint(self.cfg.run.checkpoint_every_n_steps, self.cfg.run.checkpoint_every_minutes),
                     PredictionWriter(self.cfg.predict.output_file)]
        callbacks += [ValidateAtStart()] if self.cfg.validation.at_start else []
        # CPU threads, and where the run is for a stop signal: last, its hooks run after the others' (but Lightning's
        # ModelCheckpoints, always last).
        return callbacks + [ProcessRuntime()]

    # -- the training step ---------------------------------------------------------------------
    def training_step(self, batch: dict, batch_idx: int) -> Tensor | None:
        c = self.cfg
        rollout = self.reuse.take(batch)  # update.updates_per_rollout > 1: the stored rollout, while it has updates
        fresh = rollout is None
        if self.pipeline is not None:
            # 1. (rollout.lag K >= 1) Submit step g + K's rollout from these weights, and take this step's,
            #    sampled from the weights of step g - K while the steps between trained (pipeline.py); step 5
            #    corrects it against pi_theta.
            with self.generating(in_step=True):
                ahead = self.pipeline.rollout(batch, batch_idx, self.global_step, take=fresh)
            rollout = ahead if fresh else rollout
        elif fresh:
            # 1. Rollout: k samples per prompt from pi_theta itself (explicit sampler, seeded by step): on-policy,
            #    as the REINFORCE estimator of step 7 assumes (no importance ratio).
            rollout = self.sample(batch, c.sampling.k, self.sampling_seed("train", self.global_step), in_step=True)
        if fresh:
            # 2. Rewards: weighted sum of the reward functions (NaN = missing), then the optional shaping.
            with self.ranks_agree("after scoring", signals=False):
                rollout.scores, rollout.rewards = self.score(rollout)
            if c.dynamic_sampling.enabled:  # DAPO: more prompts until every group's rewards differ
                rollout = informative_rollout(self, rollout, len(batch["prompt"]))
        # 3.-7. Log-probs, KL, sampler correction, advantages, loss (rollout_loss, below).
        loss, entropy = self.rollout_loss(rollout)
        self.reuse.record(rollout)
        # 8. Metrics, exact global means; a NaN/inf loss drops the update on every rank (update.on_nonfinite).
        self._last_stats = self.log_train_metrics(rollout, entropy, loss)
        if not self.guard.finite(self.reduce_across_ranks, loss):
            self._on_nonfinite("loss")
            return None  # every rank skips together: no backward, no optimizer step
        return loss

    def rollout_loss(self, rollout: Rollout) -> tuple[Tensor, Tensor | None]:
        """Steps 3-7 on a scored rollout: the loss for Lightning's backward, and per-token entropy ``[B, T]``.

        A rollout reused for a later update (``update.updates_per_rollout > 1``) only goes through step 7.
        """
        c = self.cfg
        fresh = rollout.old_logp is None
        update = PolicyUpdate(lambda rows, with_entropy: self.logprobs(self.policy, rollout, rows, with_entropy),
                              micro_batches(rollout.completion_mask.shape[0], c.update.micro_batch_size), self.timer)
        # 3. Log-probs at the sampling temperature, of the distribution sampled: the policy's, detached, where steps
        #    4-5 and a reused rollout need them (one micro-batch: the update's own forward, kept for step 7); the
        #    reference's without grad.
        with self.timer("policy_logprobs"):
            logp = update.detached_logprobs(fresh and (self.ref is not None or c.update.updates_per_rollout > 1
                                                       or rollout.sampler_logp is not None))
        if fresh:
            if self.ref is not None:
                with self.timer("reference"):
                    rollout.ref_logp = self.reference_logprobs(rollout, update.rows)
            # 4. KL on the sequence (k1), detached, folded into the reward *before* the baseline:
            #    R = r - beta * log pi(y)/pi_ref(y) (paper Sec. 2.3), unbiased for E[r] - beta*KL (algo/kl.py: KLTerm).
            rollout.token_kl, rollout.kl, baseline_rewards = self.kl_term.fold(
                rollout.rewards, logp, rollout.ref_logp, rollout.completion_mask, self.beta)
            rollout.baseline_rewards = self.advantage_estimator.normalize(baseline_rewards, self.reduce_across_ranks)
            # 5. An engine that reports log pi_s: how far it is from pi_theta, and (correction.level) the detached
            #    weights pi_theta/pi_s for step 7 (importance sampling; TIS: Yao et al. 2025), kept for a reused
            #    rollout's later updates (their clipped ratio is pi_theta/pi_theta_old: the weight corrects
            #    pi_theta_old against the sampler, once).
            rollout.mismatch, rollout.is_weights = self.correct_sampler(rollout, logp)
            # 6. Leave-one-out advantages per prompt group: A_i = R_i - mean_{j != i} R_j (paper Eq. 4).
            #    Callbacks see the rollout first and may drop rows (advantage 0) or edit baseline_rewards.
            rollout.keep = ~rollout.truncated if c.shaping.mask_truncated_completions else \
                torch.ones_like(rollout.truncated, dtype=torch.bool)
            call_rollout_hooks(self.run_by, self, "on_rollout", rollout)
            rollout.advantages = self.advantage_estimator(rollout.baseline_rewards, rollout.keep,
                                                          self.reduce_across_ranks)
            rollout.token_advantages = self.kl_term.token_advantages(rollout.advantages, rollout.token_kl,
                                                                     rollout.loss_mask, float(self.beta))
        # 7. Sequence-level REINFORCE: -1/S sum_i A_i sum_t m_t logp_t over the kept sequences (paper Sec. 3.1).
        loss, entropy, rollout.clip_stats = self.update_loss(rollout, update)
        if fresh and c.update.updates_per_rollout > 1:
            rollout.old_logp = logp  # pi_theta_old of the later updates on this rollout (detached)
        if fresh:
            call_rollout_hooks(self.run_by, self, "on_rollout_end", rollout)
        return loss, entropy

    # -- the pieces of a step ------------------------------------------------------------------
    def sampling_seed(self, stream: str, step: int) -> int:
        """Seed of one generation call, from (seed, rank, stream, step)."""
        return derive_seed(self.cfg.sampling.seed, self.global_rank, stream, step)

    def sample(self, batch: dict, k: int, seed: int, greedy: bool = False, in_step: bool = False) -> Rollout:
        """Step 1: ``k`` completions (or episodes) per prompt of ``batch`` from the policy, as a new :class:`Rollout`.

        ``in_step``: a training step's rollout. A stop signal or a failure on any rank then ends the run here, every
        rank together (:meth:`ranks_agree`), before anything of it is kept."""
        config = self.greedy_config if greedy else self.generation_config
        with self.generating(in_step):
            return self.sampler.sample(self.generation_context(), batch, k, config, seed)

    def submit_rollout(self, batch: dict, seed: int):
        """Start :meth:`sample` of ``batch`` from the weights as they are (the pipeline's rollouts ahead): a handle
        for :meth:`collect_rollout`, or the rollout itself from a sampler that cannot overlap (multi-turn)."""
        context, k = self.generation_context(), self.cfg.sampling.k
        if hasattr(self.sampler, "submit"):
            return self.sampler.submit(context, batch, k, self.generation_config, seed)
        return self.sampler.sample(context, batch, k, self.generation_config, seed)

    def collect_rollout(self, handle) -> tuple[Rollout, float | None]:
        """The rollout of a :meth:`submit_rollout` handle, and the engine's seconds on it when it says."""
        return self.sampler.collect(self.generation_context(), handle)

    def batch_on_device(self, batch: dict) -> dict:
        """A batch drawn outside the loader (dynamic sampling's rounds, the rollouts ahead) with its tensors here."""
        return {key: v.to(self.device) if isinstance(v, Tensor) else v for key, v in batch.items()}

    def generation_context(self) -> GenerationContext:
        """What a sampler needs of the module: the policy, tokenizer, engine, grad-free context and reduction."""
        return GenerationContext(self.policy, self.tokenizer, self.engine, self._grad_free(), self.reduce_across_ranks)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if getattr(stage, "value", stage) == "fit" and self.pipeline is not None:
            self.pipeline.check_setup(self.run_by, self.cfg.correction, self.cfg.update.updates_per_rollout)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self.pipeline is not None:
            self.pipeline.start(self.run_by)

    def score(self, rollout: Rollout, shape: bool = True, rewards: bool = True) -> tuple[dict[str, Tensor], Tensor]:
        """Step 2: ``(scores, rewards)``: ``{name: [B]}`` per reward function and the task reward ``[B]``, their
        weighted sum, with the ``shaping`` penalties unless ``shape`` is False (validation scores unshaped).

        A multi-turn rollout adds its environment's reward, as the score ``environment`` (weight 1); ``rewards``
        False: that one alone (predict on prompts without the reward functions' columns)."""
        with self.timer("reward"):
            total, per_func = torch.zeros(len(rollout.prompts)), {}
            if self.rewards is not None and rewards:
                total, per_func = self.rewards.score(rollout.prompts, rollout.completions,
                                                     rollout.completion_token_lists(), rollout.columns)
            if rollout.episodes is not None:
                env = rollout.episodes.rewards
                total, per_func = total.to(self.device) + env, {**per_func, "environment": env}
            rewards = total.to(self.device)
            if shape:
                rewards = shape_rewards(rewards, rollout.completion_mask, rollout.missing_eos, self.cfg.shaping,
                                        self.cfg.sampling.max_new_tokens)
            return {name: v.to(self.device) for name, v in per_func.items()}, rewards

    def reference_logprobs(self, rollout: Rollout, rows: list[slice]) -> Tensor:
        """Step 3: ``[B, T]`` log-probs of the completions under the reference, one micro-batch at a time."""
        return self.ref.logprobs(self.policy, lambda model, r: self.logprobs(model, rollout, r)[0], rows,
                                 self._grad_free(), self.device)

    def correct_sampler(self, rollout: Rollout, logp: Tensor | None) -> tuple[dict, Tensor | None]:
        """Step 5: ``(mismatch, is_weights)``: the sampler's mismatch sums (``train/mismatch/*``) and, with
        ``correction.level``, the detached importance weights pi_theta/pi_s (else None).

        Nothing for an engine that reports no log-probs (``logp`` may then be None), unless a correction is asked.
        """
        c = self.cfg.correction
        if rollout.sampler_logp is None:
            if c.level != "none":
                raise ValueError(f"correction.level={c.level!r}, but {type(self.engine).__name__} returned no "
                                 "log-probs with its ids: there is nothing to correct with")
            return {}, None
        logp = logp.detach()
        mismatch = mismatch_sums(logp, rollout.sampler_logp, rollout.completion_mask)
        if c.level == "none":
            return mismatch, None
        # Over the policy's tokens only (completion_mask: an episode's environment tokens are off it).
        args = (logp, rollout.sampler_logp, rollout.completion_mask)
        weights = importance_weights(*args, c.level, c.mode, c.cap, c.lower)
        if c.reject != "none":
            weights = with_rejection(weights, *args, c.reject, c.reject_lower, c.reject_upper)
        return mismatch, weights

    def update_loss(self, rollout: Rollout, update: PolicyUpdate) -> tuple[Tensor, Tensor | None, dict]:
        """Step 7: ``(loss, entropy [B, T], clip statistics)`` by ``update``, one micro-batch at a time.

        The denominators are fixed over the whole rollout (and every rank) first, so that the micro-batch losses add
        up to the rollout's. Every micro-batch but the last is differentiated as it comes and its gradient held in
        ``grad_stash`` (``update.GradientStash``: injected in :meth:`on_before_backward`, so that Lightning's one
        backward carries the whole rollout's gradient).
        """
        c = self.cfg
        denominators = loss_denominators(rollout, self.reduce_across_ranks, self.world_size,
                                         c.update.loss_norm_constant or c.sampling.max_new_tokens)
        advantages = rollout.token_advantages if rollout.token_advantages is not None else rollout.advantages
        if rollout.is_weights is not None:  # correction.level: w_i (or w_it) times (R_i - b_i), detached
            weigh = topr_advantages if c.correction.level == "topr" else weighted_advantages
            advantages = weigh(advantages, rollout.is_weights)
        scaler = getattr(self.run_by.precision_plugin, "scaler", None)
        self.grad_stash.grads = None
        return update.loss(self.policy_loss, rollout, advantages, denominators, self.beta,
                           lambda loss: self.grad_stash.backward_early(loss, self.policy, scaler))

    # -- Lightning hooks around the optimizer step ---------------------------------------------
    def on_before_backward(self, loss: Tensor) -> None:
        self.grad_stash.inject(self.policy)  # the earlier micro-batches' gradients join the last one's

    def on_before_optimizer_step(self, optimizer) -> None:
        # The step's end: the rollouts in flight collected, unless the engine keeps each version's weights while its
        # requests run (pipeline.py). Before the update, and agreed by every rank: an engine failing here ends every
        # rank with the step before.
        if self.pipeline is not None:
            with self.ranks_agree("collecting the rollouts ahead", signals=False):
                self.pipeline.step_end(self.engine.keeps_versions)
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        if grads and not self.guard.finite(self.reduce_across_ranks, *grads):
            self._on_nonfinite("gradient")
            for p in self.policy.parameters():  # torch optimizers leave a parameter without .grad alone
                p.grad = None

    def _on_nonfinite(self, what: str) -> None:
        self.guard.handle(what, self.global_step, self._last_stats)  # raises under update.on_nonfinite=stop
        self.log("train/skipped_steps", float(self.guard.skipped_steps))

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self.ref is not None:
            self.ref.sync(self.policy, self.global_step, self.device)  # kl.ref_sync_steps: TR-DPO (reference.py)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if ended_optimizer_step(self.run_by, batch_idx):  # an optimizer step happened: an engine's own copy resyncs
            self.engine.on_weights_updated(self.policy)

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoint_entries(self, step_end: bool = False) -> dict:
        """This module's own checkpoint entries (``rloo_*``), as a checkpoint written now holds them; FinalCheckpoint
        keeps them at each step's end (``step_end``: the rollouts ahead may then be a deferred entry, collected when
        that checkpoint is written), for a stop that abandons the next step (callbacks/checkpoint.py)."""
        entries = {"rloo_skipped_steps": self.guard.skipped_steps}
        if self.advantage_estimator.moving_average is not None:
            entries["rloo_moving_average"] = self.advantage_estimator.state_dict()
        if (stored := self.reuse.state_dict()) is not None:  # between two updates on one rollout: the resumed run
            entries["rloo_rollout"] = {"ranks": self.gather_across_ranks(stored)}  # goes on, each rank with its own
        if self.ref is not None and (state := self.ref.state_dict()) is not None:
            entries["rloo_reference"] = state  # kl.ref_sync_steps: it moves, keep it
        if self.pipeline is not None:  # the K rollouts ahead; each rank's own (its own prompts)
            entries["rloo_pipeline"] = (
                self.pipeline.step_end_entry(self.gather_across_ranks, self.engine.keeps_versions) if step_end
                else self.pipeline.checkpoint_entry(self.gather_across_ranks))
        return entries

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint.update(self.checkpoint_entries())
        start_next_epoch(checkpoint.get("loops"))  # after an epoch's end: resumed, the next epoch starts afresh

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)  # another model's checkpoint refused; a LoRA base filled in
        self.guard.skipped_steps = checkpoint.get("rloo_skipped_steps", 0)
        self.advantage_estimator.load_state_dict(checkpoint.get("rloo_moving_average", {}))
        if "rloo_rollout" in checkpoint:
            self.reuse.load_rank(checkpoint["rloo_rollout"], self.global_rank, self.world_size)
        if "rloo_reference" in checkpoint and self.ref is not None:
            self.ref.load_state_dict(checkpoint["rloo_reference"])
        trainer = framework.module_trainer(self)
        if trainer is not None and getattr(trainer.state.fn, "value", trainer.state.fn) == "fit":  # a resumed fit
            ahead = resumed_rollouts_ahead(checkpoint, self.cfg.rollout.lag, self.world_size,
                                           self.global_rank)  # another lag is refused
            if self.pipeline is not None:
                self.pipeline.resume(ahead)

    # -- metrics -------------------------------------------------------------------------------
    def log_train_metrics(self, rollout: Rollout, entropy: Tensor, loss: Tensor) -> dict[str, float]:
        """Log the step's metrics, each an exact global mean: sums and counts are all-reduced, not means."""
        sums = train_metric_sums(rollout, entropy, loss)
        if self.pipeline is not None:  # staleness, the trainer's wait, the engine's idle time, the queue
            sums.update(single_values(self.pipeline.metrics(self.global_step)))
        sums.update(single_values(getattr(self.engine, "metrics", dict)()))  # an engine's own: weight syncs, ...
        metrics = global_means(sums, self.reduce_across_ranks, self.device)
        trainer = framework.module_trainer(self)  # None: a module driven by hand logs nothing
        log_step_metrics(trainer, metrics, self.global_step, prog_bar=("train/reward", "train/kl"))
        self.no_signal.update(metrics["train/zero_std_groups"], self.global_step)
        self.missing_rewards.update(metrics, self.global_step, rollout.prompts)  # every rank: the means are global
        if self.timer.enabled:
            # to the loggers only, not to callback_metrics: seconds per phase are for reading, not monitoring
            write_to_loggers(trainer, {f"time/{phase}": t for phase, t in self.timer.totals.items()},
                             self.global_step)
        return metrics

