"""bf16: log-softmax in fp32 always, the reference in the policy's dtype, a bf16 step close to fp32."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer

from rloo_lightning import RLOOModule
from module_helpers import REWARD, configured_module, scored_rollout

from rloo_lightning.data import PromptDataModule



def _module(model_dir: str) -> RLOOModule:
    return configured_module(model_dir, kl={"beta": 0.1})


_rollout = scored_rollout


def _step(module, rollout, precision: str):
    """Loss, logp dtype and flat fp32 gradient of one update, as Lightning's precision would run it."""
    if precision == "bf16-true":
        module.policy.to(torch.bfloat16)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else torch.enable_grad()
    with context:
        logp, _ = module.logprobs(module.policy, rollout)
        loss, _ = module.rollout_loss(rollout)
    loss.backward()
    grad = torch.cat([p.grad.float().reshape(-1) for p in module.policy.parameters()])
    return loss.detach().float(), logp.dtype, grad


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_step_matches_fp32_within_tolerance(tiny_model_dir, precision):
    ref_module = _module(tiny_model_dir)
    rollout = _rollout(ref_module)
    loss32, dtype32, grad32 = _step(ref_module, rollout, "32-true")
    loss16, dtype16, grad16 = _step(_module(tiny_model_dir), rollout, precision)
    assert dtype32 == dtype16 == torch.float32  # log-probs are always taken in fp32
    assert grad32.norm() > 1e-3
    cosine = torch.nn.functional.cosine_similarity(grad16, grad32, dim=0)
    assert cosine > 0.99, f"{precision}: gradient direction differs from fp32 (cosine {cosine:.4f})"
    assert (grad16.norm() / grad32.norm() - 1).abs() < 0.05
    torch.testing.assert_close(loss16, loss32, rtol=0.05, atol=2e-3)


def test_reference_follows_the_policy_dtype_so_kl_starts_at_exactly_zero(tiny_model_dir):
    module = _module(tiny_model_dir)
    module.policy.to(torch.bfloat16)  # what Lightning's bf16-true does to the registered policy
    rollout = _rollout(module)
    module.rollout_loss(rollout)
    assert next(module.reference.parameters()).dtype == torch.bfloat16
    assert torch.equal(rollout.kl, torch.zeros_like(rollout.kl))  # identical weights and dtype


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_fit_runs_through_lightning(tiny_model_dir, precision):
    module = RLOOModule(tiny_model_dir, rewards={"funcs": [REWARD]}, sampling={"k": 4, "max_new_tokens": 6},
                        validation={"at_start": False}, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    data = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="reverse", batch_size=4,
                            num_train_rows=8, num_val_rows=4, max_new_tokens=6)
    before = {n: p.detach().clone() for n, p in _module(tiny_model_dir).policy.named_parameters()}
    trainer = Trainer(accelerator="cpu", precision=precision, max_steps=2, limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=data)
    metrics = trainer.callback_metrics
    assert all(torch.isfinite(metrics[k]) for k in ("train/loss", "train/kl", "train/entropy"))
    expected = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert {p.dtype for p in module.policy.parameters()} == {expected}
    assert next(module.reference.parameters()).dtype == expected
    assert any(not torch.equal(p.float(), before[n]) for n, p in module.policy.named_parameters())
