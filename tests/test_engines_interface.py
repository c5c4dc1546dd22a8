"""The generation seam: a custom engine replaces HF generate; the default is the policy's own generate."""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import Logger

from rloo_lightning import RLOOModule
from rloo_lightning.data import PromptDataModule, collate_prompts
from rloo_lightning.engines import GenerationEngine

REWARD = "rloo_lightning.tasks.reverse.reward"


class RecordingLogger(Logger):
    """Keeps what is written to it: ``logged[step] = {name: value}``."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: dict[int, dict] = {}

    name, version = "recording", 0

    def log_metrics(self, metrics, step=None) -> None:
        self.logged.setdefault(step, {}).update({k: v for k, v in metrics.items() if k.startswith("time/")})

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


class EchoEngine(GenerationEngine):
    """Answers every prompt with its last three prompt tokens then EOS; counts weight syncs."""

    def __init__(self, eos_id: int = 2) -> None:
        self.eos_id = eos_id
        self.calls, self.syncs = [], 0

    def generate(self, model, tokenizer, prompt_ids, prompt_mask, generation_config, seed):
        self.calls.append((prompt_ids.shape[0], generation_config.max_new_tokens, seed))
        eos = torch.full((prompt_ids.shape[0], 1), tokenizer.eos_token_id)
        return torch.cat([prompt_ids[:, -4:-1], eos], dim=1)

    def on_weights_updated(self, model) -> None:
        self.syncs += 1


def test_custom_engine_feeds_the_whole_step(tiny_model_dir):
    engine = EchoEngine()
    module = RLOOModule(tiny_model_dir, rewards={"funcs": [REWARD]}, sampling={"k": 2, "max_new_tokens": 6},
                        validation={"at_start": False}, generation_engine=engine, run={"time_phases": True})
    data = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="reverse", batch_size=3, num_train_rows=12,
                            num_val_rows=3, max_new_tokens=6)
    timings = RecordingLogger()
    trainer = Trainer(accelerator="cpu", max_steps=2, limit_val_batches=0, logger=timings, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(module, datamodule=data)
    assert [c[:2] for c in engine.calls] == [(6, 6), (6, 6)]  # 3 prompts x k=2, the module's budget
    assert engine.calls[0][2] != engine.calls[1][2]  # a fresh seed each step
    assert engine.syncs == 3  # at fit start (weights may come from a checkpoint), then after each optimizer step
    metrics = trainer.callback_metrics
    assert metrics["train/completion_length"] == 4  # 3 echoed tokens + EOS, nothing truncated
    assert metrics["train/clipped_ratio"] == 0
    assert not any(name.startswith("time/") for name in metrics)  # written to the loggers, not self.log
    for step in (0, 1):
        times = timings.logged[step]
        # one micro-batch: no update_backward (every micro-batch's backward but the last's)
        assert set(times) == {f"time/{p}" for p in ("generation", "reward", "policy_logprobs", "reference",
                                                    "update_forward")}
        assert all(seconds > 0 for seconds in times.values())


def test_engine_resyncs_only_after_optimizer_steps(tiny_model_dir):
    engine = EchoEngine()
    module = RLOOModule(tiny_model_dir, rewards={"funcs": [REWARD]}, sampling={"k": 2, "max_new_tokens": 6},
                        validation={"at_start": False}, generation_engine=engine)
    data = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="reverse", batch_size=3, num_train_rows=12,
                            num_val_rows=3, max_new_tokens=6)
    trainer = Trainer(accelerator="cpu", max_steps=2, accumulate_grad_batches=2, limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=data)
    assert len(engine.calls) == 4 and engine.syncs == 1 + 2  # 4 rollouts; fit start, then 2 optimizer steps


def test_default_engine_is_the_decode_loop_and_seeded(tiny_model_dir):
    from rloo_lightning.engines.decode import DecodeLoopEngine

    module = RLOOModule(tiny_model_dir, rewards={"funcs": [REWARD]}, sampling={"k": 2, "max_new_tokens": 6})
    module.configure_model()
    assert isinstance(module.engine, DecodeLoopEngine)
    tok = module.tokenizer
    batch = collate_prompts([{"input_ids": tok(p)["input_ids"], "prompt": p, "columns": {}} for p in ["abc=", "hg="]],
                            tok.pad_token_id)
    a, b = module.sample(batch, 2, seed=3), module.sample(batch, 2, seed=3)
    assert torch.equal(a.completion_ids, b.completion_ids)
    ids = batch["input_ids"].repeat_interleave(2, 0)
    direct = module.engine.generate(module.policy, tok, ids, batch["attention_mask"].repeat_interleave(2, 0),
                                    module.generation_config, 3)
    assert torch.equal(direct, a.completion_ids)
    assert not module.timer.enabled and module.timer("x") is module.timer("y")  # the shared no-op context


def test_sampling_and_reference_run_grad_free_and_hand_back_normal_tensors(tiny_model_dir):
    """Unsharded, generation and the reference run under inference_mode (less per-op bookkeeping), yet what
    they return enters the loss's autograd graph, which inference tensors cannot: they are copied out."""
    from module_helpers import configured_module, scored_rollout

    module = configured_module(tiny_model_dir, k=2)
    assert isinstance(module._grad_free(), torch.inference_mode)
    seen = []
    module.engine = EchoEngine()
    original = module.engine.generate

    def spy(*args, **kwargs):
        seen.append(torch.is_inference_mode_enabled())
        return original(*args, **kwargs)

    module.engine.generate = spy
    rollout = scored_rollout(module)
    assert seen == [True] and not rollout.completion_ids.is_inference()
    module.rollout_loss(rollout)[0].backward()  # the reference's log-probs took part (beta > 0)
    assert rollout.ref_logp is not None and not rollout.ref_logp.is_inference()


def test_batch_transfer_moves_tensors_and_leaves_strings(tiny_model_dir):
    from module_helpers import prompt_batch

    from rloo_lightning.models import load_tokenizer

    data = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="reverse", batch_size=2)
    batch = prompt_batch(load_tokenizer(tiny_model_dir))
    moved = data.transfer_batch_to_device(batch, torch.device("cpu"), 0)
    assert moved["prompt"] is batch["prompt"] and moved["columns"] is batch["columns"]
    assert torch.equal(moved["input_ids"], batch["input_ids"]) and moved["input_ids"].device.type == "cpu"
