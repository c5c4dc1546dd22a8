"""The one way the tests run the CLI (or a helper script) in a subprocess.

* :func:`make_env`: offline (``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1``), one OpenMP thread, the
  session's model cache, and ``tests/helpers/`` on ``PYTHONPATH`` (so
  ``--trainer.callbacks+=reliability_helpers...`` resolves in the subprocess).
* :class:`Proc`: a started subprocess, its output in files ``<cwd>/<name>.stdout`` / ``.stderr`` (never a
  pipe: a chatty run cannot block on a full pipe), in a session of its own. :meth:`Proc.wait` kills the
  whole process group at the timeout (a DDP launcher and the ranks it started: a hang fails, never blocks).
  :meth:`Proc.check` raises an ``AssertionError`` with the tail of both outputs unless the run exited 0.
* :func:`start_cli` / :func:`run_cli`: ``python -m rloo_lightning <args>`` (or the installed script,
  :func:`entry_point`); :func:`start_script`: ``python <script> <args>``. Independent runs are started
  together, then waited for (:func:`wait_all`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cli_preload import Preloaded

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
HELPERS_DIR = TESTS / "helpers"  # this folder: on sys.path in the tests (pyproject's pythonpath), PYTHONPATH in a run
CONFIGS = REPO / "configs"
CLI = [sys.executable, "-m", "rloo_lightning"]
TIMEOUT = 400  # seconds per subprocess, from its start; a healthy tiny run takes 10-40 s on 2 shared cores

__all__ = ["REPO", "TESTS", "HELPERS_DIR", "CONFIGS", "CLI", "TIMEOUT", "make_env", "Proc", "entry_point", "start_cli",
           "run_cli", "start_script", "wait_all"]


def make_env(cache: str | os.PathLike | None = None, **extra: str | None) -> dict:
    """``os.environ`` plus the offline settings; ``extra`` overrides (a value of None removes the variable)."""
    pythonpath = os.pathsep.join(p for p in [str(HELPERS_DIR), os.environ.get("PYTHONPATH", "")] if p)
    out = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
    if cache is not None:
        out["RLOO_LIGHTNING_CACHE"] = str(cache)
    for key, value in extra.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


class Proc:
    """A subprocess with its output in files; ``wait`` kills its process group at ``timeout`` (from the start).
    ``combined``: stderr into the stdout file too (``2>&1``, as a cluster's job log), the stderr file left empty."""

    def __init__(self, name: str, cmd: list[str], cwd: Path, env: dict | None = None,
                 timeout: float = TIMEOUT, combined: bool = False) -> None:
        cwd = Path(cwd)
        cwd.mkdir(parents=True, exist_ok=True)
        self.name, self.cmd, self.cwd, self.timeout, self.timed_out = name, cmd, cwd, timeout, False
        self._out = open(cwd / f"{name}.stdout", "w")
        self._err = open(cwd / f"{name}.stderr", "w")
        self.start = time.monotonic()
        env = env if env is not None else make_env()
        server = Preloaded.for_env(make_env(), env) if cmd[:len(CLI)] == CLI else None
        if server is not None:  # the same run, forked from a process that has imported the CLI already
            self.popen = server.start(cmd[len(CLI):], cwd, env, self._out.name,
                                      self._out.name if combined else self._err.name)
        else:
            self.popen = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self._out,
                                          stderr=subprocess.STDOUT if combined else self._err, start_new_session=True)

    def wait(self) -> "Proc":
        if self._out.closed:
            return self
        try:
            self.popen.wait(timeout=max(1.0, self.timeout - (time.monotonic() - self.start)))
        except subprocess.TimeoutExpired:
            self.timed_out = True
            os.killpg(self.popen.pid, signal.SIGKILL)  # the process and every process it started
            self.popen.wait()
        self._out.close()
        self._err.close()
        return self

    def sigkill(self) -> "Proc":
        """SIGKILL this process (by its own pid, not its group) and reap it."""
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
        return self.wait()

    @property
    def rc(self) -> int | None:
        return self.popen.returncode

    @property
    def stdout(self) -> str:
        return (self.cwd / f"{self.name}.stdout").read_text()

    @property
    def stderr(self) -> str:
        return (self.cwd / f"{self.name}.stderr").read_text()

    @property
    def log(self) -> str:
        return self.stdout + self.stderr

    def explain(self) -> str:
        return (f"[{self.name}] rc={self.rc} timed_out={self.timed_out}\n$ {' '.join(map(str, self.cmd))}\n"
                f"--- stdout (tail) ---\n{self.stdout[-3000:]}\n--- stderr (tail) ---\n{self.stderr[-6000:]}")

    def check(self) -> "Proc":
        """Wait, then raise an ``AssertionError`` with the output's tail unless the run exited 0 in time."""
        self.wait()
        if self.rc != 0 or self.timed_out:
            raise AssertionError(f"subprocess failed\n{self.explain()}")
        return self


def entry_point() -> list[str]:
    """The installed ``rloo-lightning`` script, as a user runs it (unlike ``python -m``, it does not put the
    working directory on ``sys.path``); ``python -m rloo_lightning`` where no script is installed."""
    exe = Path(sys.executable).parent / "rloo-lightning"
    return [str(exe)] if exe.exists() else CLI


def start_cli(name: str, args: list[str], cwd: Path, env: dict | None = None, timeout: float = TIMEOUT,
              command: list[str] = CLI) -> Proc:
    """Start ``python -m rloo_lightning <args>`` (or ``command``, e.g. :func:`entry_point`) in ``cwd``."""
    return Proc(name, [*command, *map(str, args)], cwd, env, timeout)


def run_cli(name: str, args: list[str], cwd: Path, env: dict | None = None, timeout: float = TIMEOUT,
            check: bool = True) -> Proc:
    """Run the CLI to the end; with ``check``, a failure raises with the output's tail."""
    proc = start_cli(name, args, cwd, env, timeout).wait()
    return proc.check() if check else proc


def start_script(name: str, script: str | Path, args: list[str], cwd: Path, env: dict | None = None,
                 timeout: float = TIMEOUT) -> Proc:
    """Start ``python <script> <args>`` in ``cwd``."""
    return Proc(name, [sys.executable, str(script), *map(str, args)], cwd, env, timeout)


def wait_all(*procs: Proc) -> None:
    for p in procs:
        p.wait()
