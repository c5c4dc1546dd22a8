"""PhaseTimer (no-op when off, accumulates when on) and StepTimer (one JSON entry per training step).

No assertion compares a time with a threshold: only structure, signs and bookkeeping.
"""

from __future__ import annotations

import json
import time

import torch
from lightning.pytorch import Trainer

from rloo_lightning.data import PromptDataModule
from rloo_lightning.module import RLOOModule
from rloo_lightning.callbacks.step_timer import StepTimer
from rloo_lightning.runtime.timing import PhaseTimer


def test_disabled_phase_timer_is_a_shared_noop():
    timer = PhaseTimer()
    assert timer.enabled is False
    first, second = timer("generation"), timer("reward")
    assert first is second  # one shared nullcontext: nothing is allocated per call
    with first:
        with second:  # reentrant
            time.sleep(0.001)
    assert timer.pop() == {}
    assert timer.totals == {}


def test_enabled_phase_timer_accumulates_and_pop_clears():
    timer = PhaseTimer(enabled=True)
    for _ in range(3):
        with timer("generation"):
            time.sleep(0.002)
    with timer("reward"):
        pass
    totals = timer.pop()
    assert set(totals) == {"generation", "reward"}
    assert all(isinstance(v, float) and v >= 0 for v in totals.values())
    assert totals["generation"] > 0
    assert timer.pop() == {}  # cleared
    assert timer.last == totals  # the last non-empty pop is kept for late readers


def test_phase_timer_records_a_phase_that_raises():
    timer = PhaseTimer(enabled=True)
    try:
        with timer("reward"):
            raise ValueError("boom")
    except ValueError:
        pass
    assert "reward" in timer.pop()


class _TimedModule(RLOOModule):
    """RLOOModule with an enabled phase timer and one phase around the whole training step.

    (The module's own phases, once it wraps them, land in the same timer; only ours is asserted.)
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.timer = PhaseTimer(enabled=True)

    def training_step(self, batch, batch_idx):
        with self.timer("test_step"):
            return super().training_step(batch, batch_idx)


def _fit(model_dir: str, module_cls, callback: StepTimer, steps: int = 2, **options) -> None:
    module = module_cls(model_dir, rewards={"funcs": ["rloo_lightning.tasks.reverse.reward"]},
                        sampling={"k": 2, "max_new_tokens": 4}, kl={"beta": 0.05}, validation={"at_start": False},
                        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), **options)
    data = PromptDataModule(tokenizer_name_or_path=model_dir, task="reverse", batch_size=4, num_train_rows=32,
                            num_val_rows=4, max_new_tokens=4)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0, callbacks=[callback])
    trainer.fit(module, datamodule=data)


def test_step_timer_writes_one_entry_per_step(tmp_path, tiny_model_dir):
    path = tmp_path / "steps.json"
    _fit(tiny_model_dir, RLOOModule, StepTimer(str(path)))
    steps = json.loads(path.read_text())["steps"]
    assert [s["step"] for s in steps] == [0, 1]
    for s in steps:
        assert set(s) == {"step", "t_start", "total_s", "backward_s", "optimizer_s", "phases", "rss_hwm_mb"}
        assert s["rss_hwm_mb"] > 10  # a torch process holds more than 10 MiB resident
        assert s["total_s"] > 0 and s["backward_s"] > 0 and s["optimizer_s"] > 0
        assert s["backward_s"] + s["optimizer_s"] <= s["total_s"]
    assert steps[0]["t_start"] == 0 and steps[1]["t_start"] > 0


def test_step_timer_reads_the_module_phase_timer(tmp_path, tiny_model_dir):
    path = tmp_path / "steps.json"
    _fit(tiny_model_dir, _TimedModule, StepTimer(str(path)))
    steps = json.loads(path.read_text())["steps"]
    assert len(steps) == 2
    for s in steps:
        assert "test_step" in s["phases"]
        assert 0 < s["phases"]["test_step"] <= s["total_s"]


def test_the_module_times_each_part_of_its_step(tmp_path, tiny_model_dir):
    """``run.time_phases``: a phase per part of the step; with several micro-batches, the backwards of every
    micro-batch but the last are a phase of their own (the last one's is Lightning's: the step timer's
    ``backward_s``)."""
    path = tmp_path / "steps.json"
    _fit(tiny_model_dir, RLOOModule, StepTimer(str(path)), run={"time_phases": True}, update={"micro_batch_size": 2})
    for s in json.loads(path.read_text())["steps"]:
        assert set(s["phases"]) == {"generation", "reward", "policy_logprobs", "reference", "update_forward",
                                    "update_backward"}
        assert all(seconds > 0 for seconds in s["phases"].values())
