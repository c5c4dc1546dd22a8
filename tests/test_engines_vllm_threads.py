"""``VLLMEngine(threads=...)``: the engine child's torch / OpenMP thread count. Refused when not an integer >= 1,
named by the engine's spec (so a checkpoint rebuilds it), handed to the child (``None``: the trainer's
``torch.get_num_threads()``), and in the child's environment as ``OMP_NUM_THREADS``. None of it needs vLLM: the
child is started without building vLLM's engine (it imports vLLM only at its ``build`` request)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from rloo_lightning.engines import engine_spec
from rloo_lightning.engines import vllm as vllm_engine
from rloo_lightning.engines.vllm import VLLMEngine
from rloo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama


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
