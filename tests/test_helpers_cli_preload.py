"""The preloaded CLI server (``tests/helpers/cli_preload.py``) the tests' CLI runs are forked from: a forked run
is a process of its own as ``python -m rloo_lightning`` is (its status, output files, working directory, session,
signals), and a run it cannot stand for is a plain subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from cli_harness import CLI, Proc, make_env
from cli_preload import NO_PRELOAD_ENV, ForkedRun, Preloaded, compatible

pytestmark = pytest.mark.slow  # a server process (one import of the CLI), then forked runs


def _run(tmp_path, name: str, args: list[str], env: dict | None = None) -> Proc:
    return Proc(name, [*CLI, *args], tmp_path, env if env is not None else make_env())


def test_a_forked_run_has_the_status_output_and_working_directory_of_a_plain_one(tmp_path):
    ok = _run(tmp_path, "help", ["fit", "--help"]).wait()
    bad = _run(tmp_path, "bad", ["fit", "--no_such_option", "1"]).wait()
    plain_env = make_env(**{NO_PRELOAD_ENV: "1"})
    plain = _run(tmp_path, "plain", ["fit", "--no_such_option", "1"], plain_env).wait()
    assert isinstance(ok.popen, ForkedRun) and isinstance(bad.popen, ForkedRun)
    assert isinstance(plain.popen, subprocess.Popen)
    assert ok.rc == 0 and "--model.sampling.k" in ok.stdout, ok.explain()
    assert bad.rc == plain.rc == 2 and bad.stderr == plain.stderr, (bad.explain(), plain.explain())


def test_a_forked_run_is_signalled_and_killed_by_its_pid_and_group(tmp_path):
    # a run still in its set-up a second after it started (its prompt file a FIFO nobody writes): signalled there
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    args = ["predict", "--model.model_name_or_path", "tiny:reverse", "--data.predict_file", str(fifo)]
    term, killed = _run(tmp_path, "term", args), _run(tmp_path, "killed", args)
    for proc in (term, killed):
        assert isinstance(proc.popen, ForkedRun) and proc.popen.poll() is None
        assert os.getsid(proc.popen.pid) == proc.popen.pid  # a session (and a process group) of its own
    time.sleep(1.0)
    term.popen.send_signal(signal.SIGTERM)
    os.killpg(killed.popen.pid, signal.SIGKILL)
    assert killed.wait().rc == -signal.SIGKILL
    assert term.wait().rc in (143, -signal.SIGTERM), term.explain()  # the CLI's stop, or the default action


def test_only_a_run_in_the_usual_environment_is_forked():
    base = make_env()
    assert compatible(base, make_env(RLOO_LIGHTNING_CACHE="/elsewhere", MASTER_PORT="29511", STOP_LOG="x") | {
        "STOP_LOG": base.get("STOP_LOG")})
    assert not compatible(base, make_env(PYTHONHASHSEED="0"))
    assert not compatible(base, make_env(OMP_NUM_THREADS="2"))
    assert not compatible(base, make_env(CUDA_VISIBLE_DEVICES=""))
    assert Preloaded.for_env(base, make_env(PYTHONHASHSEED="0")) is None
