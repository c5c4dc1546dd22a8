"""VLLMServerEngine's client paths without vLLM: against the stand-in server of ``standin_vllm_server.py`` (the HTTP
API the engine uses, a real tiny transformers model behind it), the faults a server has on a cluster.

Retries keep each row's seed (no row lost or duplicated), a timed-out request is aborted before it is sent again, a
restarted server is found and synced again (and verified) before it samples, a canary that disagrees and a key that
is refused end the run with one line, a server that stops answering ends within the timeouts, and one that drains
its connections without answering (vLLM on SIGTERM) ends the rows.

Where the engine does not yet do what issue 58 ("Fail fast, lose nothing") asks, the test pins what it does today
with small timeouts and says, in a comment starting ``# issue 58:``, what it should become.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from rloo_lightning.engines.vllm_server import VLLMServerEngine
from rloo_lightning.models.loading import load_tokenizer
from standin_vllm_server import StandinVLLM

KEY = "standin-key-0123"
ROWS = 4  # two prompts, two samples each
#: The request_timeout of the tests that wait one out: short, yet long enough that an ordinary request of the tiny
#: model (milliseconds) never reaches it on a loaded machine; and the slack their time bounds allow.
SHORT, SLACK = 3, 5


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)


@pytest.fixture
def standin(tiny_model_dir):
    with StandinVLLM(tiny_model_dir, KEY) as server:
        yield server


@pytest.fixture
def engines(tmp_path):
    """``engines(server or [servers], **options)``: a VLLMServerEngine on stand-ins (sync folder in tmp_path, small
    timeouts), closed at the test's end."""
    made = []

    def make(server, **options):
        options = {"sync_dir": str(tmp_path / "sync"), "connect_timeout": 5, "request_timeout": 30,
                   "reconnect_timeout": 5, "retries": 2, **options}
        servers = server if isinstance(server, (list, tuple)) else [server]
        engine = VLLMServerEngine(urls=[s.url for s in servers], **options)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


@pytest.fixture
def policy(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tok = load_tokenizer(tiny_model_dir)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ids, mask = _prompts(tok, ["abc=", "hgfedc="], k=ROWS // 2)
    return model, tok, config, ids, mask


def _prompts(tok, texts: list[str], k: int):
    rows = [tok(text, add_special_tokens=False)["input_ids"] for text in texts for _ in range(k)]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _step(model, seed: int, scale: float = 0.05) -> None:
    """An update the canary sees: every weight moved by seeded noise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def _policy_logprobs(model, ids, mask, completion, eos: int) -> list[tuple[list[float], list[float]]]:
    """Per row, (the policy's log-probs of the sampled tokens up to the first EOS, their count)."""
    out = []
    with torch.no_grad():
        for prompt_row, m, row in zip(ids, mask, completion):
            prompt, tokens = prompt_row[m.bool()].tolist(), row.tolist()
            n = tokens.index(eos) + 1 if eos in tokens else len(tokens)
            x = torch.tensor([prompt + tokens[:n]])
            logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0, len(prompt) - 1:-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, x[0, len(prompt):, None])[:, 0].tolist())
    return out


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _weights_equal(server: StandinVLLM, model) -> bool:
    held = server.state_dict()
    return all(torch.equal(held[name], tensor) for name, tensor in model.state_dict().items())


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


# -- the stand-in is honest -----------------------------------------------------------------------------------------
def test_samples_and_logprobs_come_from_the_synced_weights(standin, engines, policy):
    model, tok, config, ids, mask = policy
    engine = engines(standin)
    engine.prepare(model, tok, config)
    assert not _weights_equal(standin, model)  # dummy weights until the first sync
    first = engine.generate(model, tok, ids, mask, config, seed=7)
    assert _weights_equal(standin, model)
    kinds = [e["kind"] for e in standin.entries(outcome="200")]
    load = kinds.index("rpc:rloo_load")
    assert kinds[load:load + 4] == ["rpc:rloo_load", "/reset_prefix_cache", "/resume", "canary"]  # verified
    for got, ref in zip(first[1], _policy_logprobs(model, ids, mask, first[0], tok.eos_token_id)):
        assert torch.allclose(got[: len(ref)], torch.tensor(ref), atol=1e-4)
    assert _same(engine.generate(model, tok, ids, mask, config, seed=7), first)  # a row's sample is its seed's
    assert not torch.equal(engine.generate(model, tok, ids, mask, config, seed=8)[0], first[0])
    _step(model, seed=0)
    engine.on_weights_updated(model)
    second = engine.generate(model, tok, ids, mask, config, seed=7)
    assert _weights_equal(standin, model) and not _same(second, first)
    for got, ref in zip(second[1], _policy_logprobs(model, ids, mask, second[0], tok.eos_token_id)):
        assert torch.allclose(got[: len(ref)], torch.tensor(ref), atol=1e-4)
    metrics = engine.metrics()
    assert metrics["train/weight_sync_mb"] > 0 and metrics["train/server_retries"] == 0


# -- retries --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["500", "drop", "drop_after"])
def test_failed_rows_are_sent_again_with_their_seed_none_lost_or_duplicated(standin, engines, policy, how):
    """An HTTP 500, a connection dropped before the server sampled, or after (the sample drawn, never delivered):
    each failed row is sent again with its seed and kept once; the batch equals an undisturbed one."""
    model, tok, config, ids, mask = policy
    engine = engines(standin)
    expected = engine.generate(model, tok, ids, mask, config, seed=3)
    engine.metrics()
    start = len(standin.log)
    standin.fail_next(2, how, on="row")
    assert _same(engine.generate(model, tok, ids, mask, config, seed=3), expected)
    rows = [e for e in standin.log[start:] if e["kind"] == "row"]
    seeds = {e["seed"] for e in rows}
    assert len(seeds) == ROWS
    delivered = [e["seed"] for e in rows if e["outcome"] == "200"]
    assert sorted(delivered) == sorted(seeds)  # every row answered exactly once
    failed = [e for e in rows if e["outcome"] != "200"]
    assert len(failed) == 2
    for bad in failed:  # sent again with the same seed, under another request id
        again = [e for e in rows if e["seed"] == bad["seed"] and e["outcome"] == "200"]
        assert len(again) == 1 and again[0]["request_id"] != bad["request_id"]
    assert engine.metrics()["train/server_retries"] == 2


def test_a_row_that_fails_every_attempt_ends_the_run_naming_the_server(standin, engines, policy):
    model, tok, config, ids, mask = policy
    engine = engines(standin, retries=1)
    engine.generate(model, tok, ids[:1], mask[:1], config, seed=1)
    standin.fail_next(2, "500", on="row")
    with pytest.raises(RuntimeError) as err:
        engine.generate(model, tok, ids[:1], mask[:1], config, seed=1)
    assert _one_line(err).startswith(f"VLLMServerEngine: {standin.url} did not complete a row in 2 attempts "
                                     "(HTTP 500: ")


def test_a_row_past_request_timeout_is_aborted_before_it_is_sent_again(standin, engines, policy):
    model, tok, config, ids, mask = policy
    engine = engines(standin, request_timeout=SHORT)
    expected = engine.generate(model, tok, ids, mask, config, seed=4)
    start = len(standin.log)
    standin.fail_next(1, "hold", on="row")  # no answer until the abort comes
    assert _same(engine.generate(model, tok, ids, mask, config, seed=4), expected)
    log = standin.log[start:]
    held = next(e for e in log if e.get("held"))
    names = {held["request_id"], f"cmpl-{held['request_id']}"}  # vLLM's own name for it, or the one it was sent with
    abort = next(i for i, e in enumerate(log) if names & set(e.get("request_ids", ())))
    assert log[abort]["kind"] == "/abort_requests" and log[abort]["aborted"] == 1
    retry = [i for i, e in enumerate(log) if e["kind"] == "row" and e["seed"] == held["seed"]
             and e["request_id"] != held["request_id"]]
    assert len(retry) == 1 and retry[0] > abort  # the abort went out first, the retry kept the seed
    assert log[retry[0]]["outcome"] == "200"


# -- restarts -------------------------------------------------------------------------------------------------------
def test_a_restart_between_steps_is_found_and_synced_before_it_samples(standin, engines, policy):
    model, tok, config, ids, mask = policy
    engine = engines(standin)
    expected = engine.generate(model, tok, ids, mask, config, seed=5)
    standin.restart()  # a new boot: dummy weights again
    assert not _weights_equal(standin, model)
    start = len(standin.log)
    assert _same(engine.generate(model, tok, ids, mask, config, seed=5), expected)
    assert _weights_equal(standin, model)
    kinds = [e["kind"] for e in standin.log[start:] if e["outcome"] == "200"]
    load = kinds.index("rpc:rloo_load")
    assert kinds.index("canary") > load and kinds.index("row") > kinds.index("canary")  # loaded, verified, sampled


def test_a_restart_during_generation_samples_the_batch_again_from_the_synced_weights(standin, engines, policy):
    model, tok, config, ids, mask = policy
    engine = engines(standin)
    expected = engine.generate(model, tok, ids, mask, config, seed=6)
    engine.metrics()
    standin.fail_next(1, "restart", on="row")  # the first row's request restarts the server (dropped with it)
    start = len(standin.log)
    assert _same(engine.generate(model, tok, ids, mask, config, seed=6), expected)
    log = standin.log[start:]
    restart = next(i for i, e in enumerate(log) if e["kind"] == "restart")
    new_boot = log[restart]["boot"]
    load = next(i for i, e in enumerate(log) if e["kind"] == "rpc:rloo_load" and e["outcome"] == "200")
    canary = next(i for i, e in enumerate(log) if e["kind"] == "canary" and e["outcome"] == "200")
    assert restart < load < canary and log[load]["boot"] == new_boot
    for seed in {e["seed"] for e in log if e["kind"] == "row"}:  # each row's kept sample: after the verified load
        last = max(i for i, e in enumerate(log) if e["kind"] == "row" and e["seed"] == seed and e["outcome"] == "200")
        assert last > canary and log[last]["boot"] == new_boot
    assert engine.metrics()["train/server_retries"] >= 1


def test_a_load_lost_in_a_restart_is_sent_again_and_verified(standin, engines, policy):
    model, tok, config, ids, mask = policy
    engine = engines(standin)
    engine.generate(model, tok, ids, mask, config, seed=1)
    _step(model, seed=1)
    engine.on_weights_updated(model)
    standin.fail_next(1, "restart", on="rpc:rloo_load")
    start = len(standin.log)
    completion, logp = engine.generate(model, tok, ids, mask, config, seed=2)
    loads = [e for e in standin.log[start:] if e["kind"] == "rpc:rloo_load"]
    assert [e["outcome"] for e in loads] == ["dropped", "200"]
    assert _weights_equal(standin, model)
    for got, ref in zip(logp, _policy_logprobs(model, ids, mask, completion, tok.eos_token_id)):
        assert torch.allclose(got[: len(ref)], torch.tensor(ref), atol=1e-4)


# -- the canary and the key -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", ["offset", "ignored", "nothing"])
def test_a_sync_the_canary_or_the_counts_disagree_with_stops_the_run_in_one_line(standin, engines, policy, fault):
    """Log-probs off by 0.01 on the canary; a load that counts every tensor but keeps the old weights (caught by the
    canary: honest weights differ); a load that takes nothing (caught by the counts)."""
    model, tok, config, ids, mask = policy
    engine = engines(standin)
    if fault == "offset":
        standin.canary_offset = 0.01
    else:
        standin.load_mode = {"ignored": "ignore", "nothing": "nothing"}[fault]
    with pytest.raises(RuntimeError) as err:
        engine.generate(model, tok, ids, mask, config, seed=1)
    text = _one_line(err)
    if fault == "nothing":
        assert f"{standin.url} loaded {{'version'" in text and "'tensors': 0" in text
        assert "tensors (" in text and "bytes) written" in text
    else:
        gap = r"0\.01" if fault == "offset" else r"[0-9.e+-]+"
        assert re.fullmatch(rf"VLLMServerEngine: after weight \w+ \w+:1, {standin.url} gives canary log-probs up to "
                            rf"{gap} from the trainer's \(canary_tolerance=0.001\): the server samples from other "
                            r"weights than the policy's", text), text


def test_a_canary_within_the_tolerance_passes(standin, engines, policy):
    model, tok, config, ids, mask = policy
    standin.canary_offset = 5e-4
    engines(standin).generate(model, tok, ids, mask, config, seed=1)


def test_a_wrong_key_is_refused_in_one_line(standin, engines, policy, monkeypatch):
    model, tok, config, ids, mask = policy
    monkeypatch.setenv("VLLM_API_KEY", "not-the-key")
    with pytest.raises(RuntimeError) as err:
        engines(standin).prepare(model, tok, config)
    text = _one_line(err)
    assert text.startswith(f"VLLMServerEngine: {standin.url} refused the API key") and "not-the-key" not in text
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    engine = engines(standin)
    engine.generate(model, tok, ids, mask, config, seed=1)
    standin.refuse_key()  # the server restarted with another key: at the rows, and at the next sync
    for update in (False, True):
        if update:
            _step(model, seed=2)
            engine.on_weights_updated(model)
        with pytest.raises(RuntimeError) as err:
            engine.generate(model, tok, ids, mask, config, seed=2)
        assert _one_line(err).startswith(f"VLLMServerEngine: {standin.url} refused the API key")


# -- a server that stops answering ----------------------------------------------------------------------------------
def test_a_server_that_stops_answering_ends_within_request_timeout(standin, engines, policy):
    """Frozen (as a SIGSTOPped server: connections accepted, never answered), no retry: the check before the rows
    ends within request_timeout."""
    model, tok, config, ids, mask = policy
    engine = engines(standin, request_timeout=SHORT, reconnect_timeout=1, retries=0)
    engine.generate(model, tok, ids, mask, config, seed=1)
    standin.freeze()
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        engine.generate(model, tok, ids, mask, config, seed=1)
    assert time.monotonic() - start < SHORT + SLACK
    assert _one_line(err) == f"VLLMServerEngine: {standin.url} does not answer (timed out)"


@pytest.mark.slow
def test_a_server_that_stops_answering_with_retries_ends_past_reconnect_timeout(standin, engines, policy):
    model, tok, config, ids, mask = policy
    engine = engines(standin, request_timeout=SHORT, reconnect_timeout=1, retries=1)
    engine.generate(model, tok, ids, mask, config, seed=1)
    standin.freeze()
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        engine.generate(model, tok, ids, mask, config, seed=1)
    elapsed = time.monotonic() - start
    # issue 58: the documented bound, (retries + 1) x (request_timeout + reconnect_timeout) = 8 s here, is exceeded:
    # the wait for a restart polls /health with a fixed 5 s timeout of its own, so a frozen server takes
    # request_timeout + 5 s (about 8 s here; 1 + 5 s with request_timeout=1, past the bound of 4 s) whatever
    # reconnect_timeout says. It should be known down within the
    # liveness bound (a hang needs a progress signal: /health of a frozen server never answers), and no wait should
    # outlast the timeouts it is documented by.
    assert SHORT + 5 <= elapsed < SHORT + 5 + SLACK, elapsed
    assert _one_line(err) == (f"VLLMServerEngine: {standin.url} stopped answering and did not come back within "
                              "reconnect_timeout=1 s (timed out)")


def test_a_server_that_drains_without_answering_ends_the_rows(standin, engines, policy):
    """vLLM on SIGTERM: the generation aborted, the connections kept open without an answer, the listener closed
    (/health refused)."""
    model, tok, config, ids, mask = policy
    engine = engines(standin, request_timeout=SHORT, reconnect_timeout=1, retries=1)
    engine.generate(model, tok, ids, mask, config, seed=1)
    standin.fail_next(ROWS, "hold", on="row")  # long generations, in flight when the signal comes
    handle = engine.submit(model, tok, ids, mask, config, seed=2)
    standin.wait_for(lambda s: len(s.held("row")) == ROWS)
    start = time.monotonic()
    standin.drain("refused")
    with pytest.raises(RuntimeError) as err:
        engine.collect(handle)
    elapsed = time.monotonic() - start
    # issue 58: the rows wait out request_timeout on sockets nobody will answer (with the defaults, 600 s, then the
    # retry), though /health is refused from the moment the server drains: the server should be known down within
    # the liveness bound (seconds), whatever request_timeout is; then wait up to reconnect_timeout for it to come
    # back, or end with one line naming the address and what happened (a server shutting down).
    assert 1 < elapsed < SHORT + 1 + SLACK, elapsed
    assert _one_line(err).startswith(f"VLLMServerEngine: {standin.url} stopped answering and did not come back "
                                     "within reconnect_timeout=1 s (")
    assert len(standin.held()) == 0 and standin.entries("row", "silent")  # the drained rows never got an answer


@pytest.mark.slow
def test_a_server_that_drains_with_health_503_ends_the_rows(standin, engines, policy):
    """The listener still open while it drains: /health answers 503, every request is held without an answer."""
    model, tok, config, ids, mask = policy
    engine = engines(standin, request_timeout=SHORT, reconnect_timeout=1, retries=0)
    engine.generate(model, tok, ids, mask, config, seed=1)
    standin.fail_next(ROWS, "hold", on="row")
    handle = engine.submit(model, tok, ids, mask, config, seed=2)
    standin.wait_for(lambda s: len(s.held("row")) == ROWS)
    start = time.monotonic()
    standin.drain("503")
    with pytest.raises(RuntimeError) as err:
        engine.collect(handle)
    elapsed = time.monotonic() - start
    # issue 58: /health says 503 (the engine is gone) but nothing asks it: each row waits out request_timeout, then
    # its abort waits a fixed 5 s on a server that holds it too: about 8 s here for one attempt (with the defaults,
    # (retries + 1) x (600 + 5) s), and the line says "no answer", not that the server is shutting down. It should
    # end within the liveness bound, naming the address and what happened.
    assert 5 <= elapsed < SHORT + 5 + SLACK, elapsed
    assert _one_line(err) == (f"VLLMServerEngine: {standin.url} did not complete a row in 1 attempts (no answer "
                              f"within request_timeout={SHORT} s)")


# -- calls outside the restart handling -----------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["drop", "hold"])
def test_a_canary_whose_connection_is_lost_ends_the_run_without_the_address(standin, engines, policy, how):
    model, tok, config, ids, mask = policy
    engine = engines(standin, request_timeout=SHORT if how == "hold" else 30)
    engine.generate(model, tok, ids, mask, config, seed=1)
    _step(model, seed=3)
    engine.on_weights_updated(model)
    standin.fail_next(1, how, on="canary")
    with pytest.raises(RuntimeError) as err:
        engine.generate(model, tok, ids, mask, config, seed=2)
    # issue 58: the canary is outside the restart handling that requests and loads have: a connection dropped
    # while it is in flight, or a canary slower than request_timeout, ends the run at once with an exception's class
    # name and message, no address, no wait for a restart, no resync. It should be handled as any call: wait up to
    # reconnect_timeout, load and verify again, or end with one line naming the address.
    detail = "Remote end closed connection without response" if how == "drop" else "timed out"
    text = _one_line(err)
    assert text.endswith(f": {detail}") and text.split(":")[0].isidentifier(), text
    assert standin.url not in text


def test_a_models_call_lost_after_a_restart_escapes_as_a_connection_error(standin, engines, policy):
    model, tok, config, ids, mask = policy
    engine = engines(standin)
    engine.generate(model, tok, ids, mask, config, seed=1)
    standin.restart()
    standin.fail_next(1, "drop", on="/v1/models")
    with pytest.raises(ConnectionError) as err:
        engine.generate(model, tok, ids, mask, config, seed=1)
    # issue 58: the /v1/models call that follows a restart is outside the restart handling: its lost connection
    # escapes as the client's own exception class (a ConnectionError), with no address. It should wait for the
    # server and load again, or end with one line naming the address.
    assert str(err.value) == "Remote end closed connection without response"


# -- start-up -------------------------------------------------------------------------------------------------------
def test_a_server_down_at_start_ends_within_connect_timeout_without_a_word_while_waiting(standin, engines, policy,
                                                                                       capfd):
    model, tok, config, ids, mask = policy
    standin.stop_listening()
    engine = engines(standin, connect_timeout=1.5)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        engine.prepare(model, tok, config)
    assert time.monotonic() - start < 1.5 + SLACK
    assert _one_line(err).startswith(f"VLLMServerEngine: no vLLM server answered at {standin.url} within "
                                     "connect_timeout=1.5 s (")
    # issue 58: the wait says nothing until it ends (a wrong address waits the default 600 s silently); it should
    # print a line naming what it waits for, and repeat it.
    out, errs = capfd.readouterr()
    assert standin.url not in out + errs and "connect_timeout" not in out + errs


def test_connect_resumes_a_server_left_paused_and_reachable_asks_health(standin, engines, policy, monkeypatch):
    model, tok, config, ids, mask = policy
    request = urllib.request.Request(standin.url + "/pause?mode=keep", data=b"{}", method="POST",
                                     headers={"Authorization": f"Bearer {KEY}"})
    urllib.request.urlopen(request, timeout=10).read()  # a trainer died in a sync
    assert standin.paused == "keep"
    engine = engines(standin)
    engine.reachable()
    engine.prepare(model, tok, config)
    assert standin.paused is None
    engine.generate(model, tok, ids, mask, config, seed=1)
    standin.stop_listening()
    with pytest.raises(ConnectionError, match=f"no vLLM server answers at {standin.url}"):
        engine.reachable()
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(ValueError, match="VLLM_API_KEY"):
        engine.reachable()


@pytest.mark.parametrize("server", ["old vLLM", "no dev mode"])
def test_connect_refuses_a_server_without_what_the_engine_needs(tiny_model_dir, engines, policy, server):
    model, tok, config, ids, mask = policy
    options = {"vllm_version": "0.31.2"} if server == "old vLLM" else {"dev_mode": False}
    with StandinVLLM(tiny_model_dir, KEY, **options) as standin:
        if server == "old vLLM":
            with pytest.raises(ValueError, match=rf"the server at {standin.url} does not serve this policy: vLLM "
                                                 r"0\.31\.2: this engine needs >= 0\.32"):
                engines(standin).prepare(model, tok, config)
        else:
            with pytest.raises(RuntimeError, match=rf"{standin.url} has no weight sync \(HTTP 404.*start it with "
                                                   "`rloo-lightning serve`"):
                engines(standin).prepare(model, tok, config)


# -- a real SIGTERM -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_sigterm_to_the_server_process_drains_it_and_ends_the_rows(tiny_model_dir, engines, policy):
    """The stand-in in a process of its own, SIGTERMed while rows are in flight: it drains as vLLM 0.32 does (the
    listener closed, the rows' connections held without an answer, the process still alive) and the rows end."""
    model, tok, config, ids, mask = policy
    script = Path(__file__).parent / "helpers" / "standin_vllm_server.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, str(script), "--model", tiny_model_dir, "--key", KEY],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: queue.Queue = queue.Queue()
    seen: list[str] = []
    threading.Thread(target=lambda: [lines.put(line.strip()) for line in proc.stdout], daemon=True).start()

    def next_line(prefix: str) -> str:
        while True:
            try:
                line = lines.get(timeout=60)
            except queue.Empty:
                raise AssertionError(f"the stand-in process never printed {prefix!r} (exit {proc.poll()}); "
                                     f"it printed: {seen[-20:]}") from None
            seen.append(line)
            if line.startswith(prefix):
                return line

    try:
        port = int(next_line("ready ").split()[1])

        class Remote:
            url = f"http://127.0.0.1:{port}"

        def control(call: str, **kwargs) -> None:
            request = urllib.request.Request(Remote.url + "/standin/control", method="POST",
                                             data=json.dumps({"call": call, "kwargs": kwargs}).encode(),
                                             headers={"Authorization": f"Bearer {KEY}"})
            urllib.request.urlopen(request, timeout=10).read()

        engine = engines(Remote, request_timeout=SHORT, reconnect_timeout=1, retries=1)
        engine.generate(model, tok, ids, mask, config, seed=1)
        control("fail_next", count=ROWS, how="hold", on="row")
        handle = engine.submit(model, tok, ids, mask, config, seed=2)
        for _ in range(ROWS):
            next_line("held row ")
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert next_line("Waiting for connections to close")
        with pytest.raises(RuntimeError) as err:
            engine.collect(handle)
        elapsed = time.monotonic() - start
        # issue 58: as in the in-process drain above: the rows wait out request_timeout though /health is refused.
        assert elapsed < SHORT + 1 + SLACK, elapsed
        assert _one_line(err).startswith(f"VLLMServerEngine: {Remote.url} stopped answering and did not come back "
                                         "within reconnect_timeout=1 s (")
        assert proc.poll() is None  # still draining: the connections it holds were never answered
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


# -- several servers ------------------------------------------------------------------------------------------------
def test_two_servers_share_the_rows_by_prompt_group_and_each_is_synced(tiny_model_dir, standin, engines, policy):
    """Every server gets every sync (verified); a prompt group's rows go to one server; a batch from two servers, one
    of them failing requests, equals the batch of one server."""
    model, tok, config, ids, mask = policy
    expected = engines(standin).generate(model, tok, ids, mask, config, seed=9)
    with StandinVLLM(tiny_model_dir, KEY) as second:
        engine = engines([standin, second])
        starts = len(standin.log), len(second.log)
        second.fail_next(1, "500", on="row")
        assert _same(engine.generate(model, tok, ids, mask, config, seed=9), expected)
        for server, start in zip((standin, second), starts):
            log = server.log[start:]
            assert [e["outcome"] for e in log if e["kind"] == "rpc:rloo_load"] == ["200"]
            assert [e["outcome"] for e in log if e["kind"] == "canary"] == ["200"]
            assert len({e["seed"] for e in log if e["kind"] == "row"}) == ROWS // 2  # one group each
            assert _weights_equal(server, model)


@pytest.mark.slow
def test_a_hung_engine_whose_health_still_answers_ends_the_rows(standin, engines, policy):
    """A hung engine behind a live API server: /health answers 200, nothing else answers."""
    model, tok, config, ids, mask = policy
    engine = engines(standin, request_timeout=SHORT, reconnect_timeout=1, retries=0)
    engine.generate(model, tok, ids, mask, config, seed=1)
    standin.fail_next(ROWS, "hold", on="row")
    handle = engine.submit(model, tok, ids, mask, config, seed=2)
    standin.wait_for(lambda s: len(s.held("row")) == ROWS)
    start = time.monotonic()
    standin.freeze(health="200")
    with pytest.raises(RuntimeError) as err:
        engine.collect(handle)
    elapsed = time.monotonic() - start
    # issue 58: a hang is seen only through request_timeout (600 s by default), then each row's abort waits a fixed
    # 5 s on the hung server: about 8 s here for one attempt. A hang needs a progress signal (/health says 200), and
    # the line should say the server stopped making progress, not only that a row had no answer.
    assert 5 <= elapsed < SHORT + 5 + SLACK, elapsed
    assert _one_line(err) == (f"VLLMServerEngine: {standin.url} did not complete a row in 1 attempts (no answer "
                              f"within request_timeout={SHORT} s)")
