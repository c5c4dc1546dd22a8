"""A process that has imported the CLI's dependencies once and forks one child per CLI run.

Most of a tiny CLI run's start is importing torch, lightning and transformers (about 4 s on this machine's 2
cores, more than many of the runs themselves). :class:`Preloaded` starts this module as a server
(``python -c "import cli_preload; cli_preload.serve()"``); the server imports what ``python -m rloo_lightning``
imports before it parses its arguments, and nothing else, and then only forks: each child becomes
``python -m rloo_lightning <args>`` as the interpreter runs it (``runpy._run_module_as_main``), in its own
session, working directory, environment and output files, so a test signals, kills and waits for it as for any
process. The server reports each child's exit status (``os.waitstatus_to_exitcode``: negative for a signal).

What a child shares with its siblings, where a fresh interpreter would differ, and why it does not matter here:

* modules imported before the fork, with the state importing left them in (a fresh run imports the same ones
  the same way). The server refuses to fork with a second thread alive (a lock held across a fork).
* the environment at import: a run whose environment differs from the server's in a variable the dependencies
  may read while they are imported (anything but ``RLOO_*`` and the rendezvous variables) is not sent here;
  :func:`cli_harness.start_cli` starts it as a plain subprocess (see :func:`compatible`).
* ``str`` hashes (one ``PYTHONHASHSEED`` for all children). ``random`` reseeds itself after a fork, and numpy's
  global generator is reseeded from the OS here, as a fresh interpreter would seed it.

``RLOO_TESTS_NO_PRELOAD=1`` runs every CLI run as a plain subprocess (to compare, or to rule this out).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

NO_PRELOAD_ENV = "RLOO_TESTS_NO_PRELOAD"
# What may differ between the server's environment and a run's, besides RLOO_*: variables read at run time, never
# while importing: the rendezvous, pytest's test name, the API key the server engine sends, and the switches of the
# tests' own callbacks, rewards and engines (stop_helpers.py).
RUN_TIME_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "LOCAL_RANK", "RANK",
                      "PYTEST_CURRENT_TEST", "VLLM_API_KEY", "STOP_LOG", "STOP_AT_CALL", "STOP_RANK", "STOP_SIGNAL",
                      "FAIL_AT_CALL", "FAIL_RANK", "CTRL_C_TWICE", "REWARD_SECONDS")


def compatible(base: dict, env: dict) -> bool:
    """Whether a run with environment ``env`` may be forked from a server started with ``base``."""
    keys = set(base) | set(env)
    return all(base.get(k) == env.get(k) for k in keys if not k.startswith("RLOO_") and k not in RUN_TIME_VARIABLES)


# -- the server ----------------------------------------------------------------------------------------------------
# `python -m rloo_lightning` imports the first before it parses its arguments; a tiny fit then imports the others
# (about 1 s more: `python -X importtime`), except pandas, which starts a thread on import
PRELOAD = ("rloo_lightning.cli", "transformers.modeling_layers", "transformers.masking_utils",
           "torch.utils.tensorboard")


def serve() -> None:
    """Import, then fork a child for each request line on stdin; answer on stdout, one JSON line each:
    ``{"id": ..., "pid": ...}`` once forked, ``{"pid": ..., "rc": ...}`` when that child ends."""
    replies = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing an import prints can mix with the replies
    for name in PRELOAD:
        importlib.import_module(name)

    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        raise RuntimeError(f"importing the CLI started threads ({os.listdir('/proc/self/task')}): forking is unsafe")
    requests = os.fdopen(0, "rb", buffering=0)
    pending = b""
    live = 0
    while True:
        ready, _, _ = select.select([requests], [], [], 0.02 if live else 1.0)
        while live:  # report every child that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            live -= 1
            os.write(replies, (json.dumps({"pid": pid, "rc": os.waitstatus_to_exitcode(status)}) + "\n").encode())
        if not ready:
            continue
        chunk = os.read(0, 65536)
        if not chunk:  # the test process is gone: its children are its business, not the server's
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            ready_r, ready_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(replies)
                os.close(ready_r)
                os.setsid()  # a session of its own, as cli_harness.Proc starts its processes ...
                os.close(ready_w)  # ... before its pid is answered: a signal to its group finds the group
                _become(request)  # returns only into the module's code: never reaches the loop again
                return
            os.close(ready_w)
            os.read(ready_r, 1)  # EOF once the child has its session (or has died)
            os.close(ready_r)
            live += 1
            os.write(replies, (json.dumps({"id": request["id"], "pid": pid}) + "\n").encode())


def _become(request: dict) -> None:
    """In the forked child: become ``python -m rloo_lightning <args>`` run in ``cwd`` with ``env``."""
    import runpy

    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    if request["stderr"] == request["stdout"]:  # 2>&1: one open file for both, so neither overwrites the other
        os.dup2(out, 2)
    else:
        os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = os.getcwd()  # `python -m` puts the working directory first
    if "numpy" in sys.modules:  # a fresh interpreter seeds numpy's global generator from the OS
        sys.modules["numpy"].random.seed(int.from_bytes(os.urandom(4), "little"))
    sys.argv = ["-m", *request["args"]]
    # Exceptions leave through the interpreter as in `python -m`: SystemExit's code, a traceback and 1, or the
    # re-raised SIGINT of an uncaught KeyboardInterrupt; atexit handlers and non-daemon threads as usual.
    runpy._run_module_as_main("rloo_lightning")
    sys.exit(0)


# -- the client, in the test process -------------------------------------------------------------------------------
class ForkedRun:
    """A child of the server, as much of ``subprocess.Popen`` as the tests use."""

    def __init__(self, server: "Preloaded", pid: int, args: list[str]) -> None:
        self._server, self.pid, self.args, self.returncode = server, pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Preloaded:
    """The server, started on first use with the tests' usual environment (``base``); one per test process."""

    _server: "Preloaded | None" = None
    _lock = threading.Lock()

    @classmethod
    def for_env(cls, base: dict, env: dict) -> "Preloaded | None":
        """The server a run with ``env`` may be forked from, or None: preloading is off, or ``env`` differs from
        ``base`` where it matters (that run is a plain subprocess)."""
        if os.environ.get(NO_PRELOAD_ENV) or env.get(NO_PRELOAD_ENV) or not compatible(base, env):
            return None
        with cls._lock:
            if cls._server is None or not cls._server.alive():
                cls._server = cls(base)
            return cls._server

    def __init__(self, env: dict) -> None:
        self.env = dict(env)
        self._exits: dict[int, int] = {}
        self._forked: dict[int, int] = {}
        self._next = 0
        self._cond = threading.Condition()
        self._send = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, "-c", "import cli_preload; cli_preload.serve()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env, bufsize=0)
        threading.Thread(target=self._read, daemon=True, name="cli-preload-reader").start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> None:
        for line in self.proc.stdout:
            reply = json.loads(line)
            with self._cond:
                if "id" in reply:
                    self._forked[reply["id"]] = reply["pid"]
                else:
                    self._exits[reply["pid"]] = reply["rc"]
                self._cond.notify_all()
        with self._cond:  # the server ended: nothing more will come
            self._cond.notify_all()

    def start(self, args: list[str], cwd, env: dict, stdout, stderr) -> ForkedRun:
        """Fork ``python -m rloo_lightning <args>``; its output goes to the files ``stdout`` and ``stderr``."""
        with self._send:
            self._next += 1
            request = {"id": self._next, "args": list(args), "cwd": str(cwd), "env": dict(env),
                       "stdout": str(stdout), "stderr": str(stderr)}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
        with self._cond:
            if not self._cond.wait_for(lambda: request["id"] in self._forked or not self.alive(), timeout=120):
                raise RuntimeError("the preloaded CLI server did not fork within 120 s")
            if request["id"] not in self._forked:
                raise RuntimeError(f"the preloaded CLI server ended (exit {self.proc.poll()}) before forking")
            return ForkedRun(self, self._forked.pop(request["id"]), [*args])

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit code once it ended, or None if it is still running after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while pid not in self._exits:
                if not self.alive():
                    raise RuntimeError(f"the preloaded CLI server ended (exit {self.proc.poll()}) while its run "
                                       f"{pid} was running")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left if left is None else min(left, 1.0))
            return self._exits[pid]
