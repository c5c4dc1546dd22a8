"""The preloaded CLI server (``tests/helpers/cli_preload.py``) the tests' CLI runs are forked from: a forked run
is a process of its own as ``python -m rloo_lightning`` is (its status, output files, working directory, session,
signals), and a run it cannot stand for is a plain subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from cli_harness import CLI, CONFIGS, Proc, make_env
from cli_preload import NO_PRELOAD_ENV, ForkedRun, Preloaded, compatible

pytestmark = pytest.mark.slow  # a server process (one import of the CLI), then forked runs


def _run(tmp_path, name: str, args: list[str], env: dict | None = None, combined: bool = False) -> Proc:
    return Proc(name, [*CLI, *args], tmp_path, env if env is not None else make_env(), combined=combined)


def test_a_forked_run_has_the_status_and_output_of_a_plain_one(tmp_path):
    ok = _run(tmp_path, "help", ["fit", "--help"]).wait()
    bad = _run(tmp_path, "bad", ["fit", "--no_such_option", "1"]).wait()
    bad_combined = _run(tmp_path, "bad_combined", ["fit", "--no_such_option", "1"], combined=True).wait()
    plain_env = make_env(**{NO_PRELOAD_ENV: "1"})
    plain = _run(tmp_path, "plain", ["fit", "--no_such_option", "1"], plain_env, combined=True).wait()
    assert all(isinstance(p.popen, ForkedRun) for p in (ok, bad, bad_combined))
    assert isinstance(plain.popen, subprocess.Popen)
    assert ok.rc == 0 and "--model.sampling.k" in ok.stdout, ok.explain()
    assert bad.rc == bad_combined.rc == plain.rc == 2, (bad.explain(), plain.explain())
    assert "no_such_option" in bad.stderr and not bad.stdout  # the one-line error, on stderr
    assert bad_combined.stdout == plain.stdout == bad.stderr and bad_combined.stderr == plain.stderr == ""


def test_a_forked_run_is_signalled_and_killed_by_its_pid_and_group(tmp_path, tiny_model_dir, _cache_dir):
    # Two fits whose reward never returns (an hour's sleep in its first call): signalled once both are inside it.
    args = ["fit", "--config", CONFIGS / "quickstart.yaml", "--model.model_name_or_path", tiny_model_dir,
            "--data.num_val_rows", "8", "--model.rewards.funcs", "[stop_helpers.reward_that_presses_ctrl_c]"]
    logs = {name: tmp_path / f"{name}.events" for name in ("term", "killed")}
    runs = {name: Proc(name, [*CLI, *map(str, args), "--trainer.default_root_dir", str(tmp_path / name)], tmp_path,
                       make_env(_cache_dir, STOP_LOG=str(log), STOP_AT_CALL="1000000", REWARD_SECONDS="3600"),
                       timeout=120)
            for name, log in logs.items()}
    for name, proc in runs.items():
        assert isinstance(proc.popen, ForkedRun)
        assert os.getsid(proc.popen.pid) == proc.popen.pid  # a session (and a process group) of its own
        while "reward" not in (logs[name].read_text() if logs[name].exists() else ""):
            assert proc.popen.poll() is None, proc.wait().explain()
            time.sleep(0.1)
    runs["term"].popen.send_signal(signal.SIGTERM)
    os.killpg(runs["killed"].popen.pid, signal.SIGKILL)
    assert runs["killed"].wait().rc == -signal.SIGKILL
    term = runs["term"].wait()
    assert term.rc == 143 and not term.timed_out, term.explain()  # the CLI's own stop, reported as it exited
    assert "stopped by SIGTERM" in term.stderr, term.explain()


def test_only_a_run_in_the_usual_environment_is_forked():
    base = make_env()
    assert compatible(base, make_env(RLOO_LIGHTNING_CACHE="/elsewhere", MASTER_PORT="29511", STOP_LOG="x") | {
        "STOP_LOG": base.get("STOP_LOG")})
    assert not compatible(base, make_env(PYTHONHASHSEED="0"))
    assert not compatible(base, make_env(OMP_NUM_THREADS="2"))
    assert not compatible(base, make_env(CUDA_VISIBLE_DEVICES=""))
    assert Preloaded.for_env(base, make_env(PYTHONHASHSEED="0")) is None
