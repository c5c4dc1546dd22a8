"""Rollout batch vs update micro-batch: the same loss and gradient, one optimizer step per rollout."""

from __future__ import annotations

import pytest
import torch

from rloo_lightning import RLOOModule
from module_helpers import REWARD, configured_module, prompt_batch



_module, _batch = configured_module, prompt_batch


def _loss_and_grads(model_dir: str, micro: int | None, beta: float, keep_mask=None):
    module = _module(model_dir, update={"micro_batch_size": micro}, kl={"beta": beta},
                     shaping={"mask_truncated_completions": keep_mask is not None})
    rollout = module.sample(_batch(module.tokenizer), 3, seed=11)
    gen = torch.Generator().manual_seed(3)
    rollout.rewards = torch.rand(rollout.completion_ids.shape[0], generator=gen)
    if keep_mask is not None:
        rollout.truncated = ~keep_mask  # with shaping.mask_truncated_completions these rows leave the loss
    loss, entropy = module.rollout_loss(rollout)
    module.on_before_backward(loss)  # what Lightning calls before its backward
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.policy.named_parameters()}
    return loss.detach(), entropy, rollout, grads


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("micro", [1, 5, 12])
def test_micro_batched_update_equals_the_unsplit_one(tiny_model_dir, micro, beta):
    keep = torch.tensor([True, False, True] * 4)
    ref_loss, ref_entropy, ref_rollout, ref_grads = _loss_and_grads(tiny_model_dir, None, beta, keep)
    loss, entropy, rollout, grads = _loss_and_grads(tiny_model_dir, micro, beta, keep)
    assert torch.equal(rollout.completion_ids, ref_rollout.completion_ids)  # same rollout
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    mask = rollout.completion_mask  # positions past a row's end are not computed when it is split
    torch.testing.assert_close(entropy * mask, ref_entropy * mask, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rollout.advantages, ref_rollout.advantages, rtol=1e-5, atol=1e-6)
    if beta:
        torch.testing.assert_close(rollout.kl, ref_rollout.kl, rtol=1e-5, atol=1e-6)
    assert any(g.abs().max() > 1e-4 for g in ref_grads.values())
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-7, msg=name)


def test_micro_batches_bound_the_rows_per_forward(tiny_model_dir):
    module = _module(tiny_model_dir, update={"micro_batch_size": 5}, kl={"beta": 0.1})
    rollout = module.sample(_batch(module.tokenizer), 3, seed=11)
    rollout.rewards = torch.linspace(0, 1, 12)
    rows = []
    hook = module.policy.model.register_forward_pre_hook(
        lambda mod, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        module.rollout_loss(rollout)
    finally:
        hook.remove()
    # a no-grad pass for the KL, then the grad pass; never more than 5 rows at once
    assert rows == [5, 5, 2, 5, 5, 2]
    stash = module.grad_stash.grads
    assert stash is not None and len(stash) == len(list(module.policy.parameters()))


def test_micro_batch_size_must_be_positive(tiny_model_dir):
    with pytest.raises(ValueError, match=r"update\.micro_batch_size must be >= 1"):
        RLOOModule(tiny_model_dir, rewards={"funcs": [REWARD]}, update={"micro_batch_size": 0})
