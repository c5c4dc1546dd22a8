"""DecodeLoopEngine, the default engine: it samples pi_theta (inverse-CDF draws have the right frequencies, the
log-probs it reports are the training forward's within 1e-4 on Llama-style and GPT-2 models), is deterministic in
its seed, leaves the global RNG alone, stops rows at EOS (with and without dropping them from the batch), and
hands what it does not implement to ``generate``."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from rloo_lightning.engines.decode import DecodeLoopEngine, plain_sampling, sample_from_logits
from rloo_lightning.algo.logprobs import completion_mask
from rloo_lightning.forward import sequence_logprobs
from rloo_lightning.rollout import Rollout, sampling_config

VOCAB, PAD, EOS = 40, 0, 1


def _model(kind: str):
    if kind == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD)
    else:
        config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=PAD)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # a strong EOS logit, so that rows end at different lengths
        model.get_output_embeddings().weight[EOS] *= 4
    return model.train()


def _prompts(n: int = 3, k: int = 4):
    ids = torch.tensor([[PAD, PAD, 5, 6, 7], [PAD, 8, 9, 10, 11], [12, 13, 14, 15, 16]])[:n]
    mask = (ids != PAD).long()
    return ids.repeat_interleave(k, 0), mask.repeat_interleave(k, 0)


def test_inverse_cdf_draws_have_the_distribution_frequencies():
    probs = torch.tensor([0.5, 0.25, 0.0, 0.125, 0.0625, 0.0625])
    logits = probs.clamp(min=1e-45).log().expand(50_000, -1)
    logits = torch.where(probs > 0, logits, torch.tensor(-float("inf")))
    tokens, logp = sample_from_logits(logits, 1.0, torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=6).double()
    n = tokens.numel()
    assert counts[2] == 0 and counts[4] > 0  # probability 0 is never drawn
    sd = (n * probs * (1 - probs)).sqrt()
    assert ((counts - n * probs).abs() <= 5 * sd + 1e-9).all(), counts.tolist()
    torch.testing.assert_close(logp, probs.log()[tokens], atol=1e-6, rtol=0)
    # temperature: softmax(logits / T)
    tokens, logp = sample_from_logits(logits[:4], 0.5, torch.Generator().manual_seed(1))
    torch.testing.assert_close(logp, torch.log_softmax(logits[:4] / 0.5, -1).gather(1, tokens[:, None]).squeeze(1))
    greedy, _ = sample_from_logits(logits[:3], 1.0, None, greedy=True)
    assert greedy.tolist() == [0, 0, 0]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("compact", [True, False], ids=["compact", "full"])
def test_engine_samples_pi_theta(kind, compact):
    model, (ids, mask) = _model(kind), _prompts()
    cfg = sampling_config(max_new_tokens=10, eos_token_ids=[EOS], pad_token_id=PAD, temperature=0.8)
    engine = DecodeLoopEngine(return_logprobs=True, compact=compact)
    rng = torch.get_rng_state()
    with torch.inference_mode():
        out, logp = engine.generate(model, None, ids, mask, cfg, seed=5)
        again, _ = engine.generate(model, None, ids, mask, cfg, seed=5)
        other, _ = engine.generate(model, None, ids, mask, cfg, seed=6)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is untouched
    assert model.training  # restored
    assert torch.equal(out, again) and not torch.equal(out, other)
    m = completion_mask(out, [EOS])
    lengths = m.sum(1)
    assert lengths.min() < lengths.max()  # rows ended at different steps
    assert ((out == PAD) | (m > 0)).all()  # padding after each row's EOS
    assert (logp[m == 0] == 0).all()
    rollout = Rollout(k=4, prompt_ids=ids, prompt_mask=mask, completion_ids=out.clone(), completion_mask=m,
                      truncated=m.all(1), prompts=[], completions=[])
    model.eval()
    with torch.no_grad():
        train_logp, _ = sequence_logprobs(model, rollout, temperature=0.8)
    torch.testing.assert_close(train_logp * m, logp * m, atol=1e-4, rtol=0)


def test_compacting_finished_rows_changes_nothing_but_the_work():
    model, (ids, mask) = _model("llama"), _prompts()
    cfg = sampling_config(max_new_tokens=10, eos_token_ids=[EOS], pad_token_id=PAD, temperature=1.0)
    with torch.inference_mode():
        compact = DecodeLoopEngine(return_logprobs=True, compact=True).generate(model, None, ids, mask, cfg, 2)
        full = DecodeLoopEngine(return_logprobs=True, compact=False).generate(model, None, ids, mask, cfg, 2)
    # The random stream draws one number per live row: the first step (all rows live) agrees exactly.
    assert torch.equal(compact[0][:, 0], full[0][:, 0])
    torch.testing.assert_close(compact[1][:, 0], full[1][:, 0])


def test_greedy_is_the_argmax_and_matches_generate():
    from rloo_lightning.engines import HFGenerateEngine

    model, (ids, mask) = _model("llama"), _prompts(k=1)
    cfg = sampling_config(max_new_tokens=8, eos_token_ids=[EOS], pad_token_id=PAD, do_sample=False)
    with torch.inference_mode():
        ours = DecodeLoopEngine().generate(model, None, ids, mask, cfg, 0)
        theirs = HFGenerateEngine().generate(model, None, ids, mask, cfg, 0)
    m = completion_mask(ours, [EOS])
    assert torch.equal(ours * m.long(), theirs[:, :ours.shape[1]] * m.long())


def test_what_it_does_not_implement_goes_to_generate(monkeypatch):
    model, (ids, mask) = _model("llama"), _prompts()
    engine = DecodeLoopEngine()
    called = []
    monkeypatch.setattr(engine._fallback, "generate", lambda *a, **kw: called.append(1) or "fallback")
    for kwargs in ({"top_k": 5}, {"top_p": 0.9}, {"repetition_penalty": 1.2}, {"stop_strings": ["ab"]}):
        cfg = sampling_config(max_new_tokens=4, eos_token_ids=[EOS], pad_token_id=PAD, **kwargs)
        assert not plain_sampling(cfg)
        assert engine.generate(model, None, ids, mask, cfg, 0) == "fallback"
    assert len(called) == 4
    assert plain_sampling(sampling_config(max_new_tokens=4, eos_token_ids=[EOS], pad_token_id=PAD))


def test_the_module_samples_with_it_by_default(tiny_model_dir):
    from rloo_lightning import RLOOModule
    from rloo_lightning.engines.decode import DecodeLoopEngine as Default

    module = RLOOModule(tiny_model_dir, rewards={"funcs": ["reward_helpers.length_reward"]})
    assert isinstance(module.engine, Default)


def test_chunked_head_is_the_head_and_is_removed_after_generation():
    from rloo_lightning.engines.decode import HEAD_CHUNK, _chunked_head

    head = torch.nn.Linear(8, HEAD_CHUNK * 2 + 5, bias=True)
    x = torch.randn(3, 1, 8)
    with torch.no_grad():
        torch.testing.assert_close(_chunked_head(head, x), head(x), atol=1e-6, rtol=1e-6)
    assert _chunked_head(head, x).requires_grad  # with grad on it is the plain head (mm(out=) has no autograd)
    model, (ids, mask) = _model("llama"), _prompts()
    cfg = sampling_config(max_new_tokens=4, eos_token_ids=[EOS], pad_token_id=PAD)
    with torch.inference_mode():
        chunked = DecodeLoopEngine(chunk_head=True).generate(model, None, ids, mask, cfg, 9)
        whole = DecodeLoopEngine(chunk_head=False).generate(model, None, ids, mask, cfg, 9)
    assert torch.equal(chunked, whole)
    assert "forward" not in vars(model.get_output_embeddings())  # the instance patch is gone
