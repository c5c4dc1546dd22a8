"""VLLMEngine's overlap (``rollout.lag``): ``submit`` returns while the child generates, ``collect`` gives
each request its own answer (bit for bit what ``generate`` gives), a request samples the weights it was submitted
with, a stop signal cuts a synchronous generate and never a submitted one, and a child that dies or stalls raises
instead of hanging. The protocol itself (ids, kept answers, heartbeats, death, stall, close) is checked first on the
child without vLLM (its ``stats`` request needs no engine), so it runs everywhere; the rest needs vLLM."""

from __future__ import annotations

import copy
import os
import signal
import time

import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from transformers import GenerationConfig

from rloo_lightning.engines.vllm import VLLMEngine, vllm_available
from rloo_lightning.engines.vllm_process import ChildProcess
from vllm_helpers import tiny_head32_llama, vllm_test

TEXTS = ["1+2=", "33+4=", "abc", "j=", "999+1=", "a+b=", "hello", "0"]
LONG_TOKENS = 150  # about 2 s of the tiny model's generation for 16 rows on 2 cores: long enough to overlap


def test_stall_timeout_must_be_positive():
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="stall_timeout"):
            VLLMEngine(stall_timeout=bad)
    assert VLLMEngine.overlaps and VLLMEngine(stall_timeout=3).stall_timeout == 3


# -- the protocol, on the child without vLLM ---------------------------------------------------------
@pytest.fixture
def worker():
    w = ChildProcess(torch.device("cpu"), 1, timeout=60, stall_timeout=1.5)
    yield w
    if w.process.is_alive():  # a test may leave it stopped
        os.kill(w.process.pid, signal.SIGCONT)
    w.close()


@pytest.mark.slow
def test_answers_are_matched_by_id_and_a_stalled_or_dead_child_raises(worker):
    first, second = worker.send("stats"), worker.send("stats")
    value, seconds = worker.result(second)  # the first answer comes before: kept for its own result
    assert first in worker.answers and value["peak_rss_mb"] > 0 and seconds >= 0
    assert worker.result(first)[0]["peak_rss_mb"] > 0
    with pytest.raises(ValueError, match="not pending"):
        worker.result(first)
    with pytest.raises(RuntimeError, match="failed during 'nope'"):
        worker.call("nope")

    os.kill(worker.process.pid, signal.SIGSTOP)  # alive, silent: a stuck child
    late = worker.send("stats")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"pid {worker.process.pid}\) sent nothing for 1.5 s during 'stats' "
                                           r"\(VLLMEngine stall_timeout\)"):
        worker.result(late)
    assert 1.5 <= time.monotonic() - start < 5
    os.kill(worker.process.pid, signal.SIGCONT)
    assert worker.result(late)[0]["peak_rss_mb"] > 0  # the request was not lost: waiting again gets it

    os.kill(worker.process.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"vLLM engine's process \(pid \d+\) ended \(exit code -9\) during "
                                           r"'stats'"):
        worker.result(worker.send("stats"))
    assert time.monotonic() - start < 3


@pytest.mark.slow
def test_close_with_a_request_pending_on_a_stuck_child_does_not_wait(worker):
    os.kill(worker.process.pid, signal.SIGSTOP)
    worker.send("stats")
    start = time.monotonic()
    worker.close()
    assert time.monotonic() - start < 5 and not worker.process.is_alive()


@pytest.mark.slow
def test_a_send_to_a_stopped_child_is_bounded_by_stall_timeout(worker):
    """A request larger than the pipe's buffer, to a child that reads nothing (SIGSTOP): the send gives up after
    ``stall_timeout`` with one line naming the child, writes nothing more into the pipe, and close kills the child."""
    pid = worker.process.pid
    assert worker.call("stats")["peak_rss_mb"] > 0  # up: it imported and answers
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"^the vLLM engine \(pid {pid}\) took in nothing of the 'stats' request "
                                           r"for 1.5 s \(VLLMEngine stall_timeout\): it is stopped or stuck"):
        worker.send("stats", b"x" * (4 << 20))  # 4 MiB: a pipe holds 64 KiB
    assert 1.5 <= time.monotonic() - start < 5
    with pytest.raises(TimeoutError, match="took in nothing"):  # the pipe holds part of a message: never again
        worker.send("stats")
    start = time.monotonic()
    worker.close()
    assert time.monotonic() - start < 5 and not worker.process.is_alive()


# -- with vLLM: one engine on a tiny head-size-32 Llama -----------------------------------------------
def _config(**kw) -> GenerationConfig:
    # No EOS: every row samples max_new_tokens tokens, so a cut row shows and a request takes a known while.
    base = dict(do_sample=True, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=LONG_TOKENS, eos_token_id=None,
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
    # stall_timeout: the first engine step after the build takes seconds on a CPU (its kernels warm up)
    eng = VLLMEngine(stall_timeout=60)
    eng.check(torch.device("cpu"))
    eng.prepare(model, tok, _config())
    yield eng
    eng.close()


def _prompts(tok, texts=TEXTS, k: int = 2):
    enc = tok(texts, return_tensors="pt", padding=True)
    return enc["input_ids"].repeat_interleave(k, 0), enc["attention_mask"].repeat_interleave(k, 0)


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _answered(engine, handle) -> bool:
    return engine._worker.answered(handle.key.request_id)


@vllm_test
def test_submit_returns_before_the_sample_and_collect_is_generate_bit_for_bit(tiny, engine):
    model, tok = tiny
    ids, mask = _prompts(tok)
    engine.on_weights_updated(model)
    ref = engine.generate(model, tok, ids, mask, _config(), seed=5)
    start = time.perf_counter()
    handle = engine.submit(model, tok, ids, mask, _config(), seed=5)
    sent = time.perf_counter() - start
    assert not _answered(engine, handle)  # still generating in the child: submit did not wait for it
    out = engine.collect(handle)
    assert _same(out, ref) and out[0].shape == (16, LONG_TOKENS)
    assert handle.seconds is not None and 0 < sent < handle.seconds
    assert engine.collect(handle) is out  # collected once; asking again gives the same answer


@vllm_test
def test_each_request_gets_its_own_answer_whatever_the_order(tiny, engine):
    model, tok = tiny
    engine.on_weights_updated(model)
    requests = [(_prompts(tok, TEXTS[:4], k=3), _config(max_new_tokens=40 + 10 * i), 20 + i) for i in range(5)]
    refs = [engine.generate(model, tok, ids, mask, config, seed) for (ids, mask), config, seed in requests]
    submit = lambda i: engine.submit(model, tok, *requests[i][0], requests[i][1], requests[i][2])  # noqa: E731

    a, b = submit(0), submit(1)
    (ids, mask), config, seed = requests[2]
    assert _same(engine.generate(model, tok, ids, mask, config, seed), refs[2])  # answered third, both kept
    assert _same(engine.collect(b), refs[1]) and _same(engine.collect(a), refs[0])
    d, e = submit(3), submit(4)
    assert _same(engine.collect(e), refs[4])  # d's answer came first, kept while e's was awaited
    assert _same(engine.collect(d), refs[3])
    assert not engine._worker.pending and not engine._worker.answers


@vllm_test
def test_a_request_samples_the_weights_it_was_submitted_with(tiny, engine):
    model, tok = tiny
    policy = copy.deepcopy(model)
    weights_a = {k: v.clone() for k, v in policy.state_dict().items()}

    def perturb(seed):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))

    ids, mask = _prompts(tok)
    engine.on_weights_updated(policy)
    ref_a = engine.generate(policy, tok, ids, mask, _config(), seed=1)
    perturb(0)
    engine.on_weights_updated(policy)
    ref_b = engine.generate(policy, tok, ids, mask, _config(), seed=2)
    assert not torch.equal(engine.generate(policy, tok, ids, mask, _config(), seed=1)[0], ref_a[0])  # B differs
    policy.load_state_dict(weights_a)

    engine.on_weights_updated(policy)
    first = engine.submit(policy, tok, ids, mask, _config(), seed=1)  # pushes A
    assert not _answered(engine, first)
    perturb(0)  # the optimizer step: the policy's tensors change under a pending request
    engine.on_weights_updated(policy)
    pushes = engine.pushes
    second = engine.submit(policy, tok, ids, mask, _config(), seed=2)  # pushes B once `first` is answered
    assert engine.pushes == pushes + 1 and _answered(engine, first)
    assert _same(engine.collect(second), ref_b)
    assert _same(engine.collect(first), ref_a)


@vllm_test
def test_a_stop_cuts_a_synchronous_generate_and_never_a_submitted_one(tiny, engine, monkeypatch):
    model, tok = tiny
    ids, mask = _prompts(tok)
    engine.on_weights_updated(model)
    ref = engine.generate(model, tok, ids, mask, _config(), seed=9)

    # several ranks: a stop tells the generation to end its rows (check returns True)
    monkeypatch.setattr("rloo_lightning.engines.vllm_process.sigterm.check", lambda where="": True)
    pending = engine.submit(model, tok, ids, mask, _config(), seed=9)
    cut, _ = engine.generate(model, tok, ids, mask, _config(), seed=9)  # sent behind it, the stop set meanwhile
    assert cut.shape[1] < LONG_TOKENS
    assert not engine._worker.stop_event.is_set()
    assert _same(engine.collect(pending), ref)

    # the stop event set while a submitted request generates (a generate's stop, as above) does not reach it
    pending = engine.submit(model, tok, ids, mask, _config(), seed=9)
    engine._worker.stop_event.set()
    try:
        assert _same(engine.collect(pending), ref)
    finally:
        engine._worker.stop_event.clear()

    # one process: the stop raises in the synchronous generate; the pipe stays in step
    def raise_stop(where=""):
        raise SIGTERMException(where)

    monkeypatch.setattr("rloo_lightning.engines.vllm_process.sigterm.check", raise_stop)
    pending = engine.submit(model, tok, ids, mask, _config(), seed=9)
    with pytest.raises(SIGTERMException):
        engine.generate(model, tok, ids, mask, _config(), seed=3)
    assert list(engine._worker.pending) == [] and not engine._worker.stop_event.is_set()
    assert _same(engine.collect(pending), ref)
    monkeypatch.undo()
    assert _same(engine.generate(model, tok, ids, mask, _config(), seed=9), ref)


@vllm_test
def test_close_with_requests_pending_does_not_wait_for_them(tiny, engine):
    model, tok = tiny
    ids, mask = _prompts(tok)
    handles = [engine.submit(model, tok, ids, mask, _config(), seed=s) for s in range(3)]
    assert not _answered(engine, handles[-1])
    start = time.monotonic()
    engine.close()
    assert time.monotonic() - start < 5
    with pytest.raises(RuntimeError, match="closed"):
        engine.collect(handles[-1])


@vllm_test
def test_a_child_that_stalls_or_dies_raises_instead_of_hanging(tiny):
    model, tok = tiny
    engine = VLLMEngine(stall_timeout=3)
    engine.check(torch.device("cpu"))
    engine.prepare(model, tok, _config())
    try:
        ids, mask = _prompts(tok)
        handle = engine.submit(model, tok, ids, mask, _config(), seed=0)
        pid = engine._worker.process.pid
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"vLLM engine \(pid {pid}\) sent nothing for 3 s during 'generate' "
                                               r"\(VLLMEngine stall_timeout\)"):
            engine.collect(handle)
        assert 3 <= time.monotonic() - start < 8
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)  # while it generates again
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"vLLM engine's process \(pid \d+\) ended \(exit code -9\) during "
                                               r"'generate'"):
            engine.collect(handle)
        assert time.monotonic() - start < 3
    finally:
        start = time.monotonic()
        engine.close()
        assert time.monotonic() - start < 5
