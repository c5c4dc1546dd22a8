"""``VLLMEngine(threads=...)``: the engine child's torch / OpenMP thread count. Refused when not an integer >= 1,
named by the engine's spec (so a checkpoint rebuilds it), handed to the child (``None``: the trainer's
``torch.get_num_threads()``), and in the child's environment as ``OMP_NUM_THREADS``. None of it needs vLLM: the
child is started without building vLLM's engine (it imports vLLM only at its ``build`` request). And vLLM's warnings
about the machine's threads (``torch.set_num_threads`` after the thread binding, four times a start) are said once per
trainer process, not at every start of a child: the filter without vLLM, two engines in one process with it."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from rloo_lightning.engines import engine_spec
from rloo_lightning.engines import vllm as vllm_engine
from rloo_lightning.engines.vllm import VLLMEngine
from rloo_lightning.engines import vllm_process
from rloo_lightning.engines.vllm_child import _OnceVLLMRecords
from rloo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama
from vllm_helpers import tiny_head32_llama, vllm_test


@pytest.mark.parametrize("threads", [0, -2, 1.5, "2", True])
def test_threads_below_one_or_not_an_integer_are_refused_when_made(threads):
    with pytest.raises(ValueError, match="threads"):
        VLLMEngine(threads=threads)


def test_threads_is_stored_and_named_by_the_engine_spec():
    assert VLLMEngine().threads is None
    assert engine_spec(VLLMEngine())[0]["init_args"]["threads"] is None
    engine = VLLMEngine(threads=3)
    assert engine.threads == 3
    spec, why = engine_spec(engine)
    assert why is None and spec["init_args"]["threads"] == 3


class _FakeWorker:
    """Stands in for the child process: records the thread count it was started with, answers every request."""

    started: list[int] = []

    def __init__(self, device, threads, timeout, stall_timeout=600.0) -> None:
        _FakeWorker.started.append(threads)

    def call(self, verb, *args):
        return None

    def close(self) -> None:
        pass


@pytest.mark.parametrize("threads", [None, 1, 3])
def test_the_child_is_started_with_the_engines_threads_or_the_trainers(monkeypatch, threads):
    monkeypatch.setattr(vllm_engine, "ChildProcess", _FakeWorker)
    _FakeWorker.started = []
    tok = build_char_tokenizer("abc", model_max_length=64)
    model = build_tiny_llama(tok, hidden_size=64, num_heads=2, max_position_embeddings=64, seed=0)
    engine = VLLMEngine(threads=threads)
    engine._start(model)
    try:
        expected = torch.get_num_threads() if threads is None else threads
        assert _FakeWorker.started == [expected]
    finally:
        engine._config_dir.cleanup()


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads the child's /proc/<pid>/environ")
def test_the_child_process_gets_that_many_openmp_threads():
    """The real child (no vLLM engine built): its environment says OMP_NUM_THREADS, which torch reads at import."""
    worker = vllm_engine.ChildProcess(torch.device("cpu"), 2, timeout=120.0)
    proc = Path(f"/proc/{worker.process.pid}")
    try:
        # spawn returns before the child's exec: until then /proc shows this process's own environment
        deadline = time.monotonic() + 30
        while b"--multiprocessing-fork" not in (proc / "cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        environ = (proc / "environ").read_bytes().split(b"\0")
        assert b"OMP_NUM_THREADS=2" in environ
    finally:  # killed, not closed: a close would wait for the child's imports before it reads the request
        worker.process.kill()
        worker.process.join(10)
        worker.close()


THREADS_BOUND = "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it."


@pytest.fixture
def once_filters(monkeypatch):
    """The child's once-per-process filters, installed here (as in a child), removed after the test."""
    yield
    for _, (name, _) in _OnceVLLMRecords.WARNINGS.items():
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, _OnceVLLMRecords)]:
            logger.removeFilter(f)
    _OnceVLLMRecords.said = set()


def test_the_machines_thread_warnings_are_said_once_and_not_again_by_a_later_child(monkeypatch, once_filters, caplog):
    worker, torch_utils = logging.getLogger("vllm.v1.worker.cpu_worker"), logging.getLogger("vllm.utils.torch_utils")
    monkeypatch.setenv("RLOO_VLLM_SAID_ONCE", "omp-threads")  # an earlier child of the trainer said this one
    _OnceVLLMRecords.install()
    _OnceVLLMRecords.install()  # twice (a second build): one filter per logger and warning
    with caplog.at_level(logging.WARNING):
        for _ in range(4):  # as vLLM's model loading does at each start
            worker.warning(THREADS_BOUND)
        torch_utils.warning("OMP_NUM_THREADS=%s is set; leaving Torch threads at %d for serving.", "2", 2)
        for lib in ("libtcmalloc", "libiomp", "libtcmalloc"):
            worker.warning("%s is not found in LD_PRELOAD. For best performance ...", lib)
        worker.warning("Node %s is not in available memory nodes %s.", 0, [1])  # any other: passed
    assert [r.getMessage() for r in caplog.records] == [
        THREADS_BOUND, "libtcmalloc is not found in LD_PRELOAD. For best performance ...",
        "libiomp is not found in LD_PRELOAD. For best performance ...", "Node 0 is not in available memory nodes [1]."]
    assert _OnceVLLMRecords.said == {"omp-threads", "threads-bound", "ld-preload:libtcmalloc", "ld-preload:libiomp"}


@vllm_test
def test_two_engines_in_one_process_say_the_thread_binding_warning_once(capfd, monkeypatch):
    """Two engines, one after the other, in one process (a fit, then a test): two children, each building vLLM's
    CPU worker, which warns about ``torch.set_num_threads`` four times a start; their output (this process's fds,
    inherited) holds it once."""
    monkeypatch.setattr(vllm_process, "_said_once", set())
    from transformers import GenerationConfig

    model, tok = tiny_head32_llama()
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=4,
                              eos_token_id=None, pad_token_id=0)
    enc = tok(["1+2=", "ab"], return_tensors="pt", padding=True)
    for _ in range(2):
        engine = VLLMEngine(stall_timeout=60)
        engine.check(torch.device("cpu"))
        engine.prepare(model, tok, config)
        try:
            assert engine.generate(model, tok, enc["input_ids"], enc["attention_mask"], config, seed=0)[0].shape[0] == 2
        finally:
            engine.close()
    out, err = capfd.readouterr()
    assert (out + err).count("after the thread binding") == 1, out + err
    assert "threads-bound" in vllm_process._said_once
