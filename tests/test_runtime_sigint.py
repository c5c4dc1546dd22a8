"""Ctrl-C (SIGINT to the whole process group, as a terminal sends it) stops a run as SIGTERM does: ``last.ckpt`` of the
last finished step, one line naming it, status 130; a second Ctrl-C ends the run at once; reward workers ignore it.
Through the real CLI."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from cli_harness import Proc, make_env, run_cli, start_cli, wait_all
from checkpoint_helpers import _assert_same_checkpoint
from test_runtime_sigterm import ENGINE_AT, _args, _assert_same, _events

pytestmark = pytest.mark.slow  # CLI subprocesses

COMMON = ["--trainer.limit_val_batches", "0", "--model.validation.at_start", "false", "--data.num_val_rows", "8",
          "--model.rewards.funcs", "[rloo_lightning.tasks.reverse.reward]", "--trainer.max_steps", "200"]
CTRL_C = ["--model.rewards.funcs", "[stop_helpers.reward_that_presses_ctrl_c]"]


def _no_interrupt_wall(proc: Proc) -> None:
    """Neither Lightning's KeyboardInterrupt path nor a traceback."""
    assert "KeyboardInterrupt" not in proc.log and "Traceback" not in proc.stderr, proc.explain()


def _last(root: Path) -> Path:
    return root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"


def test_ctrl_c_inside_step_2_keeps_step_1_as_sigterm_does_exits_130_and_resumes_exactly(tmp_path, tiny_model_dir,
                                                                                        _cache_dir):
    """Run c gets Ctrl-C inside step 2's generation, run b SIGTERM at step 1's end: the same last.ckpt; c resumed to
    step 4 ends where the uninterrupted run a does."""
    env = make_env(_cache_dir, STOP_LOG=str(tmp_path / "events"))
    common = [*COMMON, "--trainer.max_steps", "4"]
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    procs = [start_cli("a", _args(a, tiny_model_dir, *common), a, env),
             start_cli("b", _args(b, tiny_model_dir, *common, "--trainer.callbacks+=reliability_helpers.callbacks"
                                  ".SigtermAt", "--trainer.callbacks.step=1"), b, env),
             start_cli("c", _args(c, tiny_model_dir, *common, *ENGINE_AT, "1", "--model.generation_engine.sig",
                                  "SIGINT"), c, env)]
    wait_all(*procs)
    procs[0].check()
    assert procs[1].rc == 143, procs[1].explain()
    stopped = procs[2]
    assert stopped.rc == 130 and not stopped.timed_out, stopped.explain()
    _no_interrupt_wall(stopped)
    last = _last(c)
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 1
    _assert_same(last, _last(b))
    assert f"stopped by SIGINT after step 1; {last} holds that step: resume with --ckpt_path {last}" in stopped.log
    # the checkpoint stores c's engine, which a resume rebuilds: told never to signal
    start_cli("c2", _args(c, tiny_model_dir, *common, *ENGINE_AT, "-1", "--ckpt_path", last), c, env).check()
    _assert_same_checkpoint(c / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt", _last(a))


def test_ctrl_c_before_the_first_step_says_nothing_was_saved_and_exits_130(tmp_path, tiny_model_dir, _cache_dir):
    env = make_env(_cache_dir, STOP_LOG=str(tmp_path / "events"))
    proc = run_cli("fit", _args(tmp_path, tiny_model_dir, *COMMON, "--trainer.callbacks+=stop_helpers.SignalAt",
                                "--trainer.callbacks.at=setup", "--trainer.callbacks.sig=SIGINT"),
                   tmp_path, env, check=False)
    assert proc.rc == 130, proc.explain()
    assert _events(tmp_path / "events") == ["setup"]
    assert proc.stderr.count("stopped by SIGINT before the first training step of this run: nothing to save") == 1
    _no_interrupt_wall(proc)
    assert not list(tmp_path.rglob("*.ckpt"))


def test_a_second_ctrl_c_ends_the_run_at_once(tmp_path, tiny_model_dir, _cache_dir):
    """The reward presses Ctrl-C in step 2, again a second later, then hangs: only the second one ends the run."""
    log = tmp_path / "events"
    env = make_env(_cache_dir, STOP_LOG=str(log), STOP_AT_CALL="1", CTRL_C_TWICE="1")
    proc = start_cli("fit", _args(tmp_path, tiny_model_dir, *COMMON, *CTRL_C), tmp_path, env, timeout=150)
    while proc.popen.poll() is None and "ctrl-c\nctrl-c" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.05)
    second = time.monotonic()
    proc.wait()
    assert proc.rc == 130 and not proc.timed_out, proc.explain()
    assert time.monotonic() - second < 10, proc.explain()  # at once: the reward was left hanging
    assert _events(log) == ["reward", "reward", "ctrl-c", "ctrl-c"]
    assert proc.stderr.count("stopped at once by a second SIGINT (Ctrl-C)") == 1, proc.explain()
    _no_interrupt_wall(proc)


def test_reward_workers_ignore_a_ctrl_c_sent_to_the_process_group_during_a_step(tmp_path, tiny_model_dir,
                                                                                _cache_dir):
    """Two reward workers; one of them presses Ctrl-C during step 2's rewards (2 calls a step): the step's rewards
    all come back (a worker that died fails the run under rewards.on_error raise), and the run stops at its end."""
    env = make_env(_cache_dir, STOP_LOG=str(tmp_path / "events"), STOP_AT_CALL="2")
    proc = run_cli("fit", _args(tmp_path, tiny_model_dir, *COMMON, *CTRL_C, "--model.rewards.workers", "2"),
                   tmp_path, env, check=False)
    assert proc.rc == 130, proc.explain()
    _no_interrupt_wall(proc)
    assert _events(tmp_path / "events").count("ctrl-c") == 1
    last = _last(tmp_path)
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 2
    assert f"stopped by SIGINT after step 2; {last}" in proc.log


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_worker_pool_survives_ctrl_c_while_its_workers_start_and_while_they_work(tmp_path, start_method):
    env = make_env(STOP_LOG=str(tmp_path / "events"), STOP_AT_CALL="0")
    proc = Proc("pool", [sys.executable, "-m", "stop_helpers", start_method], tmp_path, env, timeout=120).check()
    assert "outcomes ['ok', 'ok', 'ok', 'ok'] same_workers True signals 2" in proc.stdout, proc.explain()


def test_under_ddp_ctrl_c_to_every_rank_inside_step_2_ends_every_rank_keeping_step_1(tmp_path, tiny_model_dir,
                                                                                    _cache_dir):
    """The terminal signals every rank, and rank 0 passes a stop on to the rank it launched: no rank may take that
    for a second Ctrl-C (it would end alone and leave the other waiting in a collective)."""
    env = make_env(_cache_dir, STOP_LOG=str(tmp_path / "events"))
    proc = run_cli("fit", _args(tmp_path, tiny_model_dir, *COMMON, *ENGINE_AT, "1", "--model.generation_engine.sig",
                                "SIGINT", "--trainer.strategy", "ddp", "--trainer.devices", "2"),
                   tmp_path, env, check=False, timeout=240)
    assert proc.rc == 130 and not proc.timed_out, proc.explain()  # every rank ended: none waited in a collective
    _no_interrupt_wall(proc)
    last = _last(tmp_path)
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 1
    assert f"stopped by SIGINT after step 1; {last}" in proc.log
