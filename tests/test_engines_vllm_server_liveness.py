"""A server that fails while the trainer waits on it (issue 58): liveness decides, not the longest timeout.

Against the stand-in (``standin_vllm_server.py``), with the engines' ``liveness_timeout`` LIVE and
``liveness_interval`` TICK (``standin_engine.py``): a server shutting down (vLLM's drain on SIGTERM: the listener
closed, or ``/health`` 503), stopped (SIGSTOP: nothing answers), hung (``/health`` 200, no progress) or killed
(every connection dropped) during a request, a load or the canary is known down within its bound; then, back within
``reconnect_timeout``, it is synced and verified again and the rows come out as an undisturbed server gives them;
not back, the run ends with one line naming the address and what was seen. A slow server that progresses is never
cut; a stop signal ends every wait. Each time is checked against its bound as an upper bound only (with SLACK).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from lightning.pytorch.utilities.exceptions import SIGTERMException

import standin_engine
from rloo_lightning.cli_errors import error_line
from rloo_lightning.engines.vllm_http import ServerClient, ServerDown
from rloo_lightning.runtime import sigterm
from standin_engine import KEY, LIVE, RECONNECT, ROWS, SLACK, TICK, held_rows, one_line, same, step, weights_equal

# The fixtures, by name (an import of them would read as unused to the linter).
server_key, standin, engines, policy, waiting = (standin_engine.server_key, standin_engine.standin,
                                                 standin_engine.engines, standin_engine.policy, standin_engine.waiting)

pytestmark = pytest.mark.slow  # the tests wait out their bounds by design: about a minute together

REFUSED = "refused the connection (shutting down, killed, or not started)"
DROPPED = "closed the connection without an answer (killed, or restarting)"
DEAD = "answered /health with 503 (its engine has ended)"
SILENT = f"did not answer /health for {LIVE:g} s (stopped, or unreachable)"
HUNG = f"answered /health but made no progress for {LIVE:g} s (its engine hangs)"
ABORT = min(5.0, LIVE)  # the abort sent to a hung server, at most

#: fault -> (how the stand-in fails, what the line says, the bound of its detection in seconds)
FAULTS = {
    # A look in the moment between the drain and the listener's close sees 503, or a connection dropped from the
    # listener's queue: each is a server shutting down.
    "shutting down": (lambda s: s.drain("refused"), (REFUSED, DEAD, DROPPED), TICK),
    "shutting down, health 503": (lambda s: s.drain("503"), DEAD, TICK),
    "killed": (lambda s: s.kill(), (DROPPED, REFUSED), TICK),  # its connections drop as its listener closes
    "stopped": (lambda s: s.freeze("silent"), SILENT, LIVE),
    "hung": (lambda s: s.freeze("200"), HUNG, LIVE + TICK + ABORT),
}


def _ended(err, url: str, what: str | tuple, unit: str = "a row") -> None:
    """One line naming the address and what was seen (``what``, or one of them, whichever was seen first)."""
    seen = (what,) if isinstance(what, str) else what
    assert one_line(err) in [f"VLLMServerEngine: {url} {one} ({unit}), and did not come back within "
                             f"reconnect_timeout={RECONNECT} s" for one in seen]
    assert error_line(err.value) == f"error: {one_line(err)}"  # the CLI's line: no class name


# -- during generation ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", FAULTS)
def test_a_server_that_fails_during_generation_and_stays_down_ends_within_its_bound(standin, engines, policy, fault):
    model, tok, config, ids, mask = policy
    engine = engines(standin, reconnect_timeout=RECONNECT)
    engine.generate(model, tok, ids, mask, config, seed=1)
    handle = held_rows(standin, engine, policy, seed=2)  # long generations in flight
    fail, what, detect = FAULTS[fault]
    start = time.monotonic()
    fail(standin)
    with pytest.raises(RuntimeError) as err:
        engine.collect(handle)
    elapsed = time.monotonic() - start
    print(f"{fault}: the rows ended {elapsed:.2f} s after the fault")  # the measured times of docs/vllm_server.md
    assert elapsed < detect + RECONNECT + SLACK, elapsed  # issue 58: it waited request_timeout (600 s) before
    _ended(err, standin.url, what)
    if fault.startswith("shutting down"):
        assert len(standin.entries("row", "silent")) == ROWS  # the drained rows never got an answer


@pytest.mark.parametrize("fault", FAULTS)
def test_a_server_that_fails_during_generation_and_comes_back_gives_the_same_rows(standin, engines, policy, fault,
                                                                                 waiting):
    """Restarted on its address (after a kill or a drain) or running again (after a stop or a hang): the rows are
    sampled again with their seeds after the current weights are loaded and verified, none lost or duplicated."""
    model, tok, config, ids, mask = policy
    engine = engines(standin, reconnect_timeout=60)
    expected = engine.generate(model, tok, ids, mask, config, seed=2)
    engine.metrics()
    handle = held_rows(standin, engine, policy, seed=2)
    fail, what, detect = FAULTS[fault]
    start = time.monotonic()
    fail(standin)
    assert waiting.wait(detect + SLACK), "the engine never said it waits for the server"
    assert time.monotonic() - start < detect + SLACK
    assert any(waiting.lines[0].startswith(f"VLLMServerEngine: {standin.url} {seen} (a row); waiting up to "
                                           "reconnect_timeout=60 s for it to come back")
               for seen in ((what,) if isinstance(what, str) else what)), waiting.lines
    start = len(standin.log)
    restarted = fault in ("shutting down", "shutting down, health 503", "killed")
    standin.come_back() if restarted else standin.thaw()
    assert same(engine.collect(handle), expected)  # each row once, with its seed's sample: none lost or duplicated
    assert weights_equal(standin, model) and engine.metrics()["train/server_retries"] >= 1
    log = standin.log[start:]
    if restarted:  # another boot: loaded and verified before any row it answered
        first_row = next(i for i, e in enumerate(log) if e["kind"] == "row" and e["outcome"] == "200")
        kinds = [e["kind"] for e in log[:first_row] if e.get("outcome") == "200"]
        assert "rpc:rloo_load" in kinds and kinds.index("rpc:rloo_load") < kinds.index("canary")


def test_a_slow_server_that_progresses_is_never_cut(standin, engines, policy):
    """Rows that take several times liveness_timeout (each token slow, the rows queued one after another behind the
    stand-in's one model) on a server that makes progress: no retry, the same rows."""
    model, tok, config, ids, mask = policy
    ids, mask = ids[:2], mask[:2]  # one group: two rows, one after the other
    engine = engines(standin)
    expected = engine.generate(model, tok, ids, mask, config, seed=3)
    engine.metrics()
    standin.token_delay = LIVE / 4
    start = time.monotonic()
    assert same(engine.generate(model, tok, ids, mask, config, seed=3), expected)
    assert time.monotonic() - start > LIVE  # slower than the liveness bound, and not cut
    assert engine.metrics()["train/server_retries"] == 0
    assert standin.probes.get("/metrics", 0) >= 2  # the engine watched its progress meanwhile


def test_a_row_of_a_server_that_makes_no_progress_is_aborted_before_it_is_sent_again(standin, engines, policy):
    """One row held without an answer, nothing else running: no progress for liveness_timeout, so the row is aborted
    on the server and sent again with its seed (the server answers: the same sample)."""
    model, tok, config, ids, mask = policy
    engine = engines(standin)
    expected = engine.generate(model, tok, ids, mask, config, seed=4)
    start = len(standin.log)
    standin.fail_next(1, "hold", on="row")  # no answer until the abort comes
    began = time.monotonic()
    assert same(engine.generate(model, tok, ids, mask, config, seed=4), expected)
    assert time.monotonic() - began < LIVE + TICK + SLACK
    log = standin.log[start:]
    held = next(e for e in log if e.get("held"))
    names = {held["request_id"], f"cmpl-{held['request_id']}"}  # vLLM's own name for it, or the one it was sent with
    abort = next(i for i, e in enumerate(log) if names & set(e.get("request_ids", ())))
    assert log[abort]["kind"] == "/abort_requests"
    retry = [i for i, e in enumerate(log) if e["kind"] == "row" and e["seed"] == held["seed"]
             and e["request_id"] != held["request_id"]]
    assert len(retry) == 1 and retry[0] > abort  # the abort went out first, the retry kept the seed
    assert log[retry[0]]["outcome"] == "200"


# -- during a sync: the load, the canary, the calls around them -----------------------------------------------------
def _updated(engine, model, seed: int) -> None:
    step(model, seed=seed)
    engine.on_weights_updated(model)


@pytest.mark.parametrize("on", ["rpc:rloo_load", "canary"])
def test_a_server_killed_during_a_load_or_the_canary_and_not_back_ends_in_one_line(standin, engines, policy, on):
    model, tok, config, ids, mask = policy
    engine = engines(standin, reconnect_timeout=RECONNECT)
    engine.generate(model, tok, ids, mask, config, seed=1)
    _updated(engine, model, seed=3)
    standin.fail_next(1, "hold", on=on)
    threading.Thread(target=lambda: (standin.wait_for(lambda s: s.held(on)), standin.kill()), daemon=True).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        engine.generate(model, tok, ids, mask, config, seed=2)
    assert time.monotonic() - start < RECONNECT + SLACK
    _ended(err, standin.url, (DROPPED, REFUSED), unit=f"weight sync {engine._current.tag}")


@pytest.mark.parametrize("how", ["drop", "restart", "hold"])
def test_a_canary_lost_or_unanswered_is_loaded_and_verified_again(standin, engines, policy, how):
    """The connection dropped (a server that restarts after it), a restart with the canary in flight, or no answer
    (no progress: aborted after liveness_timeout): the server is waited for, the sync loaded and verified again."""
    model, tok, config, ids, mask = policy
    engine = engines(standin)
    engine.generate(model, tok, ids, mask, config, seed=1)
    _updated(engine, model, seed=3)
    standin.fail_next(1, how, on="canary")
    start = len(standin.log)
    began = time.monotonic()
    completion, logp = engine.generate(model, tok, ids, mask, config, seed=2)
    assert time.monotonic() - began < (LIVE + TICK + SLACK if how == "hold" else SLACK)
    log = standin.log[start:]
    assert [e["outcome"] for e in log if e["kind"] == "canary"][-1] == "200"
    assert [e["outcome"] for e in log if e["kind"] == "rpc:rloo_load"] == ["200", "200"]  # loaded again, verified
    assert weights_equal(standin, model)


def test_a_models_call_lost_after_a_restart_is_waited_for_and_done_again(standin, engines, policy):
    model, tok, config, ids, mask = policy
    engine = engines(standin)
    expected = engine.generate(model, tok, ids, mask, config, seed=1)
    standin.restart()
    standin.fail_next(1, "drop", on="/v1/models")
    assert same(engine.generate(model, tok, ids, mask, config, seed=1), expected)
    assert [e["outcome"] for e in standin.entries("/v1/models")][-2:] == ["dropped", "200"]


def test_a_server_stopped_before_a_batch_ends_within_liveness_and_reconnect(standin, engines, policy):
    model, tok, config, ids, mask = policy
    engine = engines(standin, reconnect_timeout=RECONNECT)
    engine.generate(model, tok, ids, mask, config, seed=1)
    standin.freeze()
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        engine.generate(model, tok, ids, mask, config, seed=1)
    assert time.monotonic() - start < LIVE + RECONNECT + SLACK  # issue 58: request_timeout + 5 s, whatever it said
    _ended(err, standin.url, SILENT, unit="the check of its weights before a batch")


# -- a stop signal while waiting ------------------------------------------------------------------------------------
@pytest.fixture
def stop(monkeypatch) -> threading.Event:
    """Set: the next :func:`sigterm.check` raises as it does with one process inside a step."""
    event = threading.Event()
    real = sigterm.check

    def check(where: str = "") -> bool:
        if event.is_set():
            raise SIGTERMException(where)
        return real(where)

    monkeypatch.setattr(sigterm, "check", check)
    return event


@pytest.mark.parametrize("where", ["rows", "sync"])
def test_a_stop_signal_ends_a_wait_on_a_stopped_server(standin, engines, policy, stop, waiting, where):
    """The server stopped while rows (or a sync's load) wait on it, the engine waiting for it to come back
    (reconnect_timeout 60 s): a stop signal ends the wait at once, and the rows are aborted on the server."""
    model, tok, config, ids, mask = policy
    engine = engines(standin, reconnect_timeout=60)
    engine.generate(model, tok, ids, mask, config, seed=1)
    if where == "sync":
        _updated(engine, model, seed=3)
        standin.fail_next(1, "hold", on="rpc:rloo_load")
        threading.Thread(target=lambda: (standin.wait_for(lambda s: s.held("rpc:rloo_load")), standin.freeze()),
                         daemon=True).start()
    else:
        standin.fail_next(ROWS, "hold", on="row")
        threading.Thread(target=lambda: (standin.wait_for(lambda s: len(s.held("row")) == ROWS), standin.freeze()),
                         daemon=True).start()
    stopped = []
    threading.Thread(target=lambda: (waiting.wait(30), stopped.append(time.monotonic()), stop.set()),
                     daemon=True).start()
    with pytest.raises(SIGTERMException):
        engine.generate(model, tok, ids, mask, config, seed=2)
    assert waiting.is_set() and time.monotonic() - stopped[0] < ABORT + SLACK  # the abort to a stopped server: bounded
    if where == "rows":  # the rows' abort went out (the frozen server took it without an answer)
        assert standin.entries("/abort_requests")


def test_a_stop_signal_ends_the_wait_at_start(standin, engines, policy, stop):
    model, tok, config, ids, mask = policy
    standin.stop_listening()
    engine = engines(standin, connect_timeout=600)
    threading.Timer(1.0, stop.set).start()
    start = time.monotonic()
    with pytest.raises(SIGTERMException):
        engine.prepare(model, tok, config)
    assert time.monotonic() - start < 1 + SLACK


# -- start-up -------------------------------------------------------------------------------------------------------
def test_a_server_down_at_start_is_waited_for_with_a_line_that_repeats(standin, engines, policy, capfd):
    model, tok, config, ids, mask = policy
    standin.stop_listening()
    engine = engines(standin, connect_timeout=1.5)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        engine.prepare(model, tok, config)
    assert time.monotonic() - start < 1.5 + SLACK
    assert one_line(err) == (f"VLLMServerEngine: no vLLM server answered at {standin.url} within connect_timeout=1.5 "
                             f"s (it {REFUSED}); start one with `rloo-lightning serve --model <policy> --port <port>` "
                             "(docs/vllm_server.md)")
    assert capfd.readouterr().err.splitlines()[-1] == (
        f"VLLMServerEngine: waiting for the vLLM server at {standin.url} (0 s so far, connect_timeout=1.5 s)")
    said = []  # the line repeats, every 30 s in the engine (here every 0.3 s)
    client = ServerClient(standin.url, KEY, 5)
    with pytest.raises(ServerDown, match=REFUSED.replace("(", r"\(").replace(")", r"\)")):
        client.wait_up(2.0, say=said.append, every=0.3)
    assert len(said) >= 3 and said == sorted(said)


# -- a real SIGTERM -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_sigterm_to_the_server_process_ends_the_rows_within_the_liveness_bound(tiny_model_dir, engines, policy):
    """The stand-in in a process of its own, SIGTERMed while rows are in flight: it drains as vLLM 0.32 does (the
    listener closed, the rows' connections held without an answer, the process still alive): the rows end within
    liveness_interval + reconnect_timeout, with one line."""
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

        engine = engines(Remote, reconnect_timeout=RECONNECT)
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
        assert time.monotonic() - start < TICK + RECONNECT + SLACK  # issue 58: request_timeout before
        _ended(err, Remote.url, FAULTS["shutting down"][1])
        assert proc.poll() is None  # still draining: the connections it holds were never answered
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


# -- ranks agree ----------------------------------------------------------------------------------------------------
def test_a_sync_ends_the_same_way_on_every_rank(monkeypatch):
    """The sync's outcome is gathered from every rank: a failure of any rank (rank 0's load, another rank's rows
    before the sync) is every rank's line, a stop on any rank stops every rank, else every rank takes rank 0's sync."""
    import torch

    from rloo_lightning.engines.vllm_sync import Published, agreed

    synced = Published("/sync/run-sync000002", "run:2", 2, 10, 100)

    def gathered(*given):
        def all_gather_object(out, mine):
            out[:] = list(given)

        monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
        return agreed(given[0], len(given))

    assert agreed(synced, 1) is synced
    assert gathered(synced, "", "") is synced
    assert gathered(synced, None, "") is None
    assert gathered(synced, "VLLMServerEngine: http://b refused ...", "") == "VLLMServerEngine: http://b refused ..."
    assert gathered("one line", "one line") == "one line"
    assert gathered("a", "", "b") == "rank 0: a; rank 2: b"


def _rank_syncs(rank: int, url: str, model_dir: str, port: int, sync_dir: str, out) -> None:
    """One of two gloo ranks: a sync after rank 1's rows of the step before failed (its drain raises)."""
    import torch

    from rloo_lightning.engines.vllm_http import ServerFailed
    from rloo_lightning.engines.vllm_server import VLLMServerEngine
    from rloo_lightning.models.loading import load_tokenizer
    from transformers import AutoModelForCausalLM, GenerationConfig

    os.environ["VLLM_API_KEY"] = KEY
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tok = load_tokenizer(model_dir)
        engine = VLLMServerEngine(urls=[url], sync_dir=sync_dir, connect_timeout=30, liveness_timeout=LIVE,
                                  liveness_interval=TICK)
        engine.prepare(model, tok, GenerationConfig(do_sample=True, max_new_tokens=4))
        if rank == 1:
            def failed() -> bool:
                raise ServerFailed(f"VLLMServerEngine: {url} did not complete a row in 3 attempts (rank 1's)")

            engine._drain = failed
        try:
            engine._sync(model)
            out.put((rank, "synced"))
        except ServerFailed as err:
            out.put((rank, str(err)))
        engine.close()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow  # two processes that import torch: a minute on 2 cores
def test_a_failure_of_one_ranks_rows_ends_every_rank_at_the_sync(standin, tiny_model_dir, tmp_path):
    """Two gloo ranks: rank 1's rows before a sync failed. Every rank still joins the sync's collectives and ends it
    with rank 1's line (none waits for it in a collective)."""
    import torch.multiprocessing as mp

    from vllm_server_helpers import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_syncs, args=(r, standin.url, tiny_model_dir, port, str(tmp_path / "sync"), out))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    line = f"VLLMServerEngine: {standin.url} did not complete a row in 3 attempts (rank 1's)"
    assert got == {0: line, 1: line}


def test_rows_the_server_aborts_are_sampled_again_not_kept(standin, engines, policy):
    """Rows in flight aborted by the server (vLLM shutting down, or another client's ``/pause?mode=abort``) come back
    as empty completions with ``finish_reason: abort``: not samples. They are sent again with their seeds."""
    model, tok, config, ids, mask = policy
    engine = engines(standin)
    expected = engine.generate(model, tok, ids, mask, config, seed=5)
    engine.metrics()
    handle = held_rows(standin, engine, policy, seed=5)
    for path in ("/pause?mode=abort", "/resume"):
        request = urllib.request.Request(standin.url + path, data=b"{}", method="POST",
                                         headers={"Authorization": f"Bearer {KEY}"})
        urllib.request.urlopen(request, timeout=10).read()
    assert same(engine.collect(handle), expected)
    assert engine.metrics()["train/server_retries"] >= ROWS
