"""VLLMServerEngine's client paths without vLLM: against the stand-in server of ``standin_vllm_server.py`` (the HTTP
API the engine uses, a real tiny transformers model behind it), the faults a server has on a cluster.

Retries keep each row's seed (no row lost or duplicated), a restarted server is found and synced again (and
verified) before it samples, a canary that disagrees and a key that is refused end the run with one line, and the
checks at connect name what differs. A server that fails while the trainer waits on it (shutting down, stopped,
hung, killed during a request, a load or the canary): ``test_engines_vllm_server_liveness.py``.
"""

from __future__ import annotations

import re
import urllib.request

import pytest
import torch

import standin_engine
from standin_engine import KEY, ROWS, one_line, same, step, weights_equal
from standin_vllm_server import StandinVLLM

# The fixtures, by name (an import of them would read as unused to the linter).
server_key, standin, engines, policy = (standin_engine.server_key, standin_engine.standin, standin_engine.engines,
                                        standin_engine.policy)


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


# -- the stand-in is honest -----------------------------------------------------------------------------------------
def test_samples_and_logprobs_come_from_the_synced_weights(standin, engines, policy):
    model, tok, config, ids, mask = policy
    engine = engines(standin)
    engine.prepare(model, tok, config)
    assert not weights_equal(standin, model)  # dummy weights until the first sync
    first = engine.generate(model, tok, ids, mask, config, seed=7)
    assert weights_equal(standin, model)
    kinds = [e["kind"] for e in standin.entries(outcome="200")]
    load = kinds.index("rpc:rloo_load")
    assert kinds[load:load + 4] == ["rpc:rloo_load", "/reset_prefix_cache", "/resume", "canary"]  # verified
    for got, ref in zip(first[1], _policy_logprobs(model, ids, mask, first[0], tok.eos_token_id)):
        assert torch.allclose(got[: len(ref)], torch.tensor(ref), atol=1e-4)
    assert same(engine.generate(model, tok, ids, mask, config, seed=7), first)  # a row's sample is its seed's
    assert not torch.equal(engine.generate(model, tok, ids, mask, config, seed=8)[0], first[0])
    step(model, seed=0)
    engine.on_weights_updated(model)
    second = engine.generate(model, tok, ids, mask, config, seed=7)
    assert weights_equal(standin, model) and not same(second, first)
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
    assert same(engine.generate(model, tok, ids, mask, config, seed=3), expected)
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
    assert one_line(err) == (f"VLLMServerEngine: {standin.url} did not complete a row in 2 attempts (answered "
                             "/v1/completions with HTTP 500: stand-in fault: internal server error)")


# -- restarts -------------------------------------------------------------------------------------------------------
def test_a_restart_between_steps_is_found_and_synced_before_it_samples(standin, engines, policy):
    model, tok, config, ids, mask = policy
    engine = engines(standin)
    expected = engine.generate(model, tok, ids, mask, config, seed=5)
    standin.restart()  # a new boot: dummy weights again
    assert not weights_equal(standin, model)
    start = len(standin.log)
    assert same(engine.generate(model, tok, ids, mask, config, seed=5), expected)
    assert weights_equal(standin, model)
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
    assert same(engine.generate(model, tok, ids, mask, config, seed=6), expected)
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
    step(model, seed=1)
    engine.on_weights_updated(model)
    standin.fail_next(1, "restart", on="rpc:rloo_load")
    start = len(standin.log)
    completion, logp = engine.generate(model, tok, ids, mask, config, seed=2)
    loads = [e for e in standin.log[start:] if e["kind"] == "rpc:rloo_load"]
    assert [e["outcome"] for e in loads] == ["dropped", "200"]
    assert weights_equal(standin, model)
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
    text = one_line(err)
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
    text = one_line(err)
    assert text.startswith(f"VLLMServerEngine: {standin.url} refused the API key") and "not-the-key" not in text
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    engine = engines(standin)
    engine.generate(model, tok, ids, mask, config, seed=1)
    standin.refuse_key()  # the server restarted with another key: at the rows, and at the next sync
    for update in (False, True):
        if update:
            step(model, seed=2)
            engine.on_weights_updated(model)
        with pytest.raises(RuntimeError) as err:
            engine.generate(model, tok, ids, mask, config, seed=2)
        assert one_line(err).startswith(f"VLLMServerEngine: {standin.url} refused the API key")


# -- start-up ---------------------------------------------------------------------------------------------------------
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
        assert same(engine.generate(model, tok, ids, mask, config, seed=9), expected)
        for server, start in zip((standin, second), starts):
            log = server.log[start:]
            assert [e["outcome"] for e in log if e["kind"] == "rpc:rloo_load"] == ["200"]
            assert [e["outcome"] for e in log if e["kind"] == "canary"] == ["200"]
            assert len({e["seed"] for e in log if e["kind"] == "row"}) == ROWS // 2  # one group each
            assert weights_equal(server, model)
