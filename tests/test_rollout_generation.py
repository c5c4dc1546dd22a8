"""Generation: the module's explicit sampler (never the model's shipped config), seeds, the RNG."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from rloo_lightning.data import collate_prompts
from rloo_lightning.models import load_causal_lm, load_tokenizer
from rloo_lightning.module import RLOOModule
from rloo_lightning.rollout import derive_seed, generate_rollout, sampling_config

REWARD = "rloo_lightning.tasks.reverse.reward"


@pytest.fixture(scope="module")
def shipped_biased_dir(tmp_path_factory):
    """A tiny model whose *shipped* generation_config would make sampling (near) deterministic."""
    from rloo_lightning.models import build_char_tokenizer, build_tiny_llama

    directory = tmp_path_factory.mktemp("tiny_shipped_topk1")
    tok = build_char_tokenizer("abcdefgh=", model_max_length=32)
    model = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32, seed=0)
    gc = model.generation_config
    gc.do_sample = True
    gc.top_k = 1
    gc.repetition_penalty = 5.0
    gc.min_p = 0.9
    gc.suppress_tokens = [tok.eos_token_id]
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory)


def _batch(tok, prompts):
    rows = [{"input_ids": tok(p)["input_ids"], "prompt": p, "columns": {"answer": p[:-1][::-1]}} for p in prompts]
    return collate_prompts(rows, tok.pad_token_id)


def _module(path, **groups):
    module = RLOOModule(model_name_or_path=path, rewards={"funcs": [REWARD]},
                        kl={"beta": 0.0, **groups.pop("kl", {})},
                        sampling={"max_new_tokens": 8, **groups.pop("sampling", {})}, **groups)
    module.configure_model()
    return module


def test_shipped_generation_config_really_is_biased(shipped_biased_dir):
    # Guard for the next test: the saved model does carry the biasing config.
    model = load_causal_lm(shipped_biased_dir)
    assert model.generation_config.top_k == 1
    assert model.generation_config.repetition_penalty == 5.0


def test_module_samples_with_its_own_config_not_the_shipped_one(shipped_biased_dir):
    module = _module(shipped_biased_dir)
    gc = module.generation_config
    assert gc.top_k == 0 and gc.top_p == 1.0 and gc.repetition_penalty == 1.0 and gc.do_sample
    assert gc.temperature == 1.0
    assert gc.min_p is None and not gc.suppress_tokens

    tok = module.tokenizer
    batch = _batch(tok, ["abcd="])
    rollout = module.sample(batch, 32, seed=module.sampling_seed("train", 0))
    # top_k=1 (or min_p=0.9) would make all 32 identical; a random tiny model is near uniform.
    assert len(set(rollout.completions)) >= 16
    # suppress_tokens=[eos] would forbid ending; here some completions end.
    assert (~rollout.truncated).any()

    # The sampling distribution is exactly softmax(logits / T): no top-k, no penalty, no min-p.
    prompt_ids = batch["input_ids"].repeat_interleave(4, 0)
    prompt_mask = batch["attention_mask"].repeat_interleave(4, 0)
    module.policy.eval()
    # generate_rollout empties the shipped config during generate; do the same for this direct call.
    module.policy.generation_config = GenerationConfig()
    with torch.no_grad():
        out = module.policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                                     generation_config=module.generation_config,
                                     output_scores=True, return_dict_in_generate=True)
        full = module.policy(input_ids=out.sequences, attention_mask=torch.ones_like(out.sequences)).logits
    module.policy.train()
    P = prompt_ids.shape[1]
    for t, scores in enumerate(out.scores):
        torch.testing.assert_close(scores, full[:, P - 1 + t], rtol=1e-4, atol=1e-4)


# In transformers 5, generate() fills every None field of the given config from the model's shipped
# generation_config; generate_rollout must keep a shipped min_p / suppress_tokens out of the sampler.
def test_generate_rollout_with_sampling_config_ignores_shipped_config(shipped_biased_dir):
    tok = load_tokenizer(shipped_biased_dir)
    model = load_causal_lm(shipped_biased_dir)
    assert model.generation_config.min_p == 0.9  # still the shipped config: nobody replaced it
    batch = _batch(tok, ["abcd="])
    config = sampling_config(8, [tok.eos_token_id], tok.pad_token_id)
    rollout = generate_rollout(model, tok, batch["input_ids"], batch["attention_mask"], batch["prompt"],
                               batch["columns"], 32, config, seed=3)
    assert len(set(rollout.completions)) >= 16, rollout.completions[:4]
    assert (~rollout.truncated).any()


@pytest.fixture(scope="module")
def module(tiny_model_dir):
    return _module(tiny_model_dir)


def test_same_seed_same_rollout_and_step_seeds_differ(module):
    batch = _batch(module.tokenizer, ["abc=", "hgfedcb="])
    s0 = module.sampling_seed("train", 0)
    s1 = module.sampling_seed("train", 1)
    assert s0 != s1
    a = module.sample(batch, 4, s0)
    torch.manual_seed(999)  # the global RNG state must not matter
    b = module.sample(batch, 4, s0)
    c = module.sample(batch, 4, s1)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert a.completions == b.completions
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # the k samples of one prompt differ from each other too (independent draws)
    assert len(set(a.completions[:4])) > 1


def test_rollout_leaves_global_rng_untouched(module):
    batch = _batch(module.tokenizer, ["abc="])
    torch.manual_seed(123)
    state = torch.get_rng_state()
    expected_next = torch.rand(5)
    torch.set_rng_state(state)
    module.sample(batch, 4, seed=42)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(torch.rand(5), expected_next)


def test_rollout_restores_training_mode(module):
    module.policy.train()
    module.sample(_batch(module.tokenizer, ["abc="]), 2, seed=0)
    assert module.policy.training
    module.policy.eval()
    module.sample(_batch(module.tokenizer, ["abc="]), 2, seed=0)
    assert not module.policy.training
    module.policy.train()


def test_rollout_is_prompt_major(module):
    batch = _batch(module.tokenizer, ["abc=", "hgfedcb="])
    r = module.sample(batch, 3, seed=1)
    assert r.prompts == ["abc="] * 3 + ["hgfedcb="] * 3
    assert r.columns["answer"] == ["cba"] * 3 + ["bcdefgh"] * 3
    assert torch.equal(r.prompt_ids, batch["input_ids"].repeat_interleave(3, 0))
    assert r.num_prompts == 2


def test_derive_seed_differs_across_rank_and_step():
    base = derive_seed(0, 0, "train", 0)
    assert derive_seed(0, 0, "train", 0) == base  # stable
    assert derive_seed(0, 1, "train", 0) != base  # rank
    assert derive_seed(0, 0, "train", 1) != base  # step
    assert derive_seed(1, 0, "train", 0) != base  # base seed
    assert derive_seed(0, 0, "val", 0) != base  # stream
    seeds = {derive_seed(0, rank, "train", step) for rank in range(8) for step in range(50)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**63 for s in seeds)


def test_module_sampling_seed_depends_on_rank(module, monkeypatch):
    s_rank0 = module.sampling_seed("train", 3)
    monkeypatch.setattr(type(module), "global_rank", property(lambda self: 1))
    assert module.sampling_seed("train", 3) != s_rank0
    assert module.sampling_seed("train", 3) == derive_seed(module.cfg.sampling.seed, 1, "train", 3)
