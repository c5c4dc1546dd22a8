"""The shared-prompt forward (one forward per prompt group, its KV cache serving the group's k completions)
gives the log-probs and the gradient of the plain forward (each prompt run with each completion), up to float
rounding, on a Llama-style model (rotary positions, grouped-query attention) and on GPT-2 (learned absolute
positions); and no completion sees another completion of its group."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from rloo_lightning.algo.logprobs import token_logprobs
from rloo_lightning.forward import can_share_prompt, completion_logits, sequence_logprobs
from rloo_lightning.rollout import Rollout

VOCAB, PAD = 50, 0


def _llama():
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD)
    return config


def _gpt2():
    return GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=PAD)


def _model(config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    model.train()
    for m in model.modules():  # the comparison needs the same function twice: no dropout
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def _rollout(n: int = 3, k: int = 4, prompt_lengths=(5, 3, 7), width: int = 6, seed: int = 1) -> Rollout:
    """n left-padded prompts of different lengths, each repeated k times, and completions of varied length
    (padding after the first EOS = id 1)."""
    g = torch.Generator().manual_seed(seed)
    P = max(prompt_lengths)
    ids = torch.full((n, P), PAD)
    mask = torch.zeros(n, P, dtype=torch.long)
    for i, length in enumerate(prompt_lengths):
        ids[i, P - length:] = torch.randint(2, VOCAB, (length,), generator=g)
        mask[i, P - length:] = 1
    comp = torch.randint(2, VOCAB, (n * k, width), generator=g)
    comp_mask = torch.ones(n * k, width)
    for row, end in enumerate(torch.randint(1, width + 1, (n * k,), generator=g).tolist()):
        if end < width:
            comp[row, end - 1] = 1
            comp[row, end:] = PAD
            comp_mask[row, end:] = 0
    return Rollout(k=k, prompt_ids=ids.repeat_interleave(k, 0), prompt_mask=mask.repeat_interleave(k, 0),
                   completion_ids=comp, completion_mask=comp_mask, truncated=comp_mask.all(1), prompts=[""] * (n * k),
                   completions=[""] * (n * k))


def _logp_and_grad(model, rollout, share: bool, rows=slice(None)):
    model.zero_grad(set_to_none=True)
    logp, _ = sequence_logprobs(model, rollout, rows, temperature=0.7, share_prompt=share)
    mask = rollout.completion_mask[rows]
    weights = torch.linspace(-1, 1, logp.shape[0])[:, None]  # advantage-like, of both signs
    (weights * logp * mask).sum().backward()
    return (logp * mask).detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("config", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_shared_prompt_matches_the_plain_forward(config):
    model, rollout = _model(config()), _rollout()
    assert can_share_prompt(model, rollout.prompt_ids, rollout.prompt_mask, rollout.k)
    plain, plain_grad = _logp_and_grad(model, rollout, share=False)
    shared, shared_grad = _logp_and_grad(model, rollout, share=True)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
    assert plain_grad.keys() == shared_grad.keys() and plain_grad
    for name in plain_grad:
        torch.testing.assert_close(shared_grad[name], plain_grad[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("config", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_no_completion_attends_to_another_of_its_group(config):
    """Changing one completion changes no other row's log-probs, and the gradient of one row's log-probs
    reaches no other completion's embeddings."""
    model, rollout = _model(config()), _rollout()
    model.eval()
    base, _ = sequence_logprobs(model, rollout, temperature=1.0, share_prompt=True)
    edited = _rollout()
    edited.completion_ids[1, :3] = torch.tensor([7, 8, 9])  # row 1: the second sample of prompt 0
    changed, _ = sequence_logprobs(model, edited, temperature=1.0, share_prompt=True)
    others = [r for r in range(rollout.completion_ids.shape[0]) if r != 1]
    torch.testing.assert_close(changed[others], base[others], atol=1e-6, rtol=0)
    assert not torch.allclose(changed[1], base[1])

    # Through the embeddings: d logp[row 0] / d input embedding of every other completion row is 0.
    embed = model.get_input_embeddings()
    seen = []
    hook = embed.register_forward_hook(lambda m, i, out: (out.retain_grad(), seen.append(out))[-1])
    try:
        logits = completion_logits(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                   rollout.completion_mask, group_size=rollout.k)
        tokens = rollout.completion_ids[:, : logits.shape[1]]
        token_logprobs(logits, tokens)[0].sum().backward()
    finally:
        hook.remove()
    assert len(seen) == 2  # the prompts' forward and the completions' forward
    completion_grads = seen[1].grad  # [b, T'-1, H]
    assert completion_grads[0].abs().sum() > 0
    assert completion_grads[1:].abs().sum() == 0


def test_micro_batches_that_split_a_group_use_the_plain_forward():
    model, rollout = _model(_llama()), _rollout()
    # rows 2..6 split prompt 0's and prompt 1's groups: not shareable, and the result is still the plain one
    plain, plain_grad = _logp_and_grad(model, rollout, share=False, rows=slice(2, 6))
    shared, shared_grad = _logp_and_grad(model, rollout, share=True, rows=slice(2, 6))
    assert torch.equal(shared, plain)
    for name in plain_grad:
        assert torch.equal(shared_grad[name], plain_grad[name])
    # whole groups (rows 4..12) share
    plain, _ = _logp_and_grad(model, rollout, share=False, rows=slice(4, 12))
    shared, _ = _logp_and_grad(model, rollout, share=True, rows=slice(4, 12))
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)


def test_unequal_prompts_within_a_group_or_checkpointing_are_not_shared():
    model, rollout = _model(_llama()), _rollout()
    ids = rollout.prompt_ids.clone()
    ids[1, -1] = 3 if ids[1, -1] != 3 else 4  # the second row of group 0 differs
    assert not can_share_prompt(model, ids, rollout.prompt_mask, rollout.k)
    assert not can_share_prompt(model, rollout.prompt_ids[:5], rollout.prompt_mask[:5], rollout.k)
    model.gradient_checkpointing_enable()
    assert not can_share_prompt(model, rollout.prompt_ids, rollout.prompt_mask, rollout.k)
    model.eval()  # transformers keeps the cache in eval mode
    assert can_share_prompt(model, rollout.prompt_ids, rollout.prompt_mask, rollout.k)


def test_prompt_groups_is_the_run_length_gcd():
    from rloo_lightning.engines.hf_generate import prompt_groups

    ids = torch.tensor([[1, 2], [1, 2], [3, 4], [3, 4], [3, 4], [3, 4]])
    mask = torch.ones_like(ids)
    assert prompt_groups(ids, mask) == 2  # runs of 2 and 4 (two equal neighbouring groups)
    assert prompt_groups(ids[:3], mask[:3]) == 1
    other = mask.clone()
    other[1, 0] = 0  # same ids, another mask: not the same prompt
    assert prompt_groups(ids[:2], other[:2]) == 1


@pytest.mark.parametrize("config", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_shared_prefill_samples_what_the_plain_prefill_samples(config):
    """Same seed, same draws: the shared prefill changes only rounding, so the tokens are the same here, and the
    log-probs the engine reports match the training forward's within 1e-4 (the engine is still pi_theta)."""
    from rloo_lightning.engines import HFGenerateEngine
    from rloo_lightning.rollout import sampling_config

    model, rollout = _model(config()), _rollout(width=1)
    model.generation_config.pad_token_id = PAD
    cfg = sampling_config(max_new_tokens=8, eos_token_ids=[1], pad_token_id=PAD, temperature=0.9)
    outs, shapes = {}, {}
    for share in (False, True):
        engine = HFGenerateEngine(return_logprobs=True, share_prompt=share)
        seen = []
        hook = model.get_input_embeddings().register_forward_hook(
            lambda m, i, out, seen=seen: seen.append(tuple(out.shape[:2])))
        with torch.no_grad():
            outs[share] = engine.generate(model, None, rollout.prompt_ids, rollout.prompt_mask, cfg, seed=3)
        hook.remove()
        shapes[share] = seen
    n, P = rollout.num_prompts, rollout.prompt_ids.shape[1]
    assert shapes[False][0] == (n * rollout.k, P)  # every row's whole prompt
    assert shapes[True][:2] == [(n, P - 1), (n * rollout.k, 1)]  # each prompt once, then only its last column
    (plain_ids, plain_logp), (ids, logp) = outs[False], outs[True]
    assert torch.equal(ids, plain_ids)
    from rloo_lightning.algo.logprobs import completion_mask

    mask = completion_mask(ids, [1])
    torch.testing.assert_close(logp * mask, plain_logp * mask, atol=1e-5, rtol=0)
    sampled = Rollout(k=rollout.k, prompt_ids=rollout.prompt_ids, prompt_mask=rollout.prompt_mask, completion_ids=ids,
                      completion_mask=mask, truncated=mask.all(1), prompts=[], completions=[])
    model.eval()
    with torch.no_grad():
        train_logp, _ = sequence_logprobs(model, sampled, temperature=0.9, share_prompt=True)
    torch.testing.assert_close(train_logp * mask, logp * mask, atol=1e-4, rtol=0)


@pytest.mark.parametrize("share", ["always", "never", "auto"])
def test_update_share_prompt_option_decides_the_update_forwards(tiny_model_dir, share):
    """``model.update.share_prompt``: two forwards of the policy per update (the prompts, then the completions
    against their cache) with ``always``, one over whole sequences with ``never`` and, for this tiny model, with
    ``auto``; the loss agrees either way."""
    from rloo_lightning import RLOOModule
    from rloo_lightning.data import collate_prompts

    losses = {}
    for option in (share, "never" if share == "always" else "always"):
        module = RLOOModule(tiny_model_dir, rewards={"funcs": ["reward_helpers.length_reward"]},
                            sampling={"k": 3, "max_new_tokens": 5}, update={"share_prompt": option})
        module.configure_model()
        tok = module.tokenizer
        batch = collate_prompts([{"input_ids": tok(p)["input_ids"], "prompt": p, "columns": {}}
                                 for p in ["abc=", "hgfed="]], tok.pad_token_id)
        rollout = module.sample(batch, 3, seed=4)
        rollout.rewards = torch.tensor([0.1, 0.5, 0.9, 0.3, 0.2, 0.8])
        calls = []
        hook = module.policy.get_input_embeddings().register_forward_hook(lambda *a, calls=calls: calls.append(1))
        loss, _ = module.rollout_loss(rollout)
        hook.remove()
        losses[option] = float(loss)
        if option == share:  # the reference is a copy with its own embedding: these are the policy's forwards
            assert len(calls) == (2 if share == "always" else 1)
    first, second = losses.values()
    assert first == pytest.approx(second, abs=1e-5)


def test_share_prompt_auto_weighs_the_saved_compute():
    from rloo_lightning.config import UpdateArgs
    from rloo_lightning.forward import worth_sharing

    assert worth_sharing(134_515_008, 4, 4 * 34)  # SmolLM2-135M at the benchmark's shape
    assert not worth_sharing(100_000, 4, 16 * 6)  # a tiny model
    assert not worth_sharing(134_515_008, 1, 4 * 34)  # nothing to share
    with pytest.raises(ValueError, match="update.share_prompt"):
        UpdateArgs(share_prompt="yes")
