"""Fixed-lag rollouts (``rollout.lag`` K): step g trains on the rollout sampled from the weights of step
g - K, with the prompts the loader hands to step g; seeded as K = 0 seeds them; corrected by default; held in
checkpoints so that a resume ends where the uninterrupted run does; a lag change and a data module that cannot
give a later batch are refused. In-process fits of the tiny model (the CLI and SIGTERM runs are in
``test_pipeline_runs.py``)."""

from __future__ import annotations

import hashlib

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from rloo_lightning import RLOOModule
from rloo_lightning.callbacks import RolloutHook
from rloo_lightning.config import CorrectionArgs, RolloutArgs
from rloo_lightning.data import PromptDataModule
from rloo_lightning.data.sampling import ResumableSampler
from rloo_lightning.engines import DecodeLoopEngine, GenerationEngine
from rloo_lightning.pipeline import RolloutPipeline
from stop_helpers import HeldEngine

REWARD = "rloo_lightning.tasks.reverse.reward"


def _weights_hash(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


class RecordingEngine(DecodeLoopEngine):
    """The default engine (with its log-probs), noting the policy's weights and the seed of every sample."""

    def __init__(self) -> None:
        super().__init__(return_logprobs=True)
        self.samples: list[dict] = []

    def generate(self, model, tokenizer, prompt_ids, prompt_mask, generation_config, seed):
        ids, logp = super().generate(model, tokenizer, prompt_ids, prompt_mask, generation_config, seed)
        self.samples.append({"weights": _weights_hash(model), "seed": seed, "ids": ids.clone()})
        return ids, logp


class StepRecorder(RolloutHook):
    """The weights at each step's start, and the rollout each step trains on."""

    def __init__(self) -> None:
        self.weights: dict[int, str] = {}
        self.rollouts: dict[int, dict] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.weights.setdefault(trainer.global_step, _weights_hash(pl_module.policy))

    def on_rollout(self, trainer, pl_module, rollout) -> None:
        self.rollouts[trainer.global_step] = {"ids": rollout.completion_ids.clone(), "prompts": list(rollout.prompts)}


class Metrics(Callback):
    def __init__(self) -> None:
        self.seen: dict[int, dict] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen[trainer.global_step - 1] = {k: float(v) for k, v in trainer.callback_metrics.items()
                                              if k.startswith("train/")}


def _fit(model_dir, root, max_steps: int, lag: int, engine=None, callbacks=(), ckpt_path=None, rows: int = 16,
         accumulate: int = 1, repeat: int = 1, **groups) -> RLOOModule:
    module = RLOOModule(model_dir, rewards={"funcs": [REWARD]}, sampling={"k": 2, "max_new_tokens": 6},
                        rollout={"lag": lag}, generation_engine=engine,
                        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), **groups)
    data = PromptDataModule(tokenizer_name_or_path=model_dir, task="reverse", batch_size=4, num_train_rows=rows,
                            num_val_rows=4, max_new_tokens=6, repeat_batches=repeat)
    trainer = Trainer(accelerator="cpu", max_steps=max_steps, limit_val_batches=0, logger=False,
                      default_root_dir=str(root), enable_progress_bar=False, enable_model_summary=False,
                      accumulate_grad_batches=accumulate,
                      callbacks=[ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_train_steps=1, save_top_k=-1),
                                 *callbacks])
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module


# -- the pieces -------------------------------------------------------------------------------------
def test_the_option_is_checked_and_auto_corrects_stale_rollouts():
    with pytest.raises(ValueError, match="rollout.lag must be an integer >= 0"):
        RolloutArgs(lag=-1)
    with pytest.raises(ValueError, match="rollout.lag"):
        RolloutArgs(lag=True)
    plain = GenerationEngine()
    assert CorrectionArgs().for_engine(plain).level == "none"
    assert CorrectionArgs().for_engine(plain, stale=True).level == "token"
    assert CorrectionArgs(level="none").for_engine(plain, stale=True).level == "none"  # an explicit choice stays
    module = RLOOModule("tiny:reverse", rewards={"funcs": [REWARD]}, rollout={"lag": 1})
    assert (module.cfg.correction.level, module.cfg.correction.cap) == ("token", 2.0)
    assert module.engine.reports_logprobs is True  # the default engine reports the sampler's log-probs
    assert module.hparams["rollout"] == {"lag": 1} and module.hparams["correction"]["level"] == "auto"


@pytest.mark.parametrize("replicas,repeat", [(1, 1), (2, 1), (1, 3), (2, 2)])
def test_batch_at_is_the_batch_the_loader_yields_at_that_position(replicas, repeat):
    rows = list(range(23))
    for rank in range(replicas):
        sampler = ResumableSampler(rows, num_replicas=replicas, rank=rank, seed=7, batch_size=3, repeat=repeat)
        per_epoch = len(sampler) // 3
        for position in range(3 * per_epoch):  # three epochs, from every starting position
            sampler.position = lambda p=position: p
            first = list(iter(sampler))[:3]
            assert sampler.batch_at(position) == first, (rank, position)


@pytest.mark.parametrize("lag,accumulate,repeat,step,due", [
    (1, 1, 1, 0, [0, 1]), (1, 1, 1, 5, [5, 6]), (2, 1, 1, 3, [3, 4, 5]),
    (1, 2, 1, 2, [4, 5, 6, 7]),  # two batches a step: both of steps 2 and 3
    (1, 1, 2, 2, [2]), (1, 1, 2, 3, [4]),  # a fresh rollout every second batch (the loader repeats each twice)
])
def test_the_rollouts_due_at_a_step(lag, accumulate, repeat, step, due):
    pipeline = RolloutPipeline(lag, repeat, accumulate=accumulate)
    assert pipeline.due(step) == due


# -- through a fit ----------------------------------------------------------------------------------
@pytest.mark.parametrize("lag", [1, 2])
def test_each_step_trains_on_the_rollout_of_the_weights_k_steps_before(tiny_model_dir, tmp_path, lag):
    engine, steps, metrics = RecordingEngine(), StepRecorder(), Metrics()
    _fit(tiny_model_dir, tmp_path, 5, lag, engine=engine, callbacks=[steps, metrics])
    assert len(engine.samples) == 5 + lag  # steps 0..4 and the lag ahead of step 4, each once
    for g in range(5):
        ids = steps.rollouts[g]["ids"]
        made = [s for s in engine.samples if s["ids"].shape == ids.shape and torch.equal(s["ids"], ids)]
        assert len(made) == 1, g
        assert made[0]["weights"] == steps.weights[max(0, g - lag)], g  # exactly the weights of step g - K
        assert metrics.seen[g]["train/staleness"] == min(g, lag)
        assert metrics.seen[g]["train/rollout_queue_depth"] == lag
    # seeded as the step that trains on it: only the weights differ from K = 0
    assert [s["seed"] for s in engine.samples[:5]] == [RLOOModule.sampling_seed(_SeedOnly(), "train", g)
                                                       for g in range(5)]
    assert steps.weights[0] != steps.weights[1]


class _SeedOnly:
    """What ``RLOOModule.sampling_seed`` reads, for a module-free seed."""
    cfg = type("C", (), {"sampling": type("S", (), {"seed": 0})()})()
    global_rank = 0


def test_k0_and_k1_sample_the_same_first_rollout_and_then_differ(tiny_model_dir, tmp_path):
    a, b = StepRecorder(), StepRecorder()
    _fit(tiny_model_dir, tmp_path / "k0", 3, 0, callbacks=[a])
    _fit(tiny_model_dir, tmp_path / "k1", 3, 1, callbacks=[b])
    assert a.rollouts[0]["prompts"] == b.rollouts[0]["prompts"]
    assert torch.equal(a.rollouts[0]["ids"], b.rollouts[0]["ids"])  # same weights (step 0), same seed
    for g in range(3):
        assert a.rollouts[g]["prompts"] == b.rollouts[g]["prompts"]  # the loader's prompts, in the same order


def _policy(ckpt_path) -> dict:
    state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    return {k: v for k, v in state["state_dict"].items() if k.startswith("policy.")}, state


@pytest.mark.slow  # over ~5 s (the fast loop: pytest -m "not slow")
@pytest.mark.parametrize("lag,accumulate", [(1, 1), (2, 1), (1, 2)])
def test_a_resumed_run_ends_bit_identical_to_the_uninterrupted_one(tiny_model_dir, tmp_path, lag, accumulate):
    # 16 rows, batches of 4: an epoch is 4 batches; 6 steps cross it (accumulate 2: 2 steps an epoch, the resume
    # point at an epoch's middle)
    _fit(tiny_model_dir, tmp_path / "a", 6, lag, accumulate=accumulate)
    _fit(tiny_model_dir, tmp_path / "b", 3, lag, accumulate=accumulate)
    stopped = sorted((tmp_path / "b" / "ckpt").glob("*step=3.ckpt"))[0]
    _, state = _policy(stopped)
    assert len(state["rloo_pipeline"]["ranks"][0]["ahead"]) == lag * accumulate  # the rollouts ahead, finished
    assert all(entry["fields"]["completion_ids"].numel() for entry in state["rloo_pipeline"]["ranks"][0]["ahead"])
    _fit(tiny_model_dir, tmp_path / "b2", 6, lag, accumulate=accumulate, ckpt_path=stopped)
    end_a = sorted((tmp_path / "a" / "ckpt").glob("*step=6.ckpt"))[0]
    end_b = sorted((tmp_path / "b2" / "ckpt").glob("*step=6.ckpt"))[0]
    (wa, sa), (wb, sb) = _policy(end_a), _policy(end_b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    for x, y in zip(sa["rloo_pipeline"]["ranks"][0]["ahead"], sb["rloo_pipeline"]["ranks"][0]["ahead"]):
        assert x["position"] == y["position"] and torch.equal(x["fields"]["completion_ids"],
                                                              y["fields"]["completion_ids"])


def test_updates_per_rollout_counts_into_the_age_of_a_rollout(tiny_model_dir, tmp_path):
    metrics = Metrics()
    _fit(tiny_model_dir, tmp_path, 6, 1, callbacks=[metrics], repeat=2,
         update={"updates_per_rollout": 2, "clip_mode": "token"})
    # fresh rollouts at steps 0, 2, 4 from the weights of steps 0, 1, 3; reused one step later
    assert [metrics.seen[g]["train/staleness"] for g in range(6)] == [0, 1, 1, 2, 1, 2]


def test_a_resume_with_another_lag_is_refused(tiny_model_dir, tmp_path):
    _fit(tiny_model_dir, tmp_path / "a", 2, 1)
    ckpt = tmp_path / "a" / "ckpt" / "epoch=0-step=2.ckpt"
    with pytest.raises(ValueError, match=r"rollout.lag=2, but this checkpoint was trained with 1"):
        _fit(tiny_model_dir, tmp_path / "b", 4, 2, ckpt_path=ckpt)
    with pytest.raises(ValueError, match=r"rollout.lag=0, but this checkpoint was trained with 1"):
        _fit(tiny_model_dir, tmp_path / "c", 4, 0, ckpt_path=ckpt)
    _fit(tiny_model_dir, tmp_path / "d", 2, 0)
    with pytest.raises(ValueError, match=r"rollout.lag=1, but this checkpoint was trained with 0"):
        _fit(tiny_model_dir, tmp_path / "e", 4, 1, ckpt_path=tmp_path / "d" / "ckpt" / "epoch=0-step=2.ckpt")


class _NoLookAhead(PromptDataModule):
    train_batch = None


def test_a_data_module_that_cannot_give_a_later_batch_is_refused_before_any_step(tiny_model_dir, tmp_path):
    module = RLOOModule(tiny_model_dir, rewards={"funcs": [REWARD]}, rollout={"lag": 1})
    data = _NoLookAhead(tokenizer_name_or_path=tiny_model_dir, task="reverse", batch_size=4, num_train_rows=8,
                        num_val_rows=4)
    trainer = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                      default_root_dir=str(tmp_path), limit_val_batches=0)
    with pytest.raises(ValueError, match=r"rollout.lag=1 .* needs a data module with train_batch"):
        trainer.fit(module, datamodule=data)
    assert module.policy is None  # refused at setup, before the model loaded


def test_a_loader_batch_that_is_not_the_one_sampled_ahead_is_caught(tiny_model_dir, tmp_path, monkeypatch):
    original = PromptDataModule.train_batch
    monkeypatch.setattr(PromptDataModule, "train_batch", lambda self, position: original(self, position + 1))
    with pytest.raises(RuntimeError, match=r"the loader's batch at position 0 .* is not the one sampled for it"):
        _fit(tiny_model_dir, tmp_path, 2, 1)


def test_dynamic_sampling_and_validation_run_with_a_lag(tiny_model_dir, tmp_path):
    metrics = Metrics()
    module = RLOOModule(tiny_model_dir, rewards={"funcs": [REWARD]}, sampling={"k": 2, "max_new_tokens": 6},
                        rollout={"lag": 1}, dynamic_sampling={"enabled": True, "max_rounds": 2},
                        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    data = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="reverse", batch_size=4, num_train_rows=16,
                            num_val_rows=4, max_new_tokens=6)
    trainer = Trainer(accelerator="cpu", max_steps=3, val_check_interval=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[metrics])
    trainer.fit(module, datamodule=data)
    assert [metrics.seen[g]["train/staleness"] for g in range(3)] == [0, 1, 1]
    assert "val/reward" in trainer.callback_metrics


def test_an_engine_without_log_probs_is_refused_with_a_lag_unless_the_correction_is_off(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"correction.level='token' needs an engine that reports its log-probs"):
        _fit(tiny_model_dir, tmp_path / "a", 1, 1, engine=DecodeLoopEngine())
    metrics = Metrics()  # explicitly uncorrected: it trains, stale, with a warning at the start
    _fit(tiny_model_dir, tmp_path / "b", 2, 1, engine=DecodeLoopEngine(), callbacks=[metrics],
         correction={"level": "none"})
    assert [metrics.seen[g]["train/staleness"] for g in range(2)] == [0, 1]


class InFlight(Callback):
    """At each step's end (callbacks' on_train_batch_end runs before the module's): what is still in flight."""

    def __init__(self) -> None:
        self.pending: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.pending.append(sum(entry.pending is not None for entry in pl_module.pipeline.ahead.values()))


@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize("held", [False, True])
def test_what_is_in_flight_between_steps_is_the_engines_choice_with_or_without_checkpoint_callbacks(
        tiny_model_dir, tmp_path, checkpointing, held):
    # The collection at a step's end is the module's own (its optimizer step), not a side effect of a checkpoint
    # callback building the module's checkpoint entries: every rollout ahead with an engine whose sync waits for its
    # requests; none with one that keeps each version (held), whose rollouts stay in flight until taken, K - 1 steps
    # later, and which a checkpoint collects first.
    engine = HeldEngine(return_logprobs=True, held=held)
    module = RLOOModule(tiny_model_dir, rewards={"funcs": [REWARD]}, sampling={"k": 2, "max_new_tokens": 6},
                        rollout={"lag": 2}, generation_engine=engine)
    data = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="reverse", batch_size=4, num_train_rows=16,
                            num_val_rows=4, max_new_tokens=6)
    seen = InFlight()
    trainer = Trainer(accelerator="cpu", max_steps=3, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[seen],
                      enable_checkpointing=checkpointing)
    trainer.fit(module, datamodule=data)
    # held: steps 1 and 2 (positions 1, 2) taken, 3 and 4 in flight at each end; FinalCheckpoint's last.ckpt at the
    # fit's end collects them
    assert seen.pending == ([2, 2, 2] if held else [0, 0, 0])
    assert len(module.pipeline.ahead) == 2
    assert engine.collected == (3 + 2 * checkpointing if held else 0)
    if checkpointing:
        [last] = tmp_path.rglob("last.ckpt")
        state = torch.load(last, map_location="cpu", weights_only=False)
        assert state["global_step"] == 3
        ahead = state["rloo_pipeline"]["ranks"][0]["ahead"]
        assert [e["position"] for e in ahead] == [3, 4] and all(e["fields"]["completion_ids"].numel() for e in ahead)


@pytest.mark.parametrize("lag", [1, 2])
def test_a_held_engine_resumes_bit_identically_and_samples_as_one_that_waits(tiny_model_dir, tmp_path, lag):
    # Rollouts left in flight across step ends are the same samples: the held run's checkpoints equal those of the
    # run whose engine is collected at every step's end, and a resume from one of its mid-run checkpoints ends there.
    _fit(tiny_model_dir, tmp_path / "a", 5, lag, engine=HeldEngine(return_logprobs=True, held=False))
    _fit(tiny_model_dir, tmp_path / "h", 5, lag, engine=HeldEngine(return_logprobs=True, held=True))
    stopped = sorted((tmp_path / "h" / "ckpt").glob("*step=2.ckpt"))[0]
    _fit(tiny_model_dir, tmp_path / "r", 5, lag, engine=HeldEngine(return_logprobs=True, held=True), ckpt_path=stopped)
    end = {run: _policy(sorted((tmp_path / run / "ckpt").glob("*step=5.ckpt"))[0]) for run in "ahr"}
    for run in "hr":
        assert all(torch.equal(end["a"][0][k], end[run][0][k]) for k in end["a"][0]), run
        for x, y in zip(end["a"][1]["rloo_pipeline"]["ranks"][0]["ahead"],
                        end[run][1]["rloo_pipeline"]["ranks"][0]["ahead"], strict=True):
            assert x["position"] == y["position"] and torch.equal(x["fields"]["completion_ids"],
                                                                  y["fields"]["completion_ids"])


def test_an_accumulation_schedule_is_refused_at_setup_naming_the_callback(tiny_model_dir, tmp_path):
    from lightning.pytorch.callbacks import GradientAccumulationScheduler
    module = RLOOModule(tiny_model_dir, rewards={"funcs": [REWARD]}, rollout={"lag": 1})
    data = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="reverse", batch_size=4, num_train_rows=8,
                            num_val_rows=4)
    trainer = Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                      default_root_dir=str(tmp_path), limit_val_batches=0,
                      callbacks=[GradientAccumulationScheduler({0: 1, 1: 2})])
    with pytest.raises(ValueError, match=r"rollout.lag=1 .* GradientAccumulationScheduler changes it"):
        trainer.fit(module, datamodule=data)
    assert module.policy is None  # refused at setup, before the model loaded
