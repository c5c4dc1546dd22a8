"""LoRA through peft: the reference is the base with the adapter off, adapter-only checkpoints, export."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from rloo_lightning import RLOOModule
from module_helpers import REWARD, configured_module, scored_rollout

from rloo_lightning.data import PromptDataModule
from rloo_lightning.update import micro_batches

pytest.importorskip("peft")

LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}


def _module(model_dir: str, lora: dict | None = LORA, beta: float = 0.1, lora_export: str = "merged") -> RLOOModule:
    return configured_module(model_dir, policy={"lora": lora, "lora_export": lora_export}, kl={"beta": beta})


_rollout = scored_rollout


def _perturb_adapter(module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def test_only_the_adapter_trains_and_no_reference_copy_is_made(tiny_model_dir):
    module = _module(tiny_model_dir)
    assert module.ref is not None and module.ref.copy is None  # the policy with its adapter off
    trainable = [n for n, p in module.policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # one copy of the base weights is resident: total parameter bytes = base + adapter
    full = _module(tiny_model_dir, lora=None)
    base_bytes = sum(p.numel() for p in full.policy.parameters())
    lora_bytes = sum(p.numel() for p in module.policy.parameters())
    ref_bytes = sum(p.numel() for p in full.reference.parameters())
    assert lora_bytes < base_bytes * 1.3 < base_bytes + ref_bytes


def test_reference_is_the_base_model_with_the_adapter_disabled(tiny_model_dir):
    module = _module(tiny_model_dir)
    rollout = _rollout(module)
    module.rollout_loss(rollout)
    assert torch.equal(rollout.kl, torch.zeros_like(rollout.kl))  # the adapter starts at exactly 0 (lora_B = 0)
    _perturb_adapter(module)
    module.rollout_loss(rollout)
    assert rollout.kl.abs().max() > 1e-3
    base = _module(tiny_model_dir, lora=None, beta=0.0)
    expected, _ = base.logprobs(base.policy, rollout)
    ref = module.reference_logprobs(rollout, micro_batches(rollout.completion_ids.shape[0], None))
    torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-6)
    # and the adapter is back on afterwards
    policy_logp, _ = module.logprobs(module.policy, rollout)
    assert not torch.allclose(policy_logp, expected)


def test_gradient_reaches_the_adapter_only(tiny_model_dir):
    module = _module(tiny_model_dir)
    _perturb_adapter(module)
    loss, _ = module.rollout_loss(_rollout(module))
    loss.backward()
    grads = {n: p.grad for n, p in module.policy.named_parameters()}
    assert all(g is None for n, g in grads.items() if "lora_" not in n)
    assert any(g is not None and g.abs().max() > 0 for n, g in grads.items() if "lora_A" in n)


def _fit(model_dir, root, max_steps, ckpt_path=None, **groups):
    module = RLOOModule(model_dir, rewards={"funcs": [REWARD]}, sampling={"k": 4, "max_new_tokens": 6},
                        policy={"lora": LORA}, validation={"at_start": False},
                        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), **groups)
    data = PromptDataModule(tokenizer_name_or_path=model_dir, task="reverse", batch_size=4,
                            num_train_rows=16, num_val_rows=4, max_new_tokens=6)
    trainer = Trainer(accelerator="cpu", max_steps=max_steps, limit_val_batches=0, logger=False,
                      default_root_dir=str(root), enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_train_steps=1, save_top_k=-1)])
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module


@pytest.mark.slow  # two fits (~10 s)
def test_checkpoint_holds_the_adapter_only_and_resume_restores_it(tiny_model_dir, tmp_path):
    module = _fit(tiny_model_dir, tmp_path / "a", 3)
    ckpts = sorted((tmp_path / "a" / "ckpt").glob("*.ckpt"))
    ckpt = torch.load(ckpts[-1], weights_only=True)
    policy_keys = [k for k in ckpt["state_dict"] if k.startswith("policy.")]
    assert policy_keys and all("lora_" in k for k in policy_keys)
    # the optimizer holds state for the adapter's parameters only
    assert len(ckpt["optimizer_states"][0]["state"]) == len(policy_keys)
    trained = {n: p.detach().clone() for n, p in module.policy.named_parameters() if "lora_" in n}
    assert any(v.abs().max() > 0 for n, v in trained.items() if "lora_B" in n)  # the adapter moved
    # load_from_checkpoint: the base comes from the model directory, the adapter from the checkpoint
    loaded = RLOOModule.load_from_checkpoint(ckpts[-1], weights_only=True)
    for n, p in loaded.policy.named_parameters():
        if "lora_" in n:
            torch.testing.assert_close(p, trained[n])
    # resuming runs on from the adapter (a 4th step) without complaint about the missing base keys
    resumed = _fit(tiny_model_dir, tmp_path / "b", 4, ckpt_path=str(ckpts[-1]))
    assert resumed.trainer.global_step == 4


@pytest.mark.parametrize("export", ["merged", "adapter"])
def test_export_merged_or_adapter_reproduces_the_policy(tiny_model_dir, tmp_path, export):
    from transformers import AutoModelForCausalLM

    module = _module(tiny_model_dir, lora_export=export)
    _perturb_adapter(module, seed=3)
    module.save_pretrained(str(tmp_path))
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        expected = module.policy(input_ids=ids).logits
        if export == "merged":
            assert not (tmp_path / "adapter_config.json").exists()
            reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
        else:
            from peft import PeftModel

            assert (tmp_path / "adapter_config.json").exists()
            base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
            reloaded = PeftModel.from_pretrained(base, str(tmp_path))
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5)
    assert "lora_A" in str(list(dict(module.policy.named_parameters()))[:50])  # the live policy is untouched


@pytest.mark.parametrize("bad, match", [
    ({"r": 4, "no_such_option": 1}, "policy.lora=.* is not a valid peft.LoraConfig"),
    ({"task_type": "SEQ_CLS"}, "policy.lora: task_type"),
    ({}, "policy.lora must be a non-empty mapping"),
])
def test_bad_lora_options_fail_at_construction(tiny_model_dir, bad, match):
    with pytest.raises(ValueError, match=match):
        RLOOModule(tiny_model_dir, rewards={"funcs": [REWARD]}, policy={"lora": bad})


def test_bad_lora_export_names_the_option(tiny_model_dir):
    with pytest.raises(ValueError, match="policy.lora_export must be one of 'merged', 'adapter'; got 'both'"):
        RLOOModule(tiny_model_dir, rewards={"funcs": [REWARD]}, policy={"lora": LORA, "lora_export": "both"})
