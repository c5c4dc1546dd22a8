"""vLLM servers for the server engine's tests: started with ``rloo-lightning serve`` on a free localhost port, one
OpenMP thread, waited for, and killed with every process they started (vLLM's engine core is a child).

:func:`start_server` returns a :class:`Server` (the process, its address, its log); the session shares one server
(the ``vllm_server`` fixture of the test modules), the fault tests start their own to kill.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from cli_harness import Proc, make_env, start_cli

KEY = "test-key-0123"
STARTUP_S = 240  # a vLLM server builds in 20-60 s on 2 idle cores, longer beside a training run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: Proc
    port: int
    model_dir: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def wait_up(self, timeout: float = STARTUP_S) -> Server:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc.popen.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"the vLLM server did not start\n{self.proc.explain()}")
            time.sleep(0.5)
        return self

    def post(self, path: str, body: dict | None = None, timeout: float = 30):
        import json

        request = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(), method="POST",
                                         headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            raw = answer.read()
        return json.loads(raw) if raw else None

    def prompt_tokens(self) -> float:
        """The prompt tokens the server has processed since it started (vLLM's Prometheus counter)."""
        request = urllib.request.Request(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            text = answer.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:prompt_tokens_total{"))

    def kill(self) -> None:
        """SIGKILL the server and every process it started (its group)."""
        if self.proc.popen.poll() is None:
            try:
                os.killpg(self.proc.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def server_env(cwd: Path, **extra: str) -> dict:
    return make_env(cwd / "cache", VLLM_API_KEY=KEY, VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_KVCACHE_SPACE="1",
                    VLLM_LOGGING_LEVEL="WARNING", **extra)


def start_server(model_dir: str, cwd: Path, port: int | None = None, name: str = "server", wait: bool = True,
                 serve_args: tuple[str, ...] = ()) -> Server:
    port = port or free_port()
    proc = start_cli(name, ["serve", "--model", model_dir, "--port", str(port), *serve_args, "--", "--enforce-eager"],
                     cwd, server_env(cwd), timeout=3600)
    server = Server(proc, port, model_dir)
    return server.wait_up() if wait else server


try:  # the fault tests' callback, imported by path in a CLI run (tests/helpers is on its PYTHONPATH)
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - lightning is a dependency of the package
    Callback = object


class KillServerAt(Callback):
    """SIGKILL the process group ``pid`` (a server started by :func:`start_server`) at the end of training step
    ``step``, from rank 0 (the server dies between two steps: the next sync finds it gone)."""

    def __init__(self, pid: int, step: int) -> None:
        self.pid, self.step = pid, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == 0:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
