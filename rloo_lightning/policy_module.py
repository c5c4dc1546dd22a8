"""The Lightning module around a Hugging Face causal LM that a generation engine samples, apart from the RL: the
checks before any model loads, the engine, loading and attaching the models, the trainer it runs under (or none),
evaluation (validation, test, predict) and export. :class:`~rloo_lightning.module.RLOOModule` adds the RL on top
(its ``__init__`` sets what this class reads: ``cfg``, ``rewards``, ``episodes``, ``val_metrics`` ...; its steps 1 and
2, ``sample`` and ``score``, are what evaluation runs)."""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor

from rloo_lightning.callbacks.predict import prediction_rows
from rloo_lightning.config import check_options
from rloo_lightning.engines import GenerationEngine
from rloo_lightning.engines.decode import DecodeLoopEngine
from rloo_lightning.forward import sequence_logprobs, worth_sharing
from rloo_lightning.metrics import pass_at_k
from rloo_lightning.models import sharding
from rloo_lightning.models.policy import (
    check_checkpoint_fits, disable_dropout, export_pretrained, load_models, prepare_policy,
)
from rloo_lightning.reference import ReferencePolicy
from rloo_lightning.rewards.model import RewardModel
from rloo_lightning.rewards.protocol import RewardError
from rloo_lightning.rollout import Rollout, default_eos_ids, generation_configs
from rloo_lightning.runtime import framework, sigterm
from rloo_lightning.runtime.no_trainer import NO_TRAINER
from rloo_lightning.update import warmup_constant_schedule

__all__ = ["PolicyModule"]


class PolicyModule(LightningModule):
    """A causal LM, its tokenizer, its generation engine and (when beta > 0) its reference, under a trainer or none.

    The base of :class:`~rloo_lightning.module.RLOOModule`, which sets the attributes read here in its ``__init__``
    and defines the steps evaluation samples and scores with (``sample``, ``score``, ``sampling_seed``).
    """

    # -- before any model loads: the options' checks and the engine ----------------------------
    def setup(self, stage: str) -> None:
        # Before any model is loaded (Lightning calls configure_model after this; ProcessRuntime set the threads).
        stage = getattr(stage, "value", stage)  # Lightning passes a TrainerFn ("fit", "validate", ...)
        self._check_engine(self.run_by.strategy.root_device, stage)
        if self.rewards is None and self.episodes is None and stage != "predict":
            raise ValueError(f"rewards.funcs must name at least one reward function: {stage} scores completions "
                             "(only predict runs without, and an environment.class_path that gives the rewards)")
        datamodule = self.run_by.datamodule
        if self.episodes is not None and datamodule is not None:
            self.episodes.check_data(datamodule)
        self.predict_scores = self.rewards is not None  # predict: the reward functions score the predictions
        if self.rewards is not None:
            added = list(self.episodes.columns) if self.episodes is not None else []  # a multi-turn rollout's
            for source, names in getattr(datamodule, "columns", lambda stage: [])(stage):
                try:  # the data's own columns, before the model loads
                    self.rewards.check_columns([*names, *added], source)
                except RewardError as error:
                    if stage != "predict":
                        raise
                    # New prompts without the reward's columns (an answer): predictions without a reward.
                    self.predict_scores = False
                    rank_zero_info(f"predict: the predictions carry no reward ({error})")

    def use_engine(self, engine: GenerationEngine) -> None:
        """Sample with ``engine``: ``correction.level: auto`` becomes its ``default_correction`` (config.py)."""
        self.engine = engine
        rollout = getattr(self.cfg, "rollout", None)  # stale rollouts: auto corrects whatever the engine
        self.cfg.correction = self._correction_given.for_engine(engine, stale=bool(rollout and rollout.lag))
        check_options(self.cfg)

    def _check_engine(self, device: torch.device, stage: str) -> None:
        """Whether the engine runs here (its ``check``), and (fit) whether it gives what the correction needs.

        An engine rebuilt from the checkpoint (not given for this command) that cannot run here (vLLM not
        installed, an argument only a GPU takes, a server that does not answer) gives way to the default engine for
        validate, test and predict, with one line saying so; fit (a resume) stops instead: another sampler would
        change the run.
        """
        try:
            self.engine.check(device)
            if stage != "fit" and self.engine_from_checkpoint:
                getattr(self.engine, "reachable", lambda: None)()  # a server gone since the fit: give way at once
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

    def _frozen_base_keys(self) -> set[str]:
        """State-dict keys of the frozen base weights under LoRA (none otherwise)."""
        if not self.cfg.policy.lora:
            return set()
        # From the state dict, not named_parameters: a tied lm_head is a key of its own there.
        return {f"policy.{n}" for n, t in self.policy.state_dict(keep_vars=True).items() if not t.requires_grad}

    def configure_optimizers(self):
        # AdamW at the paper's 1e-6 and a linear warm-up then constant, unless --optimizer / --lr_scheduler say.
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-6) if self.optimizer_factory is None else self.optimizer_factory(
            params)
        if self.scheduler_factory is not None:
            scheduler = self.scheduler_factory(optimizer)
        else:
            total = self.trainer.estimated_stepping_batches
            scheduler = warmup_constant_schedule(optimizer, self.cfg.update.warmup_steps(total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- checkpoints: another model's refused; LoRA's frozen base is the model on disk, not in the checkpoint --
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        for key in self._frozen_base_keys():
            checkpoint["state_dict"].pop(key, None)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # Another model's checkpoint: one line naming both, before any tensor (policy or reference) is loaded.
        check_checkpoint_fits(checkpoint, self.state_dict(keep_vars=True), self.hparams.model_name_or_path,
                              absent_ok=self._frozen_base_keys())
        base = self._frozen_base_keys()  # configure_model has run: these are the base model's weights
        if base:
            current = self.state_dict()
            for key in base - checkpoint["state_dict"].keys():
                checkpoint["state_dict"][key] = current[key]

    def teardown(self, stage: str) -> None:
        if self.rewards is not None:
            self.rewards.close()

    # -- generation inside a step: every rank ends together -----------------------------------
    @contextmanager
    def generating(self, in_step: bool):
        """Around a generation call: timed, and on sharded policies (FSDP2, FSDP, ZeRO-3) the parameters gathered
        once for the whole call (every turn of an episode), so that ranks stopping at different lengths issue no
        collectives (no deadlock). ``in_step``: a step's generation, which ends at an agreement of every rank
        (:meth:`ranks_agree`)."""
        with self.ranks_agree("after generation") if in_step else nullcontext():
            with self.timer("generation"), sharding.gathered_for_generation(self.policy, self._strategy):
                yield

    @contextmanager
    def ranks_agree(self, where: str, signals: bool = True):
        """A part of a training step that no collective interrupts, ending where every rank agrees
        (:func:`~rloo_lightning.runtime.sigterm.end_step`): a stop signal, or a failure on any rank (held until
        then, so that no rank waits for it in a collective), ends every rank there together, before anything of the
        step is kept; the checkpoint written is then the step before's. ``signals`` False: failures only (a stop
        signal then ends the run at the step's end, as Lightning does)."""
        failure = None
        try:
            yield
        except (sigterm.StepFailed, SIGTERMException):
            raise  # an inner agreement already ended every rank
        except Exception as error:
            failure = error
        sigterm.end_step(framework.module_trainer(self), where, failure, signals)

    # -- the policy run on a rollout -----------------------------------------------------------
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

    # -- the trainer (or none) -----------------------------------------------------------------
    @property
    def run_by(self):
        """The trainer running this module, or :data:`~rloo_lightning.runtime.no_trainer.NO_TRAINER` when it is
        driven by hand (the exactness harness calls ``training_step`` without a trainer; tests call its pieces)."""
        trainer = framework.module_trainer(self)
        return NO_TRAINER if trainer is None else trainer

    @property
    def _strategy(self):
        return self.run_by.strategy

    def _grad_free(self):
        """``torch.inference_mode`` for forwards that never need a gradient, where the policy is not sharded.

        It skips autograd's per-op bookkeeping (measured: see ``benchmarks/step_time.md``); ``no_grad``
        under FSDP2 / FSDP / ZeRO-3, whose gathered parameters must stay usable by training.
        """
        unsharded = sharding.generation_path(self.policy, self._strategy) == "none"
        return torch.inference_mode() if unsharded else torch.no_grad()

    @property
    def world_size(self) -> int:
        return self.run_by.world_size

    def reduce_across_ranks(self, tensor: Tensor, op: str = "sum") -> Tensor:
        """``tensor`` reduced over all ranks (``sum``, ``min``, ``max``); itself on one process."""
        return tensor if self.world_size == 1 else self.run_by.strategy.reduce(tensor, reduce_op=op)

    def gather_across_ranks(self, state) -> list:
        """``state`` (any picklable object) of every rank, by global rank (a collective: every rank calls it at the
        same point); ``[state]`` on one process."""
        if self.world_size == 1 or not torch.distributed.is_initialized():
            return [state]
        states = [None] * self.world_size
        torch.distributed.all_gather_object(states, state)
        return states

    # -- the engine's copy of the weights, stale when a run starts -----------------------------
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

    def on_validation_start(self) -> None:
        if self.trainer.state.fn == "validate":
            self.engine.on_weights_updated(self.policy)

    # -- evaluation: validation, test, predict -------------------------------------------------
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
        greedy completion; scored (unshaped) when reward functions are given and the prompts have the columns they
        read (else the predictions carry no reward, said once at setup).
        """
        p = self.cfg.predict
        if p.greedy:
            rollout = self.sample(batch, 1, 0, greedy=True)
        else:
            rollout = self.sample(batch, p.num_samples, self.sampling_seed("predict", batch_idx))
        if self.predict_scores or self.episodes is not None:
            rollout.scores, rollout.rewards = self.score(rollout, shape=False, rewards=self.predict_scores)
        return prediction_rows(rollout, batch["prompt"])

    # -- export --------------------------------------------------------------------------------
    def save_pretrained(self, directory: str) -> None:
        """Write the policy and tokenizer in Hugging Face format (``policy.lora_export`` for a LoRA policy).

        Under FSDP2 every rank must call this (the weights are gathered, a collective); rank 0 writes."""
        export_pretrained(self.policy, self.tokenizer, directory, self.cfg.policy, self.run_by.is_global_zero)
