"""VLLMServerEngine with a LoRA policy (``lora_sync: adapter``, the default) on stand-in vLLM servers that serve
adapters as vLLM's does (``tests/helpers/standin_vllm_server.py``: runtime adapter loading, a restart forgetting
every adapter, a base load keeping their names): the base once per server boot, then the adapter alone; rows and
canary under the adapter's name; a restart reloads both before a row is sampled; a server without LoRA, or with too
small a rank, refused at connect; an adapter that did not load caught by the canary; a second run on the same server
uses names of its own and unloads the first run's. The same on real vLLM: ``test_engines_vllm_server.py``."""

from __future__ import annotations

import pytest
import torch

import standin_engine
from standin_engine import KEY, ROWS, one_line, same
from standin_vllm_server import StandinVLLM

peft = pytest.importorskip("peft")
server_key, engines, policy = standin_engine.server_key, standin_engine.engines, standin_engine.policy


@pytest.fixture
def lora_server(tiny_model_dir):
    with StandinVLLM(tiny_model_dir, KEY, lora_rank=8) as server:
        yield server


def _lora(policy, seed: int = 0):
    model, tok, config, ids, mask = policy
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    _move(lora, seed)
    return lora, tok, config, ids, mask


def _move(lora, seed: int) -> None:
    """A step's stand-in: new adapter values (the base stays: peft freezes it)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)


def _adapter(lora) -> dict:
    return {name: p.detach().clone() for name, p in lora.named_parameters() if "lora_" in name}


def _sampled_with(lora, adapter: dict, ids, mask, out, logp, pad: int) -> bool:
    """Whether ``logp`` are the log-probs of ``out`` under the policy with ``adapter``'s values."""
    now = _adapter(lora)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if name in adapter:
                p.copy_(adapter[name])
        try:
            real = out != pad
            return bool((_logprobs(lora.eval(), ids, mask, out) - logp)[real].abs().max() < 1e-4)
        finally:
            for name, p in lora.named_parameters():
                if name in now:
                    p.copy_(now[name])


def _submit_unblocked(engine, lora, tok, ids, mask, config, seed: int):
    """``engine.submit``, which must return while other batches' rows are held (a sync that waited for them would
    never return: the test fails after 30 s instead)."""
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(1) as pool:
        future = pool.submit(engine.submit, lora, tok, ids, mask, config, seed)
        try:
            return future.result(timeout=30)
        except cf.TimeoutError:
            pytest.fail("the adapter sync waited for the batches in flight")


def _logprobs(model, ids, mask, out) -> torch.Tensor:
    full = torch.cat([ids, out], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=torch.cat([mask, torch.ones_like(out)], 1)).logits.float()
    return torch.log_softmax(logits[:, ids.shape[1] - 1:-1], -1).gather(-1, out[..., None])[..., 0]


def _kinds(server, start: int = 0) -> list[str]:
    return [e["kind"] for e in server.log[start:] if e.get("outcome") == "200"]


def test_the_base_goes_once_then_the_adapter_alone_and_rows_sample_with_it(lora_server, engines, policy):
    lora, tok, config, ids, mask = _lora(policy)
    engine = engines(lora_server)
    engine.prepare(lora, tok, config)
    out, logp = engine.generate(lora, tok, ids, mask, config, seed=3)
    kinds = _kinds(lora_server)
    assert kinds.count("rpc:rloo_load") == 1 and kinds.count("/v1/load_lora_adapter") == 1
    assert kinds.index("rpc:rloo_load") < kinds.index("/v1/load_lora_adapter") < kinds.index("canary")
    real = out != tok.pad_token_id
    assert (_logprobs(lora.eval(), ids, mask, out) - logp)[real].abs().max() < 1e-4  # the adapter's samples
    first_mb = engine.metrics()["train/weight_sync_mb"]
    adapter_mb = sum(p.numel() * 4 for n, p in lora.named_parameters() if "lora_" in n) / 2**20
    for seed in (1, 2):
        _move(lora, seed)
        engine.on_weights_updated(lora)
        start = len(lora_server.log)
        out, logp = engine.generate(lora, tok, ids, mask, config, seed=3)
        kinds = _kinds(lora_server, start)
        assert "rpc:rloo_load" not in kinds and "/pause" not in kinds  # the base stays; no pause for an adapter
        assert kinds.count("/v1/load_lora_adapter") == 1 and kinds.count("/v1/unload_lora_adapter") == 1
        real = out != tok.pad_token_id
        assert (_logprobs(lora.eval(), ids, mask, out) - logp)[real].abs().max() < 1e-4
        assert engine.metrics()["train/weight_sync_mb"] == pytest.approx(adapter_mb, rel=1e-6)
        assert list(lora_server.adapters) == [f"rloo-{engine._run}-adapter-{seed + 1}"]  # the older name unloaded
    assert first_mb > 10 * adapter_mb  # the first sync wrote the base as well


def test_a_restart_loads_the_base_and_the_adapter_again_before_a_row(lora_server, engines, policy):
    lora, tok, config, ids, mask = _lora(policy)
    engine = engines(lora_server)
    expected = engine.generate(lora, tok, ids, mask, config, seed=5)
    lora_server.restart()  # dummy weights, no adapter
    start = len(lora_server.log)
    assert same(engine.generate(lora, tok, ids, mask, config, seed=5), expected)
    kinds = _kinds(lora_server, start)
    assert kinds.index("rpc:rloo_load") < kinds.index("/v1/load_lora_adapter") < kinds.index("canary")
    assert kinds.index("canary") < kinds.index("row")


def test_a_second_run_on_the_same_server_loads_its_own_adapters_not_the_first_runs(lora_server, engines, policy,
                                                                                    tmp_path):
    """vLLM keeps a run's last adapter name (and its folder's path) after the run; a later run that loaded an adapter
    under the same name would be answered "already loaded", and its canary would make the engine load the first
    run's folder, removed by then: the engine dies (vLLM 0.32). Names are the run's own, the leftovers unloaded."""
    import shutil

    lora, tok, config, ids, mask = _lora(policy)
    first = engines(lora_server, sync_dir=str(tmp_path / "a"))
    for seed in (1, 2):
        _move(lora, seed)
        first.on_weights_updated(lora)
        first.generate(lora, tok, ids, mask, config, seed=3)
    left, run = first._current.adapter, first._run
    first.close()
    shutil.rmtree(tmp_path / "a")  # the first run's folders gone with it
    assert list(lora_server.adapters) == [left]  # still listed by the server
    second = engines(lora_server, sync_dir=str(tmp_path / "b"), retries=0)
    for seed in (3, 4, 5):
        _move(lora, seed)
        second.on_weights_updated(lora)
        out, logp = second.generate(lora, tok, ids, mask, config, seed=3)
        real = out != tok.pad_token_id
        assert (_logprobs(lora.eval(), ids, mask, out) - logp)[real].abs().max() < 1e-4
        assert list(lora_server.adapters) == [second._current.adapter] and not lora_server.engine_dead
    assert left != second._current.adapter and run in left


@pytest.mark.parametrize("rank, said", [(None, "server max_lora_rank None"), (4, "server max_lora_rank 4")])
def test_a_server_without_lora_or_with_a_smaller_rank_is_refused_at_connect(tiny_model_dir, engines, policy, rank,
                                                                           said):
    lora, tok, config, ids, mask = _lora(policy)
    lora.peft_config["default"].r = 8  # the rank the server is checked for
    with StandinVLLM(tiny_model_dir, KEY, lora_rank=rank) as server:
        with pytest.raises(ValueError) as err:
            engines(server).prepare(lora, tok, config)
    line = one_line(err)
    assert said in line and "--lora-rank 8" in line and "lora_sync: merged" in line


def test_merged_syncs_a_lora_policy_to_a_server_without_lora(tiny_model_dir, engines, policy):
    lora, tok, config, ids, mask = _lora(policy)
    with StandinVLLM(tiny_model_dir, KEY) as server:
        engine = engines(server, lora_sync="merged")
        out, logp = engine.generate(lora, tok, ids, mask, config, seed=3)
        real = out != tok.pad_token_id
        assert (_logprobs(lora.eval(), ids, mask, out) - logp)[real].abs().max() < 1e-4
        assert "/v1/load_lora_adapter" not in _kinds(server)


@pytest.mark.parametrize("fault", ["ignored", "offset"])
def test_an_adapter_that_did_not_load_is_caught_by_the_canary(lora_server, engines, policy, fault):
    # The adapter sync's canary is checked on tokens the server samples after prefixes of the canary sequence (not
    # its prompt log-probs, which vLLM gets wrong under an adapter in a shared batch): an adapter ignored, or log-probs
    # off by twice the tolerance, is caught.
    lora, tok, config, ids, mask = _lora(policy)
    engine = engines(lora_server, retries=0)
    if fault == "ignored":
        lora_server.set(adapter_mode="ignore")  # answers success, samples with the base
    else:
        lora_server.set(canary_offset=2 * engine.canary_tolerance)
    with pytest.raises(Exception) as err:
        engine.generate(lora, tok, ids, mask, config, seed=3)
    assert f"adapter rloo-{engine._run}-adapter-1 on its base" in one_line(err) and lora_server.url in one_line(err)
    canaries = [e for e in lora_server.log if e["kind"] == "canary"]
    assert canaries and all(e.get("request_id", "").startswith("rloo-canary") for e in canaries)


def test_a_server_that_cannot_load_adapters_at_runtime_is_named(lora_server, engines, policy, monkeypatch):
    lora, tok, config, ids, mask = _lora(policy)
    engine = engines(lora_server, retries=0)
    engine.prepare(lora, tok, config)
    monkeypatch.setattr(lora_server, "lora_rank", None)  # as without VLLM_ALLOW_RUNTIME_LORA_UPDATING: no route
    with pytest.raises(Exception) as err:
        engine.generate(lora, tok, ids, mask, config, seed=3)
    assert "failed to load the adapter of weight sync" in one_line(err) and "--lora-rank" in one_line(err)


def test_a_sync_waits_for_no_batch_in_flight_and_each_batch_samples_with_its_own_adapter(lora_server, engines,
                                                                                         policy, tmp_path):
    """rollout.lag 2: the batches of two syncs are still generating when the third sync loads its adapter. It waits
    for neither; each batch samples with the adapter of the sync before it; three adapters are loaded then (K + 1);
    the next sync, with nothing in flight, unloads the older ones and removes their folders."""
    lora, tok, config, ids, mask = _lora(policy)
    engine = engines(lora_server, sync_dir=str(tmp_path))
    engine.prepare(lora, tok, config)
    assert engine.keeps_versions
    adapters, handles = [], []
    for seed in (1, 2, 3):
        _move(lora, seed)
        engine.on_weights_updated(lora)
        adapters.append(_adapter(lora))
        if seed < 3:  # the first two batches' rows are held: long generations in flight
            lora_server.fail_next(ROWS, "hold", on="row")
        handles.append(_submit_unblocked(engine, lora, tok, ids, mask, config, seed=3))
        if seed < 3:
            lora_server.wait_for(lambda s, n=seed: len(s.held("row")) == ROWS * n)
    assert len(lora_server.adapters) == 3 and engine._current.adapter in lora_server.adapters
    lora_server.release()
    for adapter, handle in zip(adapters, handles):
        out, logp = engine.collect(handle)
        assert _sampled_with(lora, adapter, ids, mask, out, logp, tok.pad_token_id)
    assert not any(_sampled_with(lora, adapters[0], ids, mask, *engine.collect(h), tok.pad_token_id)
                   for h in handles[1:])  # the check tells the adapters apart
    _move(lora, 4)
    engine.on_weights_updated(lora)
    engine.generate(lora, tok, ids, mask, config, seed=3)
    assert list(lora_server.adapters) == [engine._current.adapter]  # nothing in flight: the older ones unloaded
    assert [p.name for p in tmp_path.iterdir() if "-sync" in p.name and "-base-" not in p.name] == [
        f"{engine._run}-sync{engine._current.sync_id:06d}"]


def test_a_restart_under_an_older_batch_loads_that_batchs_adapter_again_and_verifies_it(lora_server, engines,
                                                                                       policy):
    """A batch of the sync before the current one is generating when the server restarts: its rows are sampled
    again with their own adapter (loaded again from its folder, on the base loaded again, and verified by that
    sync's canary), not the current one; the current batch then loads and verifies its own."""
    lora, tok, config, ids, mask = _lora(policy)
    engine = engines(lora_server)
    engine.prepare(lora, tok, config)
    _move(lora, 1)
    engine.on_weights_updated(lora)
    first = _adapter(lora)
    lora_server.fail_next(ROWS, "hold", on="row")
    older = engine.submit(lora, tok, ids, mask, config, seed=4)
    lora_server.wait_for(lambda s: len(s.held("row")) == ROWS)
    _move(lora, 2)
    engine.on_weights_updated(lora)
    second = _adapter(lora)
    newer = _submit_unblocked(engine, lora, tok, ids, mask, config, seed=4)
    out, logp = engine.collect(newer)
    assert _sampled_with(lora, second, ids, mask, out, logp, tok.pad_token_id)
    start = len(lora_server.log)
    lora_server.restart()  # the held rows dropped, every adapter forgotten
    out, logp = engine.collect(older)
    assert _sampled_with(lora, first, ids, mask, out, logp, tok.pad_token_id)
    log = [e for e in lora_server.log[start:] if e.get("outcome") == "200"]
    kinds = [e["kind"] for e in log]
    assert kinds.index("rpc:rloo_load") < kinds.index("/v1/load_lora_adapter") < kinds.index("canary")
    # Rows sent between the batch's check and the restart reach the new boot first (answered from its dummy base,
    # or refused for want of their adapter): the batch's second check finds the restart and samples them again,
    # after the canary.
    assert kinds[kinds.index("canary"):].count("row") >= ROWS and kinds.count("/v1/load_lora_adapter") == 1
    start = len(lora_server.log)
    out, logp = engine.generate(lora, tok, ids, mask, config, seed=5)  # the current sync's adapter, loaded again
    assert _sampled_with(lora, second, ids, mask, out, logp, tok.pad_token_id)
    kinds = [e["kind"] for e in lora_server.log[start:] if e.get("outcome") == "200"]
    assert "rpc:rloo_load" not in kinds and kinds.index("/v1/load_lora_adapter") < kinds.index("canary")
