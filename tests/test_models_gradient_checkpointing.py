"""Gradient checkpointing: on for the update, off (KV cache kept) during generation."""

from __future__ import annotations

import torch

from rloo_lightning import RLOOModule
from rloo_lightning.data import collate_prompts

REWARD = "rloo_lightning.tasks.reverse.reward"


def _module(model_dir: str, checkpointing: bool) -> RLOOModule:
    m = RLOOModule(model_dir, rewards={"funcs": [REWARD]}, sampling={"k": 3, "max_new_tokens": 6}, kl={"beta": 0.05},
                   policy={"gradient_checkpointing": checkpointing})
    m.configure_model()
    m.log = lambda *a, **kw: None
    return m


def _batch(tok, prompts):
    return collate_prompts([{"input_ids": tok(p)["input_ids"], "prompt": p, "columns": {}} for p in prompts],
                           tok.pad_token_id)


def test_generation_keeps_kv_cache_while_checkpointing_is_configured(tiny_model_dir):
    module = _module(tiny_model_dir, checkpointing=True)
    assert module.policy.training
    widths = []
    hook = module.policy.model.register_forward_pre_hook(
        lambda mod, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        rollout = module.sample(_batch(module.tokenizer, ["abc=", "hgfed="]), 3, seed=1)
    finally:
        hook.remove()
    # With the KV cache, every forward after the prompt's feeds one new token.
    assert len(widths) >= 2 and widths[0] == rollout.prompt_ids.shape[1] and set(widths[1:]) == {1}
    assert module.policy.training  # back in train mode for the update


def test_checkpointed_update_has_the_same_gradient(tiny_model_dir):
    grads, recomputed = {}, {}
    for checkpointing in (False, True):
        module = _module(tiny_model_dir, checkpointing)
        rollout = module.sample(_batch(module.tokenizer, ["abc=", "hgfed="]), 3, seed=7)
        rollout.rewards = torch.tensor([0.1, 0.5, 0.9, 0.3, 0.3, 0.8])
        loss, _ = module.rollout_loss(rollout)
        # Count calls of one MLP's forward (module hooks do not fire in torch's recomputation).
        mlp, calls = module.policy.model.layers[0].mlp, []
        original = mlp.forward
        mlp.forward = lambda *a, calls=calls, original=original, **kw: calls.append(1) or original(*a, **kw)
        loss.backward()  # with checkpointing, the layers' forwards run again here
        mlp.forward = original
        recomputed[checkpointing] = len(calls)
        grads[checkpointing] = [p.grad.clone() for p in module.policy.parameters()]
    assert recomputed == {False: 0, True: 1}
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
