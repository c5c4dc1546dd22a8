"""What the SIGTERM tests run inside the CLI: a reward and callbacks that signal their own process at a chosen
point, and record how far the run got (one line per event in ``$STOP_LOG``)."""

from __future__ import annotations

import os
import signal

from lightning.pytorch import Callback

from rloo_lightning.decode import DecodeLoopEngine
from rloo_lightning.vllm_engine import VLLMEngine  # does not import vLLM


def _record(event: str) -> int:
    """Append ``event`` to ``$STOP_LOG``; the number of events before it."""
    path = os.environ["STOP_LOG"]
    seen = open(path).read().count("\n") if os.path.exists(path) else 0
    with open(path, "a") as f:
        f.write(f"{event}\n")
    return seen


def reward_that_signals(prompts, completions, completion_ids, **columns) -> list[float]:
    """Sends SIGTERM to its own process on its ``$STOP_AT_CALL``-th call (from 0), on rank ``$STOP_RANK`` only
    (default 0: the other ranks get the signal from it, as from a scheduler that signals the launcher)."""
    rank = os.environ.get("LOCAL_RANK", "0")
    if rank != os.environ.get("STOP_RANK", "0"):
        return [float(len(c) % 2) for c in completions]
    if _record("reward") == int(os.environ.get("STOP_AT_CALL", "-1")):
        os.kill(os.getpid(), signal.SIGTERM)
    return [float(len(c) % 2) for c in completions]


class SignalAt(Callback):
    """SIGTERM at a hook: ``setup`` (before the model loads), or the start of validation batch ``val_batch`` of the
    validation after step ``step``; records every validation batch that ends."""

    def __init__(self, at: str = "val", step: int = -1, val_batch: int = -1) -> None:
        self.at, self.step, self.val_batch = at, step, val_batch

    def setup(self, trainer, pl_module, stage) -> None:
        if self.at == "setup":
            _record("setup")
            os.kill(os.getpid(), signal.SIGTERM)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        _record(f"val_start {trainer.global_step} {batch_idx}")
        if self.at == "val" and trainer.global_step == self.step and batch_idx == self.val_batch:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        _record(f"val_end {trainer.global_step} {batch_idx}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        _record(f"step {trainer.global_step}")


class SignallingEngine(DecodeLoopEngine):
    """The default engine, that sends its own process SIGTERM as its ``at_call``-th call (from 0) starts: the
    signal lands inside that training step's generation (validation off: one call per step). With several ranks,
    only rank ``rank`` signals itself (rank 0 passes the signal to the ranks it launched; another rank does not)."""

    def __init__(self, at_call: int = -1, rank: int = 0) -> None:
        super().__init__()
        self.at_call, self.rank, self.calls = at_call, rank, 0

    def generate(self, *args, **kwargs):
        if self.calls == self.at_call and int(os.environ.get("LOCAL_RANK", "0")) == self.rank:
            _record(f"signal at generate call {self.at_call}")
            os.kill(os.getpid(), signal.SIGTERM)
        self.calls += 1
        return super().generate(*args, **kwargs)



class SignallingVLLMEngine(VLLMEngine):
    """:class:`~rloo_lightning.vllm_engine.VLLMEngine` that sends its own process SIGTERM as its ``at_call``-th
    generation (from 0) starts: the engine's wait for the child sees the signal and ends the rollout there."""

    def __init__(self, at_call: int = -1) -> None:
        super().__init__()
        self.at_call, self.calls = at_call, 0

    def generate(self, *args, **kwargs):
        if self.calls == self.at_call:
            _record(f"signal at vllm generate call {self.at_call}")
            os.kill(os.getpid(), signal.SIGTERM)
        self.calls += 1
        return super().generate(*args, **kwargs)
