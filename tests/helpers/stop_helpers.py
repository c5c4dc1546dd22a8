"""What the SIGTERM and SIGINT tests run inside the CLI: rewards, callbacks and engines that signal their own process
(SIGTERM, as a scheduler) or its process group (SIGINT, as a terminal's Ctrl-C) at a chosen point, and record how
far the run got (one line per event in ``$STOP_LOG``)."""

from __future__ import annotations

import os
import signal
import time

from lightning.pytorch import Callback

from rloo_lightning.engines.base import Submitted
from rloo_lightning.engines.decode import DecodeLoopEngine
from rloo_lightning.engines.vllm import VLLMEngine  # does not import vLLM


def _record(event: str) -> int:
    """Append ``event`` to ``$STOP_LOG``; the number of events before it."""
    path = os.environ["STOP_LOG"]
    seen = open(path).read().count("\n") if os.path.exists(path) else 0
    with open(path, "a") as f:
        f.write(f"{event}\n")
    return seen


def send(name: str = "SIGTERM") -> None:
    """SIGTERM to this process, as a scheduler sends it; SIGINT to this process's group, as a terminal's Ctrl-C
    reaches every process of its foreground group (the DDP ranks and the worker processes too). Only in a CLI
    started in a session of its own (``cli_harness.Proc``), never in the test runner's group."""
    sig = getattr(signal, name)
    if sig != signal.SIGINT:
        os.kill(os.getpid(), sig)
        return
    group = os.getpgid(0)
    if os.getsid(0) != group:
        raise RuntimeError("stop_helpers.send('SIGINT') needs a process group of its own (cli_harness.Proc)")
    os.killpg(group, sig)


def reward_that_signals(prompts, completions, completion_ids, **columns) -> list[float]:
    """Sends SIGTERM to its own process on its ``$STOP_AT_CALL``-th call (from 0), on rank ``$STOP_RANK`` only
    (default 0: the other ranks get the signal from it, as from a scheduler that signals the launcher)."""
    rank = os.environ.get("LOCAL_RANK", "0")
    if rank != os.environ.get("STOP_RANK", "0"):
        return [float(len(c) % 2) for c in completions]
    if _record("reward") == int(os.environ.get("STOP_AT_CALL", "-1")):
        send(os.environ.get("STOP_SIGNAL", "SIGTERM"))
    return [float(len(c) % 2) for c in completions]


def reward_that_fails(prompts, completions, completion_ids, **columns) -> list[float]:
    """Raises on its ``$FAIL_AT_CALL``-th call (from 0; counted in ``$STOP_LOG``), on rank ``$FAIL_RANK`` only when
    it is set, as a reward under ``rewards.on_error: raise`` whose service went away; else ``len(completion) % 2``."""
    if os.environ.get("FAIL_RANK", os.environ.get("LOCAL_RANK", "0")) == os.environ.get("LOCAL_RANK", "0"):
        call = _record("reward")
        if call == int(os.environ.get("FAIL_AT_CALL", "-1")):
            raise RuntimeError(f"reward failed on call {call}")
    return [float(len(c) % 2) for c in completions]


def reward_that_presses_ctrl_c(prompts, completions, completion_ids, **columns) -> list[float]:
    """From its ``$STOP_AT_CALL``-th call on (counted over every process that runs it: reward workers too), the
    first call to get there sends SIGINT to the process group, once; ``$CTRL_C_TWICE`` set: a second one a second
    later, then the call hangs (a run that does not end at the second one is killed by the test's timeout). Each
    call takes ``$REWARD_SECONDS`` (default 0.5: a signal from one worker lands while the others work too)."""
    if _record("reward") >= int(os.environ["STOP_AT_CALL"]):
        try:
            os.close(os.open(os.environ["STOP_LOG"] + ".sent", os.O_CREAT | os.O_EXCL))  # one caller only
        except FileExistsError:
            pass
        else:
            _record("ctrl-c")
            send("SIGINT")
            if os.environ.get("CTRL_C_TWICE"):
                time.sleep(1.0)
                _record("ctrl-c")
                send("SIGINT")
                time.sleep(3600)
    time.sleep(float(os.environ.get("REWARD_SECONDS", "0.5")))
    return [float(len(c) % 2) for c in completions]


class SignalAt(Callback):
    """``sig`` (:func:`send`) at a hook: ``setup`` (before the model loads), or the start of validation batch
    ``val_batch`` of the validation after step ``step``; records every validation batch that ends."""

    def __init__(self, at: str = "val", step: int = -1, val_batch: int = -1, sig: str = "SIGTERM") -> None:
        self.at, self.step, self.val_batch, self.sig = at, step, val_batch, sig

    def setup(self, trainer, pl_module, stage) -> None:
        if self.at == "setup":
            _record("setup")
            send(self.sig)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        _record(f"val_start {trainer.global_step} {batch_idx}")
        if self.at == "val" and trainer.global_step == self.step and batch_idx == self.val_batch:
            send(self.sig)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        _record(f"val_end {trainer.global_step} {batch_idx}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        _record(f"step {trainer.global_step}")


class HeldEngine(DecodeLoopEngine):
    """The default engine, seen by the pipeline as an engine that keeps each version's weights while its requests run
    (a LoRA policy's adapters on vLLM) when ``held``: :meth:`submit` samples at once, from the weights as they are,
    and hands the sample over only at :meth:`collect`, so that a rollout ahead is in flight across step ends
    (``collected`` counts the hand-overs)."""

    def __init__(self, return_logprobs: bool = False, held: bool = False) -> None:
        super().__init__(return_logprobs=return_logprobs)
        self.held, self.overlaps, self.keeps_versions, self.collected = held, held, held, 0

    def submit(self, model, tokenizer, prompt_ids, prompt_mask, generation_config, seed):
        handle = super().submit(model, tokenizer, prompt_ids, prompt_mask, generation_config, seed)
        return Submitted(key=handle) if self.held else handle

    def collect(self, handle):
        if not self.held:
            return super().collect(handle)
        self.collected += 1
        handle.value, handle.seconds = handle.key.value, handle.key.seconds
        return handle.value


class SignallingEngine(HeldEngine):
    """The default engine, that sends ``sig`` (:func:`send`) as its ``at_call``-th call (from 0) starts: the signal
    lands inside that training step's generation (validation off: one call per step). With several ranks, only
    rank ``rank`` sends it (a SIGTERM reaches that rank alone: rank 0 passes it to the ranks it launched, another
    rank does not; a SIGINT reaches every rank, as a terminal's Ctrl-C). ``held``: as :class:`HeldEngine`."""

    def __init__(self, at_call: int = -1, rank: int = 0, sig: str = "SIGTERM", return_logprobs: bool = False,
                 held: bool = False) -> None:
        super().__init__(return_logprobs=return_logprobs, held=held)
        self.at_call, self.rank, self.sig, self.calls = at_call, rank, sig, 0

    def generate(self, *args, **kwargs):
        if self.calls == self.at_call and int(os.environ.get("LOCAL_RANK", "0")) == self.rank:
            _record(f"signal at generate call {self.at_call}")
            send(self.sig)
        self.calls += 1
        return super().generate(*args, **kwargs)



class SignallingVLLMEngine(VLLMEngine):
    """:class:`~rloo_lightning.engines.vllm.VLLMEngine` that sends its own process SIGTERM as its ``at_call``-th
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


def pool_under_ctrl_c(start_method: str) -> None:
    """A :class:`~rloo_lightning.runtime.workers.WorkerPool` of 2 workers sent SIGINT to its process group while
    they start and again during a call (:func:`reward_that_presses_ctrl_c`), this process counting the signals as
    the trainer would; prints ``outcomes``, whether the workers are the same processes, and the signals seen."""
    from rloo_lightning.runtime.workers import WorkerPool

    seen = []
    signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    pool = WorkerPool({0: "stop_helpers.reward_that_presses_ctrl_c"}, {0: "ctrl_c"}, num_workers=2,
                      start_method=start_method)
    pids = pool.pids
    send("SIGINT")  # while the workers start up (a spawned one imports for seconds)
    args = (["p"], ["one"], [[1]], {})
    outcomes = pool.run([(0, "positional", args)] * 4)
    print(f"outcomes {[kind for kind, _ in outcomes]} same_workers {pool.pids == pids} signals {len(seen)}")
    pool.close()


if __name__ == "__main__":
    import sys

    pool_under_ctrl_c(sys.argv[1])
