"""The generation seam: a custom engine replaces HF generate; the default is the policy's own generate."""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer

from rloo_lightning import RLOOModule
from rloo_lightning.data import PromptDataModule, collate_prompts
from rloo_lightning.rollout import GenerationEngine, HFGenerateEngine

REWARD = "rloo_lightning.tasks.reverse.reward"


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
    module = RLOOModule(tiny_model_dir, reward_funcs=[REWARD], k=2, max_new_tokens=6, validate_at_start=False,
                        generation_engine=engine, time_phases=True)
    data = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="reverse", batch_size=3, num_train_rows=12,
                            num_val_rows=3, max_new_tokens=6)
    trainer = Trainer(accelerator="cpu", max_steps=2, limit_val_batches=0, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=data)
    assert [c[:2] for c in engine.calls] == [(6, 6), (6, 6)]  # 3 prompts x k=2, the module's budget
    assert engine.calls[0][2] != engine.calls[1][2]  # a fresh seed each step
    assert engine.syncs == 2  # after each optimizer step
    metrics = trainer.callback_metrics
    assert metrics["train/completion_length"] == 4  # 3 echoed tokens + EOS, nothing truncated
    assert metrics["train/clipped_ratio"] == 0
    for phase in ("generation", "reward", "policy_forward", "reference"):
        assert metrics[f"time/{phase}"] >= 0


def test_engine_resyncs_only_after_optimizer_steps(tiny_model_dir):
    engine = EchoEngine()
    module = RLOOModule(tiny_model_dir, reward_funcs=[REWARD], k=2, max_new_tokens=6, validate_at_start=False,
                        generation_engine=engine)
    data = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="reverse", batch_size=3, num_train_rows=12,
                            num_val_rows=3, max_new_tokens=6)
    trainer = Trainer(accelerator="cpu", max_steps=2, accumulate_grad_batches=2, limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=data)
    assert len(engine.calls) == 4 and engine.syncs == 2  # 4 rollouts, 2 optimizer steps


def test_default_engine_is_hf_generate_and_seeded(tiny_model_dir):
    module = RLOOModule(tiny_model_dir, reward_funcs=[REWARD], k=2, max_new_tokens=6)
    module.configure_model()
    assert isinstance(module.engine, HFGenerateEngine)
    tok = module.tokenizer
    batch = collate_prompts([{"input_ids": tok(p)["input_ids"], "prompt": p, "columns": {}} for p in ["abc=", "hg="]],
                            tok.pad_token_id)
    a, b = module.rollout(batch, 2, seed=3), module.rollout(batch, 2, seed=3)
    assert torch.equal(a.completion_ids, b.completion_ids)
    ids = batch["input_ids"].repeat_interleave(2, 0)
    direct = module.engine.generate(module.policy, tok, ids, batch["attention_mask"].repeat_interleave(2, 0),
                                    module.generation_config, 3)
    assert torch.equal(direct, a.completion_ids)
    assert not module.timer.enabled and module.timer("x") is module.timer("y")  # the shared no-op context
