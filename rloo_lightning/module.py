"""RLOOModule: rollout in ``training_step``, leave-one-out advantages, sequence-level REINFORCE loss."""

from __future__ import annotations

import copy

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torchmetrics import MeanMetric

from rloo_lightning.runtime import sigterm
from rloo_lightning.algo.advantages import AdvantageEstimator
from rloo_lightning.callbacks.base import RolloutHook, ValidateAtStart
from rloo_lightning.callbacks.checkpoint import FinalCheckpoint, ended_optimizer_step, start_next_epoch
from rloo_lightning.callbacks.predict import PredictionWriter, prediction_rows
from rloo_lightning.config import (
    AdvantageArgs, CorrectionArgs, DynamicSamplingArgs, EnvironmentArgs, KLArgs, PolicyArgs, PredictArgs, RewardArgs,
    RunArgs, SamplingArgs, ShapingArgs, UpdateArgs, ValidationArgs, GROUPS, Options, as_group, check_options,
    to_primitives,
)
from rloo_lightning.algo.correction import importance_weights, mismatch_sums, weighted_advantages
from rloo_lightning.engines.decode import DecodeLoopEngine
from rloo_lightning.dynamic_sampling import fill_informative
from rloo_lightning.engines import GenerationEngine, build_engine, engine_spec
from rloo_lightning.algo.kl import KLTerm
from rloo_lightning.forward import sequence_logprobs, worth_sharing
from rloo_lightning.algo.losses import PolicyLoss
from rloo_lightning.metrics import (
    MissingRewardWatch,
    NoSignalWatch,
    log_step_metrics,
    pass_at_k,
    step_means,
    train_metric_sums,
    write_to_loggers,
)
from rloo_lightning.environments.sampler import EpisodeSampler
from rloo_lightning.models import sharding
from rloo_lightning.models.policy import (check_checkpoint_fits, disable_dropout, export_pretrained, load_models,
                                          lora_config, prepare_policy)
from rloo_lightning.rewards import RewardSet
from rloo_lightning.rewards.model import RewardModel
from rloo_lightning.reference import ReferencePolicy
from rloo_lightning.algo.shaping import shape_rewards
from rloo_lightning.rollout import Rollout, default_eos_ids, derive_seed
from rloo_lightning.rollout import generate_rollout, generation_configs
from rloo_lightning.runtime.threads import use_threads
from rloo_lightning.runtime.timing import PhaseTimer
from rloo_lightning.update import (
    GradientStash, NonFiniteError, NonFiniteGuard, RolloutReuse, loss_denominators, micro_batches,
)

__all__ = ["RLOOModule", "NonFiniteError", "warmup_constant_schedule"]


def warmup_constant_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int):
    """Linear warm-up from ~0 to the base rate over ``warmup_steps``, then constant (the paper's schedule)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / max(1, warmup_steps)))


class RLOOModule(LightningModule):
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
                     correction=correction, dynamic_sampling=dynamic_sampling, validation=validation, policy=policy,
                     predict=predict, environment=environment, run=run)
        cfg = {name: as_group(GROUPS[name], value) for name, value in given.items()}
        if isinstance(generation_engine, dict):  # load_from_checkpoint: the engine as the checkpoint names it
            generation_engine = build_engine(generation_engine)
        # The engine is part of the run: the checkpoint names it, so that validate, test, predict and a resume
        # rebuild it (None: the default engine; an engine that cannot be named is said at fit start).
        engine_args, self._engine_unnamed = engine_spec(generation_engine) if generation_engine else (None, None)
        # Options are stored as given (correction.level auto stays auto) and resolved here, for this engine.
        self.cfg = Options(**cfg)
        self._correction_given = cfg["correction"]
        self.use_engine(generation_engine or DecodeLoopEngine())
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
        # The options plug in as small objects at their point of the step (5: advantages, 6: the loss).
        self.advantage_estimator = AdvantageEstimator.from_args(c.advantage, c.sampling.k)
        self.kl_term = KLTerm.from_args(c.kl)
        self.policy_loss = PolicyLoss.from_args(c.update, c.kl)
        self.reuse = RolloutReuse(c.update.updates_per_rollout)
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

    def setup(self, stage: str) -> None:
        # Before any model is loaded (Lightning calls configure_model after this).
        if self._trainer is not None:
            sigterm.attach(self._trainer)  # a SIGTERM from now to the first step ends the run at once (sigterm.py)
            # Before any model is loaded: every rank of this node shares its CPUs (threads.py)
            rank_zero_info(use_threads(getattr(self._trainer, "num_devices", 1)))
        stage = getattr(stage, "value", stage)  # Lightning passes a TrainerFn ("fit", "validate", ...)
        self._check_engine(self._trainer.strategy.root_device if self._trainer is not None else torch.device("cpu"),
                           stage)
        if self.rewards is None and self.episodes is None and stage != "predict":
            raise ValueError(f"rewards.funcs must name at least one reward function: {stage} scores completions "
                             "(only predict runs without, and an environment.class_path that gives the rewards)")
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if self.episodes is not None and datamodule is not None:
            self.episodes.check_data(datamodule)
        if self.rewards is not None and stage != "predict":
            added = list(self.episodes.columns) if self.episodes is not None else []  # a multi-turn rollout's
            for source, names in getattr(datamodule, "columns", lambda stage: [])(stage):
                self.rewards.check_columns([*names, *added], source)  # the data's own columns, before the model loads

    def use_engine(self, engine: GenerationEngine) -> None:
        """Sample with ``engine``: ``correction.level: auto`` becomes its ``default_correction`` (config.py)."""
        self.engine = engine
        self.cfg.correction = self._correction_given.for_engine(engine)
        check_options(self.cfg)

    def _check_engine(self, device: torch.device, stage: str) -> None:
        """Whether the engine runs here (its ``check``), and (fit) whether it gives what the correction needs.

        An engine rebuilt from the checkpoint (not given for this command) that cannot run here (vLLM not
        installed, an argument only a GPU takes) gives way to the default engine for validate, test and predict,
        with one line saying so; fit (a resume) stops instead: another sampler would change the run.
        """
        try:
            self.engine.check(device)
        except Exception as err:
            if stage == "fit" or not self.engine_from_checkpoint:
                raise
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            rank_zero_warn(f"the checkpoint's generation engine {type(self.engine).__name__} cannot run here "
                           f"({reason}): {stage} samples with the default engine, DecodeLoopEngine "
                           "(--model.generation_engine chooses another)")
            self.use_engine(DecodeLoopEngine())
        c = self.cfg.correction
        if stage == "fit" and c.level != "none" and self.engine.reports_logprobs is False:
            raise ValueError(f"correction.level={c.level!r} needs an engine that reports its log-probs; "
                             f"{type(self.engine).__name__} does not (DecodeLoopEngine or HFGenerateEngine: "
                             "return_logprobs=true; or --model.generation_engine the engine it was trained with)")

    # -- models --------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Load policy, tokenizer and (if beta > 0) reference; idempotent (Lightning may call it twice)."""
        if self.policy is not None:
            return
        policy, tokenizer, reference = load_models(self.hparams.model_name_or_path, self.cfg.policy,
                                                   self.cfg.kl.beta > 0, self._strategy)
        self.attach(policy, tokenizer, reference)
        for fn in self.rewards.funcs if self.rewards is not None else []:
            if isinstance(fn, RewardModel):
                with sharding.replicated_init_context(self._strategy):  # ZeRO-3: built whole, not partitioned
                    fn.load()  # a wrong reward model (e.g. several labels) fails before training starts

    def attach(self, policy: torch.nn.Module, tokenizer, reference: torch.nn.Module | None = None) -> None:
        """Take a loaded policy (and tokenizer) to train: the reference, options and sampler configs follow.

        ``configure_model`` calls this with the models it loads; tests and the exactness check call it
        with models of their own. The reference is the initial policy: a copy, not a second load (a GGUF
        load dequantizes), made before FSDP2 shards the policy; under LoRA it is the same model with the
        adapter disabled (:class:`~rloo_lightning.reference.ReferencePolicy`).
        """
        c = self.cfg
        self.tokenizer = tokenizer
        if c.kl.beta > 0:
            own = None if c.policy.lora else reference if reference is not None else copy.deepcopy(policy)
            self.ref = ReferencePolicy(own, c.kl.ref_sync_steps, c.kl.ref_sync_alpha)
        self.policy = prepare_policy(policy, c.policy)
        self._policy_params = sum(p.numel() for p in self.policy.parameters())  # before sharding: the whole model
        if c.policy.disable_dropout:
            disable_dropout(self.policy, self.ref.copy if self.ref is not None else None)
        if self.device_mesh is not None:
            # ModelParallelStrategy: FSDP2 on the policy alone (each decoder layer, then the root), over the
            # data-parallel mesh; the reference above was copied before this and stays whole.
            sharding.shard_policy(self.policy, self.device_mesh)
        self.eos_token_ids = c.sampling.eos_token_ids or default_eos_ids(tokenizer, self.policy.generation_config)
        self.generation_config, self.greedy_config = generation_configs(c.sampling, self.eos_token_ids,
                                                                        tokenizer.pad_token_id)
        self.engine.prepare(self.policy, tokenizer, self.generation_config)  # refusals before any rollout

    @property
    def reference(self) -> torch.nn.Module | None:
        """The reference's own model on this module's device, in the policy's dtype (None when beta == 0 or under
        LoRA, where the reference is the policy with its adapter disabled)."""
        return self.ref.model(self.policy, self.device) if self.ref is not None and self.ref.copy is not None \
            else None

    @property
    def _strategy(self):
        return self._trainer.strategy if self._trainer is not None else None

    def teardown(self, stage: str) -> None:
        if self.rewards is not None:
            self.rewards.close()

    def configure_callbacks(self):
        # A resumable last.ckpt of the final step whatever the validation cadence (never replaces a ModelCheckpoint).
        callbacks = [FinalCheckpoint(every_n_steps=self.cfg.run.checkpoint_every_n_steps),
                     PredictionWriter(self.cfg.predict.output_file)]
        return callbacks + ([ValidateAtStart()] if self.cfg.validation.at_start else [])

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-6) if self.optimizer_factory is None else self.optimizer_factory(
            params)
        if self.scheduler_factory is not None:
            scheduler = self.scheduler_factory(optimizer)
        else:
            total = self.trainer.estimated_stepping_batches
            scheduler = warmup_constant_schedule(optimizer, self.cfg.update.warmup_steps(total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- the training step ---------------------------------------------------------------------
    def training_step(self, batch: dict, batch_idx: int) -> Tensor | None:
        c = self.cfg
        rollout = self.reuse.take(batch)  # update.updates_per_rollout > 1: the stored rollout, while it has updates
        if rollout is None:
            # 1. Rollout: k samples per prompt from pi_theta itself (explicit sampler, seeded by step).
            rollout = self.sample(batch, c.sampling.k, self.sampling_seed("train", self.global_step))
            sigterm.end_step(self._trainer, "after generation")  # a SIGTERM during it: every rank stops here together
            # 2. Rewards: weighted sum of the reward functions (NaN = missing), then the optional shaping.
            rollout.scores, rollout.rewards = self.score(rollout)
            if c.dynamic_sampling.enabled:  # DAPO: more prompts until every group's rewards differ
                rollout = self.informative_rollout(rollout, len(batch["prompt"]))
        # 3.-6. Log-probs, KL, advantages, loss.
        loss, entropy = self.rollout_loss(rollout)
        self.reuse.record(rollout)
        self._last_stats = self.log_train_metrics(rollout, entropy, loss)
        if not self.guard.finite(self.reduce_across_ranks, loss):
            self._on_nonfinite("loss")
            return None  # every rank skips together: no backward, no optimizer step
        return loss

    def rollout_loss(self, rollout: Rollout) -> tuple[Tensor, Tensor]:
        """Steps 3-6 on a scored rollout: the loss for Lightning's backward, and per-token entropy ``[B, T]``.

        A rollout reused for a later update (``update.updates_per_rollout > 1``) only goes through step 6.
        """
        c = self.cfg
        fresh = rollout.old_logp is None
        rows = micro_batches(rollout.completion_mask.shape[0], c.update.micro_batch_size)
        # 3. Log-probs at the sampling temperature: the policy's with grad when the rollout is one micro-batch
        #    (else without, only where steps 4-5 need them, and with grad per micro-batch in step 6); the
        #    reference's without grad.
        logp = entropy = None
        with self.timer("policy_forward"):
            if len(rows) == 1:
                logp, entropy = self.logprobs(self.policy, rollout, with_entropy=True)
            elif fresh and (self.ref is not None or c.update.updates_per_rollout > 1
                            or rollout.sampler_logp is not None):
                with torch.no_grad():
                    logp = torch.cat([self.logprobs(self.policy, rollout, r)[0] for r in rows])
        if fresh:
            if self.ref is not None:
                with self.timer("reference"):
                    rollout.ref_logp = self.reference_logprobs(rollout, rows)
            # 4. KL on the sequence (k1), detached, folded into the reward *before* the baseline:
            #    R = r - beta * log pi(y)/pi_ref(y) (paper Sec. 2.3), unbiased for E[r] - beta*KL (algo/kl.py: KLTerm).
            rollout.token_kl, rollout.kl, baseline_rewards = self.kl_term.fold(
                rollout.rewards, None if logp is None else logp.detach(), rollout.ref_logp, rollout.completion_mask,
                self.beta)
            rollout.baseline_rewards = self.advantage_estimator.normalize(baseline_rewards, self.reduce_across_ranks)
            # 3b. An engine that reports log pi_s: how far it is from pi_theta, and (correction.level) the detached
            #     weights pi_theta/pi_s for step 6, kept for a reused rollout's later updates (their clipped ratio
            #     is pi_theta/pi_theta_old: the weight corrects pi_theta_old against the sampler, once).
            rollout.mismatch, rollout.is_weights = self.correct_sampler(rollout, logp)
            # 5. Leave-one-out advantages per prompt group: A_i = R_i - mean_{j != i} R_j (paper Eq. 4).
            #    Callbacks see the rollout first and may drop rows (advantage 0) or edit baseline_rewards.
            rollout.keep = ~rollout.truncated if c.shaping.mask_truncated_completions else \
                torch.ones_like(rollout.truncated, dtype=torch.bool)
            self._call_rollout_hooks("on_rollout", rollout)
            rollout.advantages = self.advantage_estimator(rollout.baseline_rewards, rollout.keep,
                                                          self.reduce_across_ranks)
            rollout.token_advantages = self.kl_term.token_advantages(rollout.advantages, rollout.token_kl,
                                                                     rollout.loss_mask, float(self.beta))
        # 6. Sequence-level REINFORCE: -1/S sum_i A_i sum_t m_t logp_t over the kept sequences (paper Sec. 3.1).
        loss, entropy, rollout.clip_stats = self.update_loss(rollout, rows, logp if len(rows) == 1 else None, entropy)
        if fresh and c.update.updates_per_rollout > 1:
            rollout.old_logp = logp.detach()  # pi_theta_old of the later updates on this rollout
        if fresh:
            self._call_rollout_hooks("on_rollout_end", rollout)
        return loss, entropy

    # -- the pieces of a step ------------------------------------------------------------------
    def sampling_seed(self, stream: str, step: int) -> int:
        """Seed of one generation call, from (seed, rank, stream, step)."""
        return derive_seed(self.cfg.sampling.seed, self.global_rank, stream, step)

    def sample(self, batch: dict, k: int, seed: int, greedy: bool = False) -> Rollout:
        """Step 1: ``k`` completions per prompt of ``batch`` from the policy, as a new :class:`Rollout`."""
        # Sharded policies (FSDP2, FSDP, ZeRO-3): parameters gathered once for the whole generate call, so that
        # ranks stopping at different lengths issue no collectives (no deadlock); a no-op otherwise.
        config = self.greedy_config if greedy else self.generation_config
        with self.timer("generation"), sharding.gathered_for_generation(self.policy, self._strategy):
            if self.episodes is not None:  # multi-turn: all turns inside the one gather (environments/episodes.py)
                return self.episodes.sample(self.policy, self.tokenizer, batch, k, config, seed, self.engine,
                                            self._grad_free(), self.reduce_across_ranks)
            return generate_rollout(self.policy, self.tokenizer, batch["input_ids"], batch["attention_mask"],
                                    batch["prompt"], batch["columns"], k, config, seed,
                                    engine=self.engine, grad_free=self._grad_free())

    def score(self, rollout: Rollout, shape: bool = True) -> tuple[dict[str, Tensor], Tensor]:
        """Step 2: ``(scores, rewards)``: ``{name: [B]}`` per reward function and the task reward ``[B]``, their
        weighted sum, with the ``shaping`` penalties unless ``shape`` is False (validation scores unshaped).

        A multi-turn rollout adds its environment's reward, as the score ``environment`` (weight 1)."""
        with self.timer("reward"):
            total, per_func = torch.zeros(len(rollout.prompts)), {}
            if self.rewards is not None:
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

    def logprobs(self, model: torch.nn.Module, rollout: Rollout, rows: slice = slice(None),
                 with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        """Per-token log-probs ``[b, T]`` of ``rows`` under ``model`` at the sampling temperature (step 3)."""
        return sequence_logprobs(model, rollout, rows, self.cfg.sampling.temperature, with_entropy,
                                 share_prompt=self.shares_prompt(rollout))

    def shares_prompt(self, rollout: Rollout) -> bool:
        """``update.share_prompt`` for this rollout (``auto``: :func:`~rloo_lightning.forward.worth_sharing`)."""
        option = self.cfg.update.share_prompt
        if option != "auto":
            return option == "always"
        distinct = int(rollout.prompt_mask[::rollout.k].sum())
        return worth_sharing(self._policy_params, rollout.k, distinct)

    def reference_logprobs(self, rollout: Rollout, rows: list[slice]) -> Tensor:
        """Step 3: ``[B, T]`` log-probs of the completions under the reference, one micro-batch at a time."""
        return self.ref.logprobs(self.policy, lambda model, r: self.logprobs(model, rollout, r)[0], rows,
                                 self._grad_free(), self.device)

    def correct_sampler(self, rollout: Rollout, logp: Tensor | None) -> tuple[dict, Tensor | None]:
        """Step 3b: ``(mismatch, is_weights)``: the sampler's mismatch sums (``train/mismatch/*``) and, with
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
        return mismatch, importance_weights(logp, rollout.sampler_logp, rollout.completion_mask, c.level, c.mode,
                                            c.cap, c.lower)

    def update_loss(self, rollout: Rollout, rows: list[slice], logp: Tensor | None, entropy: Tensor | None
                    ) -> tuple[Tensor, Tensor | None, dict]:
        """Step 6: ``(loss, entropy [B, T], clip statistics)``, one micro-batch (``rows``) at a time.

        ``logp``: the whole rollout's log-probs with grad when it is one micro-batch; otherwise each micro-batch
        runs its forward here. Every micro-batch but the last is differentiated here and its gradient held in
        ``grad_stash`` (``update.GradientStash``: injected in :meth:`on_before_backward`, so that Lightning's one
        backward carries the whole rollout's gradient); the last one's loss is returned for Lightning's backward,
        plus the others' values (detached), so that the logged loss is the total. The denominators are fixed over
        the whole rollout (and every rank) first, so that the micro-batch losses add up to the rollout's.
        """
        c = self.cfg
        denominators = loss_denominators(rollout, self.reduce_across_ranks, self.world_size,
                                         c.update.loss_norm_constant or c.sampling.max_new_tokens)
        advantages = rollout.token_advantages if rollout.token_advantages is not None else rollout.advantages
        if rollout.is_weights is not None:  # correction.level: w_i (or w_it) times (R_i - b_i), detached
            advantages = weighted_advantages(advantages, rollout.is_weights)
        loss_mask = rollout.loss_mask
        scaler = getattr(self.trainer.precision_plugin, "scaler", None) if self._trainer is not None else None
        self.grad_stash.grads = None
        clip_stats, entropies, earlier = {}, [], None
        with self.timer("policy_forward"):
            for i, r in enumerate(rows):
                micro_logp, micro_entropy = (logp, entropy) if logp is not None else self.logprobs(
                    self.policy, rollout, r, with_entropy=True)
                loss, stats = self.policy_loss(
                    micro_logp, loss_mask[r], advantages[r], denominators,
                    None if rollout.old_logp is None else rollout.old_logp[r],
                    None if rollout.ref_logp is None else rollout.ref_logp[r], self.beta)
                for name, (total, count) in stats.items():
                    s, n = clip_stats.get(name, (0.0, 0.0))
                    clip_stats[name] = (s + total, n + count)
                entropies.append(micro_entropy)
                if i < len(rows) - 1:
                    self.grad_stash.backward_early(loss, self.policy, scaler)
                    earlier = loss.detach() if earlier is None else earlier + loss.detach()
        entropy = torch.cat(entropies) if entropies[0] is not None else None
        return (loss if earlier is None else loss + earlier), entropy, clip_stats

    def informative_rollout(self, rollout: Rollout, num_groups: int) -> Rollout:
        """Dynamic sampling: extra rounds of prompts from the data module's ``sample_batch`` (``fill_informative``)."""
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if not hasattr(datamodule, "sample_batch"):
            raise ValueError("dynamic_sampling needs a data module with sample_batch(num_prompts, seed), "
                             "such as PromptDataModule")
        step = self.global_step

        def draw(round_: int) -> Rollout:
            extra = datamodule.sample_batch(num_groups, derive_seed(self.cfg.sampling.seed, self.global_rank,
                                                                    "dynamic", step, round_))
            extra = {key: v.to(self.device) if isinstance(v, Tensor) else v for key, v in extra.items()}
            candidate = self.sample(extra, self.cfg.sampling.k, self.sampling_seed(f"dynamic{round_}", step))
            sigterm.end_step(self._trainer, "after generation")
            candidate.scores, candidate.rewards = self.score(candidate)
            return candidate

        rollout, stats = fill_informative(rollout, num_groups, self.cfg.dynamic_sampling, draw,
                                          self.reduce_across_ranks, self.tokenizer.pad_token_id, step)
        log_step_metrics(self._trainer, stats, step)
        return rollout

    def _grad_free(self):
        """``torch.inference_mode`` for forwards that never need a gradient, where the policy is not sharded.

        It skips autograd's per-op bookkeeping (about 10 % of a small model's forward on CPU); ``no_grad``
        under FSDP2 / FSDP / ZeRO-3, whose gathered parameters must stay usable by training.
        """
        unsharded = sharding.generation_path(self.policy, self._strategy) == "none"
        return torch.inference_mode() if unsharded else torch.no_grad()

    @property
    def world_size(self) -> int:
        return self.trainer.world_size if self._trainer is not None else 1

    def reduce_across_ranks(self, tensor: Tensor, op: str = "sum") -> Tensor:
        """``tensor`` reduced over all ranks (``sum``, ``min``, ``max``); itself on one process."""
        return tensor if self.world_size == 1 else self.trainer.strategy.reduce(tensor, reduce_op=op)

    def _call_rollout_hooks(self, hook: str, rollout: Rollout) -> None:
        """``on_rollout`` (may edit) or ``on_rollout_end`` (read-only) on each RolloutHook callback."""
        for callback in self.trainer.callbacks if self._trainer is not None else []:
            if isinstance(callback, RolloutHook):
                getattr(callback, hook)(self.trainer, self, rollout)

    # -- Lightning hooks around the optimizer step ---------------------------------------------
    def on_before_backward(self, loss: Tensor) -> None:
        self.grad_stash.inject(self.policy)  # the earlier micro-batches' gradients join the last one's

    def on_before_optimizer_step(self, optimizer) -> None:
        if sigterm.phase() == "setup":
            # The first step's update: a stop signal from here keeps this step, at its end (raised at once in its
            # end's hooks instead, it would save Lightning's counters half-updated).
            sigterm.set_phase("train")
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        if grads and not self.guard.finite(self.reduce_across_ranks, *grads):
            self._on_nonfinite("gradient")
            for p in self.policy.parameters():  # torch optimizers leave a parameter without .grad alone
                p.grad = None

    def _on_nonfinite(self, what: str) -> None:
        self.guard.handle(what, self.global_step, self._last_stats)  # raises under update.on_nonfinite=stop
        self.log("train/skipped_steps", float(self.guard.skipped_steps))

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self.global_step > 0:
            sigterm.set_phase("train")  # a SIGTERM now: Lightning stops at this step's end and keeps it
        if self.ref is not None:
            self.ref.sync(self.policy, self.global_step, self.device)  # kl.ref_sync_steps: TR-DPO (reference.py)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        stepped = self._trainer is None or ended_optimizer_step(self._trainer, batch_idx)
        if stepped:  # an optimizer step happened: an engine with its own copy resyncs
            self.engine.on_weights_updated(self.policy)
        # Lightning stops at this batch's end on a SIGTERM: decided by every rank together; between two
        # micro-batches of one optimizer step the state to keep is the last step's (FinalCheckpoint rewinds).
        if sigterm.agree(self._trainer) and not stepped:
            sigterm.abort_step()
        if self.global_step > 0:
            sigterm.set_phase("boundary")

    # -- checkpoints ---------------------------------------------------------------------------
    def _frozen_base_keys(self) -> set[str]:
        """State-dict keys of the frozen base weights under LoRA (none otherwise)."""
        if not self.cfg.policy.lora:
            return set()
        # From the state dict, not named_parameters: a tied lm_head is a key of its own there.
        return {f"policy.{n}" for n, t in self.policy.state_dict(keep_vars=True).items() if not t.requires_grad}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        rewind = getattr(self, "_checkpoint_rewind", None)
        if rewind is not None:  # a SIGTERM inside a step (FinalCheckpoint): the state at the step's start
            checkpoint["loops"], checkpoint["callbacks"] = rewind["loops"], rewind["callbacks"]
            for key in [k for k in checkpoint if k.startswith("rloo_")]:
                del checkpoint[key]
            checkpoint.update(copy.deepcopy(rewind["extras"]))
            for name, value in rewind["buffers"].items():
                if name in checkpoint["state_dict"]:
                    checkpoint["state_dict"][name] = value.clone()
        else:
            checkpoint["rloo_skipped_steps"] = self.guard.skipped_steps
            if self.advantage_estimator.moving_average is not None:
                checkpoint["rloo_moving_average"] = self.advantage_estimator.state_dict()
            if (stored := self.reuse.state_dict()) is not None:
                checkpoint["rloo_rollout"] = stored  # between two updates on one rollout: the resumed run goes on
            if self.ref is not None and (state := self.ref.state_dict()) is not None:
                checkpoint["rloo_reference"] = state  # kl.ref_sync_steps: it moves, keep it
        start_next_epoch(checkpoint.get("loops"))  # after an epoch's end: resumed, the next epoch starts afresh
        for key in self._frozen_base_keys():  # LoRA: the base is the model on disk; the checkpoint holds the adapter
            checkpoint["state_dict"].pop(key, None)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # Another model's checkpoint: one line naming both, before any tensor (policy or reference) is loaded.
        check_checkpoint_fits(checkpoint, self.state_dict(keep_vars=True), self.hparams.model_name_or_path,
                              absent_ok=self._frozen_base_keys())
        self.guard.skipped_steps = checkpoint.get("rloo_skipped_steps", 0)
        self.advantage_estimator.load_state_dict(checkpoint.get("rloo_moving_average", {}))
        if "rloo_rollout" in checkpoint:
            self.reuse.load_state_dict(checkpoint["rloo_rollout"])
        if "rloo_reference" in checkpoint and self.ref is not None:
            self.ref.load_state_dict(checkpoint["rloo_reference"])
        base = self._frozen_base_keys()  # configure_model has run: these are the base model's weights
        if base:
            current = self.state_dict()
            for key in base - checkpoint["state_dict"].keys():
                checkpoint["state_dict"][key] = current[key]

    # -- metrics and validation ----------------------------------------------------------------
    def log_train_metrics(self, rollout: Rollout, entropy: Tensor, loss: Tensor) -> dict[str, float]:
        """Log the step's metrics, each an exact global mean: sums and counts are all-reduced, not means."""
        sums = train_metric_sums(rollout, entropy, loss)
        stacked = torch.stack([torch.stack([s.float().to(self.device), n.float().to(self.device)])
                               for s, n in sums.values()])
        stacked = self.reduce_across_ranks(stacked, "sum")
        metrics = dict(zip(sums, step_means(stacked)))
        log_step_metrics(self._trainer, metrics, self.global_step, prog_bar=("train/reward", "train/kl"))
        self.no_signal.update(metrics["train/zero_std_groups"], self.global_step)
        self.missing_rewards.update(metrics, self.global_step, rollout.prompts)  # every rank: the means are global
        if self.timer.enabled:
            # to the loggers only, not to callback_metrics: seconds per phase are for reading, not monitoring
            write_to_loggers(self._trainer, {f"time/{phase}": t for phase, t in self.timer.totals.items()},
                             self.global_step)
        return metrics

    def evaluate_batch(self, batch: dict, batch_idx: int) -> dict[str, Tensor]:
        """Per-prompt validation values: mean reward of ``validation.num_samples`` sampled completions, pass@k,
        greedy reward and accuracy. The seed depends on the batch only, so every evaluation draws the same
        random stream and val curves compare policies rather than noise."""
        v = self.cfg.validation
        sampled = self.sample(batch, v.num_samples, self.sampling_seed("val", batch_idx))
        sampled.scores, sampled.rewards = self.score(sampled, shape=False)
        rewards = sampled.rewards.view(-1, v.num_samples)
        out = {"reward": rewards.nanmean(1)}
        successes = (rewards >= v.success_threshold).sum(1)
        for pk in v.pass_k or []:
            out[f"pass@{pk}"] = pass_at_k(successes, v.num_samples, pk)
        if v.greedy:
            greedy = self.sample(batch, 1, 0, greedy=True)
            greedy.scores, greedy.rewards = self.score(greedy, shape=False)
            out["reward_greedy"] = greedy.rewards
            out["accuracy_greedy"] = (greedy.rewards >= v.success_threshold).float()
        return out

    def on_fit_start(self) -> None:
        self.engine.on_weights_updated(self.policy)  # weights restored from --ckpt_path: an engine's copy is stale
        if self._engine_unnamed:
            rank_zero_warn(f"generation engine {type(self.engine).__name__} is not stored in the checkpoints "
                           f"({self._engine_unnamed}): validate, test, predict and a resume from them use the "
                           "default engine unless --model.generation_engine names one")

    def on_test_start(self) -> None:
        self.engine.on_weights_updated(self.policy)

    def on_predict_start(self) -> None:
        self.engine.on_weights_updated(self.policy)
        sigterm.set_phase("predict")  # from here PredictionWriter stops after the batch in progress is written

    def on_validation_start(self) -> None:
        if self.trainer.state.fn == "validate":
            self.engine.on_weights_updated(self.policy)
        if self.global_step > 0 and self.trainer.training is False:
            sigterm.set_phase("validation")  # a SIGTERM now ends the run at the next token: the step is kept

    def on_validation_end(self) -> None:
        if self.global_step > 0:
            sigterm.set_phase("boundary")

    def on_validation_batch_start(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.global_step > 0:
            sigterm.between_batches(self._trainer, "validation")  # every rank together (sigterm.py)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._log_evaluation(batch, batch_idx, "val", self.val_metrics)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        """The validation metrics on the test prompts, as ``test/<name>`` (``data.test_file``)."""
        self._log_evaluation(batch, batch_idx, "test", self.test_metrics)

    def _log_evaluation(self, batch: dict, batch_idx: int, split: str, metrics: torch.nn.ModuleDict) -> None:
        for name, values in self.evaluate_batch(batch, batch_idx).items():
            metric = metrics[name]
            metric.update(values)
            self.log(f"{split}/{name}", metric, prog_bar=name == "reward", batch_size=len(batch["prompt"]))

    def predict_step(self, batch: dict, batch_idx: int) -> list[dict]:
        """Completions for a batch of prompts, one JSON-ready dict each (written by ``PredictionWriter``).

        ``predict.num_samples`` per prompt from the training sampler, seeded by (seed, rank, batch), or one
        greedy completion; scored (unshaped) when reward functions are given.
        """
        p = self.cfg.predict
        if p.greedy:
            rollout = self.sample(batch, 1, 0, greedy=True)
        else:
            rollout = self.sample(batch, p.num_samples, self.sampling_seed("predict", batch_idx))
        if self.rewards is not None or self.episodes is not None:
            rollout.scores, rollout.rewards = self.score(rollout, shape=False)
        return prediction_rows(rollout, batch["prompt"])

    def save_pretrained(self, directory: str) -> None:
        """Write the policy and tokenizer in Hugging Face format (``policy.lora_export`` for a LoRA policy).

        Under FSDP2 every rank must call this (the weights are gathered, a collective); rank 0 writes."""
        is_global_zero = self._trainer is None or self.trainer.is_global_zero
        export_pretrained(self.policy, self.tokenizer, directory, self.cfg.policy, is_global_zero)
