"""Engines for the fixed-lag rollout tests with vLLM: one whose child process dies (SIGKILL) or stops answering
(SIGSTOP) right after a chosen submission, on a chosen rank."""

from __future__ import annotations

import os
import signal

from rloo_lightning.engines.vllm import VLLMEngine


class FailingChildVLLMEngine(VLLMEngine):
    """:class:`VLLMEngine` that sends its child ``sig`` (``SIGKILL``: it dies; ``SIGSTOP``: it hangs) just after its
    ``at_call``-th :meth:`submit` (from 0), on local rank ``rank``."""

    def __init__(self, at_call: int = -1, rank: int = 0, sig: str = "SIGKILL", **kwargs) -> None:
        super().__init__(**kwargs)
        self.at_call, self.rank, self.sig, self.calls = at_call, rank, sig, 0

    def submit(self, *args, **kwargs):
        handle = super().submit(*args, **kwargs)
        if self.calls == self.at_call and int(os.environ.get("LOCAL_RANK", "0")) == self.rank:
            os.kill(self._worker.process.pid, getattr(signal, self.sig))
        self.calls += 1
        return handle
