"""The NaN/inf guard (``update.on_nonfinite``) through the CLI: ``stop`` raises naming the step and the rollout's
statistics and writes no poisoned checkpoint; ``skip`` drops exactly the poisoned updates, counts them, and a resume
between two of them stays exact.

The runs are those of ``test_resume.py`` (``tests/helpers/run_helpers.py``), poisoned by
``reliability_helpers.callbacks``' ``PoisonReward`` / ``PoisonGrad`` (a non-finite loss or gradient at a chosen step).
"""

from __future__ import annotations

import re

import pytest
import torch

from cli_harness import make_env, wait_all
from rloo_lightning.runtime.tensorboard_logs import read_scalars
from run_helpers import (
    HELPERS,
    _assert_same_tensors,
    _check_checkpoint_folder,
    _ckpt_every_step,
    _cli,
    _fit_args,
    _flat_tensors,
    _load,
    _step_of,
)

pytestmark = pytest.mark.slow  # every run here is a subprocess


# ---------------------------------------------------------------------------------------------
# the NaN/inf guard
# ---------------------------------------------------------------------------------------------
POISON = 3  # step of the non-finite loss / gradient in the stop runs
SKIP_LOSS, SKIP_GRAD, SKIP_TOTAL = 2, 5, 8


def _poison_reward(step: int, value: str = "inf") -> list[str]:
    return [f"--trainer.callbacks+={HELPERS}.PoisonReward", f"--trainer.callbacks.step={step}",
            f"--trainer.callbacks.value={value}"]


def _poison_grad(step: int) -> list[str]:
    return [f"--trainer.callbacks+={HELPERS}.PoisonGrad", f"--trainer.callbacks.step={step}"]


@pytest.fixture(scope="module")
def nan_runs(tmp_path_factory, tiny_model_dir, _cache_dir):
    env = make_env(_cache_dir)
    specs = {
        "stop_loss": (6, ["--model.update.on_nonfinite", "stop", *_poison_reward(POISON, "inf")]),
        "stop_grad": (6, ["--model.update.on_nonfinite", "stop", *_poison_grad(POISON)]),
        "skip": (SKIP_TOTAL, ["--model.update.on_nonfinite", "skip", *_poison_reward(SKIP_LOSS, "-inf"),
                              *_poison_grad(SKIP_GRAD)]),
    }
    runs = {}
    for name, (steps, extra) in specs.items():
        root = tmp_path_factory.mktemp(f"nan_{name}")
        args = _fit_args(root, tiny_model_dir, steps, "--model.validation.at_start", "false",
                         *_ckpt_every_step(root / "ckpt"), *extra)
        runs[name] = _cli(name, args, root, env)
    wait_all(*runs.values())
    return runs


@pytest.mark.parametrize("name, what", [("stop_loss", "loss"), ("stop_grad", "gradient")])
def test_nonfinite_stop_raises_with_step_and_stats_and_writes_no_poisoned_checkpoint(nan_runs, name, what):
    run = nan_runs[name]
    assert run.rc not in (0, None), run.explain()
    text = run.stdout + run.stderr
    assert "NonFiniteError" in text, run.explain()
    assert f"non-finite {what} at step {POISON}" in text, run.explain()
    stats = re.search(r"rollout statistics: (.*?) \(update\.on_nonfinite=stop", text)
    assert stats, run.explain()
    for key in ("train/reward=", "train/kl=", "train/completion_length=", "train/loss="):
        assert key in stats.group(1), stats.group(1)
    steps = _check_checkpoint_folder(run.cwd / "ckpt")  # loads, and every weight is finite
    # checkpoints up to the state *before* the poisoned step (global_step == POISON), none after it
    assert max(steps.values()) == POISON, steps
    assert sorted({s for s in steps.values()}) == list(range(1, POISON + 1)), steps


def test_nonfinite_skip_drops_exactly_those_updates(nan_runs):
    run = nan_runs["skip"]
    run.check()
    text = run.stdout + run.stderr
    assert f"non-finite loss at step {SKIP_LOSS}" in text and f"non-finite gradient at step {SKIP_GRAD}" in text
    ckdir = run.cwd / "ckpt"
    steps = _check_checkpoint_folder(ckdir)
    by_step = {s: _load(f) for f, s in steps.items() if f.name != "last.ckpt"}
    assert sorted(by_step) == list(range(1, SKIP_TOTAL + 1))  # a skipped batch still counts as a step
    for step in range(1, SKIP_TOTAL):
        before, after = by_step[step], by_step[step + 1]
        same = all(torch.equal(before["state_dict"][k], after["state_dict"][k]) for k in before["state_dict"])
        if step in (SKIP_LOSS, SKIP_GRAD):
            assert same, f"the skipped step {step} changed the weights"
            _assert_same_tensors(_flat_tensors(before["optimizer_states"]), _flat_tensors(after["optimizer_states"]),
                                 f"optimizer state across the skipped step {step}")
        else:
            assert not same, f"step {step} (not skipped) left the weights unchanged"
    last = _load(ckdir / "last.ckpt")
    assert last["global_step"] == SKIP_TOTAL and last["rloo_skipped_steps"] == 2
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())
    scalars = read_scalars(run.cwd / "lightning_logs" / "version_0")
    assert "train/skipped_steps" in scalars, sorted(scalars)
    skipped = scalars["train/skipped_steps"]
    assert skipped[SKIP_LOSS] == 1.0 and skipped[SKIP_GRAD] == 2.0, skipped
    # a running count: never logged before the first skip, never decreasing
    assert min(skipped) == SKIP_LOSS and all(skipped[s] == (1.0 if s < SKIP_GRAD else 2.0) for s in skipped), skipped


def test_nonfinite_skip_resume_restores_the_counter_and_stays_exact(nan_runs, tiny_model_dir, _cache_dir):
    """Resume the skip run between its two skipped steps: the counter continues from 1, the
    gradient skip happens again, and the end state equals the uninterrupted run's."""
    run = nan_runs["skip"]
    run.check()
    ckdir = run.cwd / "ckpt"
    start = next(f for f in ckdir.glob("*.ckpt") if _step_of(f) == SKIP_LOSS + 2)
    root = run.cwd / "resumed"
    args = _fit_args(root, tiny_model_dir, SKIP_TOTAL, "--model.validation.at_start", "false",
                     "--model.update.on_nonfinite", "skip", *_poison_grad(SKIP_GRAD), *_ckpt_every_step(root / "ckpt"),
                     "--ckpt_path", str(start))
    resumed = _cli("resumed", args, root, make_env(_cache_dir)).wait()
    resumed.check()
    assert f"non-finite gradient at step {SKIP_GRAD}" in resumed.stdout + resumed.stderr
    end = _load(root / "ckpt" / "last.ckpt")
    ref = _load(ckdir / "last.ckpt")
    assert end["global_step"] == SKIP_TOTAL and end["rloo_skipped_steps"] == 2
    _assert_same_tensors(end["state_dict"], ref["state_dict"], "resumed skip run vs uninterrupted")
