"""SIGTERM at any point of a run: before the first step it ends at once with one line (nothing to save); during a
validation it ends at the next generated token, keeping the step just finished. Through the real CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_harness import CONFIGS, make_env, run_cli

pytestmark = pytest.mark.slow  # CLI subprocesses

REWARD = ["--model.rewards.funcs", "[stop_helpers.reward_that_signals]"]


def _args(root: Path, model_dir: str, *extra: str) -> list[str]:
    return ["fit", "--config", CONFIGS / "quickstart.yaml", "--model.model_name_or_path", model_dir,
            "--trainer.default_root_dir", root, "--trainer.enable_progress_bar", "false",
            "--data.num_train_rows", "16", "--data.batch_size", "4", *REWARD, *extra]


def _events(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_sigterm_at_validation_batch_1_of_50_before_training_ends_the_run_at_once(tmp_path, tiny_model_dir,
                                                                                 _cache_dir):
    log = tmp_path / "events"
    env = make_env(_cache_dir, STOP_LOG=str(log), STOP_AT_CALL="1")
    proc = run_cli("fit", _args(tmp_path, tiny_model_dir, "--trainer.max_steps", "4", "--data.num_val_rows", "200",
                                "--data.val_batch_size", "4", "--trainer.limit_val_batches", "50",
                                "--model.validation.at_start", "true"), tmp_path, env, check=False)
    assert proc.rc == 143, proc.explain()
    assert _events(log) == ["reward", "reward"]  # validation batches 0 and 1 scored; batch 2 never ran
    assert "stopped by SIGTERM before the first training step of this run: nothing to save" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.rglob("*.ckpt"))


def test_sigterm_while_the_run_sets_up_ends_it_with_one_line(tmp_path, tiny_model_dir, _cache_dir):
    log = tmp_path / "events"
    env = make_env(_cache_dir, STOP_LOG=str(log))
    proc = run_cli("fit", _args(tmp_path, tiny_model_dir, "--trainer.max_steps", "4", "--trainer.callbacks+="
                                "stop_helpers.SignalAt", "--trainer.callbacks.at=setup"), tmp_path, env, check=False)
    assert proc.rc == 143, proc.explain()
    assert _events(log) == ["setup"]
    assert proc.stderr.count("stopped by SIGTERM before the first training step") == 1
    assert "Traceback" not in proc.stderr


def test_sigterm_during_a_validation_after_step_2_keeps_step_2_and_runs_no_later_batch(tmp_path, tiny_model_dir,
                                                                                      _cache_dir):
    log = tmp_path / "events"
    env = make_env(_cache_dir, STOP_LOG=str(log))
    proc = run_cli("fit", _args(tmp_path, tiny_model_dir, "--trainer.max_steps", "6", "--trainer.val_check_interval",
                                "2", "--data.num_val_rows", "200", "--data.val_batch_size", "4",
                                "--trainer.limit_val_batches", "50", "--model.validation.at_start", "false",
                                "--model.rewards.funcs", "[rloo_lightning.tasks.reverse.reward]",
                                "--trainer.callbacks+=stop_helpers.SignalAt", "--trainer.callbacks.step=2",
                                "--trainer.callbacks.val_batch=1",
                                "--trainer.callbacks+=rloo_lightning.callbacks.checkpoint.FinalCheckpoint"),
                   tmp_path, env, check=False)
    assert proc.rc == 143, proc.explain()
    events = _events(log)
    assert events[-1] == "val_start 2 1" and "val_end 2 0" in events and "step 3" not in events
    (last,) = tmp_path.rglob("last.ckpt")
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 2
    assert f"stopped by SIGTERM after step 2; {last}" in proc.log


def test_under_ddp_a_sigterm_to_rank_0_during_validation_before_training_ends_every_rank(tmp_path, tiny_model_dir,
                                                                                      _cache_dir):
    log = tmp_path / "events"
    env = make_env(_cache_dir, STOP_LOG=str(log), STOP_AT_CALL="1")
    proc = run_cli("fit", _args(tmp_path, tiny_model_dir, "--trainer.max_steps", "4", "--data.num_val_rows", "200",
                                "--data.val_batch_size", "4", "--trainer.limit_val_batches", "50",
                                "--model.validation.at_start", "true", "--trainer.strategy", "ddp",
                                "--trainer.devices", "2"), tmp_path, env, check=False, timeout=240)
    assert proc.rc == 143 and not proc.timed_out, proc.explain()  # every rank ended: none waited in a collective
    assert _events(log) == ["reward", "reward"]
