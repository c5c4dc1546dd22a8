"""A stand-in for a vLLM server (``rloo-lightning serve``), from the standard library, for the server engine's tests
without vLLM.

It speaks the part of vLLM's HTTP API that :class:`~rloo_lightning.engines.vllm_server.VLLMServerEngine` uses, as
vLLM 0.32 with ``rloo-lightning serve``'s worker extension and key guard answers it:

* ``GET /health`` (no key; 200, or 503 for a dead engine), ``GET /version``, ``GET /v1/models``;
* ``GET /metrics``: vLLM's progress series (the Prometheus text of ``vllm:generation_tokens_total``,
  ``vllm:prompt_tokens_total``, ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries_total``, with vLLM's labels), counted as it works: a
  request held without an answer moves none of them, as a hung engine's;
* ``POST /collective_rpc`` with the worker extension's methods ``rloo_describe``, ``rloo_state`` and
  ``rloo_load`` (the safetensors files of a sync folder, loaded into the model in place and counted);
* ``POST /pause?mode=wait|keep|abort``, ``POST /resume``, ``GET /is_paused``, ``POST /reset_prefix_cache``,
  ``POST /abort_requests``;
* ``POST /v1/completions``: token ids in, token ids out (``return_token_ids``), one seed per request, the processed
  log-probs of the sampled tokens (after temperature, top-k and top-p: what it sampled from), ``prompt_logprobs``
  (the canary), ``stop_token_ids``, ``ignore_eos``, ``max_tokens`` within the model's context;
* with ``lora_rank`` set (``rloo-lightning serve --lora-rank``: LoRA on, runtime adapter loading on),
  ``POST /v1/load_lora_adapter`` (a PEFT folder, merged into a copy of the base for its completions; a name loaded
  already: 400; a rank over ``lora_rank``: 500) and ``POST /v1/unload_lora_adapter``, a completion's ``model``
  naming an adapter, ``/v1/models`` listing the adapters, and ``rloo_describe``'s ``max_lora_rank``; as vLLM's, a
  restart forgets every adapter, and a base load (``rloo_load``) keeps their names and loads an adapter from its
  folder again at its next completion: a folder gone by then kills the engine (500, ``/health`` 503);
* every path but ``GET /health`` behind ``Authorization: Bearer <key>`` (401 otherwise).

It is honest: it holds a real transformers causal LM built from the model folder's config (dummy weights, seeded by
the boot, as a server that has not been synced holds other weights than the policy's; or the folder's own weights,
``load_format="auto"``), loads the synced files into it, and computes the log-probs and the seeded samples with it.
A sample depends on the weights, the prompt, the sampling fields and the seed only (not on the batch, the thread or
an earlier attempt), so a retry gives the sample the first attempt would have, and the canary passes after a correct
sync and fails after a wrong one.

Faults, each switched on by the test (:meth:`StandinVLLM.fail_next` for the next N matching requests, the rest as
methods or attributes): an HTTP 500, a connection dropped before or after the work, a request held without an answer
(an abort, :meth:`release`, or its client going away ends it, as vLLM aborts a request whose client disconnected), a
restart (another boot, dummy weights again, every connection in flight dropped), a kill (:meth:`kill`: the
connections dropped, the listener closed, until :meth:`come_back`), a slow server (``token_delay``: a long generation
that progresses), log-probs off on the canary, a key refused, a server that stops answering (:meth:`freeze`:
connections accepted, never answered, ``/health`` included, or answering 200 as a hung engine's does), a load that
takes nothing or ignores the files, and a drain as vLLM does on SIGTERM (:meth:`drain`: generation aborted, the
connections in flight kept open without an answer, ``/health`` refused as the listener closes, or 503 with it open).

Every request but the liveness looks (``GET /health``, ``GET /metrics``: counted in :attr:`StandinVLLM.probes`) is
written to :attr:`StandinVLLM.log` in the order received (its path, kind, seed, request id, and its outcome once
known: the HTTP status, "dropped", "silent", "client-gone", ...; ``held`` when a fault held it), and
:meth:`StandinVLLM.wait_for` blocks until a condition on it holds: tests sequence faults on events, not sleeps.

Run as a script (``python standin_vllm_server.py --model DIR --port N --key K``) it serves in a process of its own
and drains on SIGTERM as vLLM does, printing one line per event (``ready <port>``, ``held <kind> <seed>``,
``draining``); ``POST /standin/control`` (behind the key) switches its faults there.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VLLM_VERSION = "0.32.0"
#: What the stand-in's methods may be called with through ``/standin/control`` (the script mode).
CONTROL = ("fail_next", "restart", "freeze", "thaw", "drain", "release", "refuse_key", "set", "kill", "come_back")


#: What vLLM 0.32 answers every request once its engine core has died.
ENGINE_DEAD = {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                         "type": "InternalServerError", "code": 500}}


@dataclass
class Fault:
    """The next ``count`` requests of kind ``on`` (see :meth:`StandinVLLM.kind`; "any" matches all) fail ``how``:
    "500" (an HTTP 500), "drop" (the connection closed before any work), "drop_after" (the work done, e.g. a sample
    drawn, then the connection closed without an answer), "hold" (no answer until an abort, :meth:`release`, a
    restart or the end), "restart" (the server restarts with this request in flight)."""

    on: str
    how: str
    count: int


@dataclass
class _InFlight:
    """A request being served: what another thread may decide for it (``fate``) and when (``decided``)."""

    kind: str
    request_id: str | None
    seed: int | None
    held: bool = False
    why: str = ""  # what holds it: "fault", "paused", "frozen", "draining"
    fate: str | None = None  # None: go on; "release", "abort", "drop", "silent"
    decided: threading.Event = field(default_factory=threading.Event)
    entry: dict = field(default_factory=dict)  # its line of the log
    conn: socket.socket | None = None  # its connection (a client that closes it is seen while the request is held)

    def decide(self, fate: str) -> None:
        if self.fate is None or fate in ("drop", "silent"):
            self.fate = fate
        self.decided.set()


class _Drop(Exception):
    """Close this connection without an answer."""


class _Silent(Exception):
    """Keep this connection open without an answer until the stand-in closes."""


class _Handler(BaseHTTPRequestHandler):
    server_version = "standin-vllm"

    def log_message(self, format, *args):  # noqa: A002 - quiet, the stand-in keeps a log of its own
        pass

    def do_GET(self):  # noqa: N802
        self.server.standin._serve(self, "GET")

    def do_POST(self):  # noqa: N802
        self.server.standin._serve(self, "POST")

    def reply(self, status: int, payload) -> None:
        text = isinstance(payload, str)  # /metrics: Prometheus text
        raw = b"" if payload is None else payload.encode() if text else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; version=0.0.4" if text else "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def drop(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class _Listener(ThreadingHTTPServer):
    daemon_threads = True  # a held request's thread never keeps the test process
    allow_reuse_address = True


class StandinVLLM:
    """One stand-in server on ``127.0.0.1`` (a free port unless ``port``), serving the model folder ``model_dir``
    as ``served_name`` (default: the folder, as ``vllm serve --model <folder>`` names it) behind ``key``.

    ``load_format``: "dummy" (default: random weights, seeded by the boot, as a server not yet synced holds other
    weights than the policy's) or "auto" (the folder's weights). Use it as a context manager or call :meth:`close`.
    """

    def __init__(self, model_dir: str, key: str, port: int = 0, served_name: str | None = None,
                 load_format: str = "dummy", dev_mode: bool = True, vllm_version: str = VLLM_VERSION,
                 announce=None, lora_rank: int | None = None) -> None:
        import torch
        from transformers import AutoConfig

        self.model_dir, self.key = str(model_dir), key
        self.served_name = served_name or self.model_dir
        self.load_format, self.dev_mode, self.vllm_version = load_format, dev_mode, vllm_version
        self.config = AutoConfig.from_pretrained(self.model_dir)
        self.max_model_len = int(getattr(self.config, "max_position_embeddings", 0) or 2048)
        self.announce = announce or (lambda line: None)  # the script mode prints the events that tests wait on
        self._torch = torch
        self._cond = threading.Condition()
        self._model_lock = threading.RLock()
        self._closing = threading.Event()
        self._faults: list[Fault] = []
        self._inflight: list[_InFlight] = []
        self.log: list[dict] = []
        self.probes: dict[str, int] = {}  # GET /health and /metrics answered or held (not in the log)
        self.boots = 0
        #: Added to every canary log-prob (a server whose log-probs disagree with the policy's); 0: honest.
        self.canary_offset = 0.0
        #: "ok"; "nothing": a load consumes no tensor (vLLM's NCCL update without CUDA); "ignore": it counts the
        #: tensors but keeps the old weights (a load that "succeeds" and changes nothing).
        self.load_mode = "ok"
        self.lora_rank = lora_rank  # None: LoRA off (no adapter routes, as vLLM without --enable-lora)
        #: "ok"; "ignore": an adapter load answers success and keeps nothing (completions under its name use the base)
        self.adapter_mode = "ok"
        #: vLLM's two halves: the API server's registry (name -> folder: what /v1/models lists) and the engine's cache
        #: (name -> the base with the adapter merged in). A base load empties the cache and keeps the registry; a
        #: completion under a name not cached loads it from its folder again, and a folder gone then kills the
        #: engine (every later request 500, /health 503), as vLLM 0.32's EngineCore does.
        self.adapters: dict[str, str] = {}
        self._merged: dict = {}
        self.engine_dead = False
        self.frozen: str | None = None  # None, or what /health does while frozen: "silent" or "200"
        self.draining: str | None = None  # None, "refused" or "503"
        self.paused: str | None = None  # None or the mode of the last /pause
        #: Seconds each sampled token takes (a slow server: a long generation that progresses).
        self.token_delay = 0.0
        #: vLLM's progress counters on /metrics (see the module docstring); per boot, as vLLM's.
        self.counters = dict.fromkeys(("generation_tokens_total", "prompt_tokens_total",
                                       "prefix_cache_queries_total"), 0.0)
        self._boot()
        self._listener: _Listener | None = None
        self.port = port
        self.listen()

    # -- life ---------------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def listen(self) -> None:
        """Accept connections (on the same port as before, after :meth:`stop_listening`)."""
        listener = _Listener(("127.0.0.1", self.port), _Handler)
        listener.standin = self
        self.port = listener.server_address[1]
        self._listener = listener
        threading.Thread(target=listener.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                         name=f"standin-vllm-{self.port}").start()

    def stop_listening(self) -> None:
        """Close the listening socket: new connections are refused (those in flight go on)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.shutdown()
            listener.server_close()

    def close(self) -> None:
        """Stop listening and end every request still held (their connections dropped)."""
        self._closing.set()
        with self._cond:
            for flight in self._inflight:
                flight.decide("drop")
            self._cond.notify_all()
        self.stop_listening()

    def __enter__(self) -> StandinVLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _boot(self) -> None:
        from transformers import AutoModelForCausalLM

        torch = self._torch
        self.boots += 1
        self.boot = uuid.uuid4().hex[:12]
        self.version = ""
        self.counters = dict.fromkeys(("generation_tokens_total", "prompt_tokens_total",
                                       "prefix_cache_queries_total"), 0.0)
        if self.load_format == "auto":
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(1000 + self.boots)
                model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        self.model = model.eval()
        self.adapters, self._merged, self.engine_dead = {}, {}, False

    def restart(self) -> None:
        """A new boot: the loaded weights lost (dummy weights again, version ""), not paused, every request in flight
        dropped. The listener stays (a restart on the same port, already up: the engine finds the new boot)."""
        with self._cond:
            for flight in self._inflight:
                flight.decide("drop")
            self._cond.notify_all()
        with self._model_lock:
            self._boot()
            self.paused = None
        self._record("restart", "restart", outcome=self.boot)

    def kill(self) -> None:
        """As SIGKILL: every connection in flight dropped, the listener closed (new connections refused), until
        :meth:`come_back`."""
        self.stop_listening()
        with self._cond:
            for flight in self._inflight:
                flight.decide("drop")
            self._cond.notify_all()
        self._record("kill", "kill")

    def come_back(self) -> None:
        """A new process on the same port (a supervisor's restart after :meth:`kill`, a drain, a freeze): another
        boot, dummy weights, listening, neither frozen nor draining; whatever the old one held is dropped."""
        with self._cond:
            self.frozen = self.draining = None
            for flight in self._inflight:
                flight.decide("drop")
            self._cond.notify_all()
        self.restart()
        if self._listener is None:
            self.listen()

    def freeze(self, health: str = "silent") -> None:
        """Stop answering: every request is accepted and never answered until :meth:`thaw` (then served) or
        :meth:`close`. ``health="silent"``: ``/health`` too (a SIGSTOPped server); ``"200"``: ``/health`` still
        answers 200 (a hung engine behind a live API server)."""
        if health not in ("silent", "200"):
            raise ValueError(f"freeze health must be 'silent' or '200', got {health!r}")
        self.frozen = health

    def thaw(self) -> None:
        with self._cond:
            self.frozen = None
            for flight in self._inflight:
                if flight.held and flight.fate is None and flight.why == "frozen":
                    flight.decide("release")
            self._cond.notify_all()

    def drain(self, health: str = "refused") -> None:
        """As vLLM on SIGTERM (uvicorn's graceful shutdown with vLLM's engine core gone): the generation in flight is
        aborted, its connections are kept open without an answer; ``health="refused"``: the listener closes (every
        new connection refused); ``"503"``: it stays open, ``/health`` answers 503 and every other request is held
        without an answer."""
        if health not in ("refused", "503"):
            raise ValueError(f"drain health must be 'refused' or '503', got {health!r}")
        with self._cond:
            self.draining = health
            for flight in self._inflight:
                flight.decide("silent")
            self._cond.notify_all()
        self._record("drain", "drain", outcome=health)
        self.announce("draining")
        if health == "refused":
            self.stop_listening()

    def refuse_key(self) -> None:
        """The server now has another key: every request but ``/health`` gets 401."""
        self.key = "another-" + uuid.uuid4().hex

    def release(self) -> None:
        """Serve every request a fault holds (as if the server had only been slow)."""
        with self._cond:
            for flight in self._inflight:
                if flight.held and flight.why == "fault":
                    flight.decide("release")
            self._cond.notify_all()

    def set(self, **values) -> None:
        """Set attributes (``canary_offset``, ``load_mode``, ``key``, ``token_delay``) in the script mode."""
        for name, value in values.items():
            if name not in ("canary_offset", "load_mode", "key", "token_delay", "adapter_mode"):
                raise ValueError(f"cannot set {name}")
            setattr(self, name, value)

    def fail_next(self, count: int, how: str = "500", on: str = "any") -> None:
        """The next ``count`` requests of kind ``on`` fail ``how`` (see :class:`Fault`)."""
        if how not in ("500", "drop", "drop_after", "hold", "restart"):
            raise ValueError(f"unknown fault {how!r}")
        with self._cond:
            self._faults.append(Fault(on, how, count))

    # -- what happened ------------------------------------------------------------------------------------------
    def _record(self, path: str, kind: str, **fields) -> dict:
        entry = {"path": path, "kind": kind, "boot": self.boot, "t": time.monotonic(), **fields}
        with self._cond:
            self.log.append(entry)
            self._cond.notify_all()
        return entry

    def _finish(self, entry: dict, outcome: str) -> None:
        with self._cond:
            entry["outcome"] = outcome
            self._cond.notify_all()

    def wait_for(self, condition, timeout: float = 15.0):
        """Block until ``condition(self)`` is true (checked at every logged event); AssertionError after
        ``timeout``."""
        with self._cond:
            if not self._cond.wait_for(lambda: condition(self), timeout=timeout):
                raise AssertionError(f"the stand-in server never reached the awaited state; its log: {self.log[-8:]}")
            return condition(self)

    def held(self, kind: str | None = None) -> list[_InFlight]:
        """The requests held without an answer now (of ``kind``)."""
        with self._cond:
            return [f for f in self._inflight if f.held and f.fate is None and kind in (None, f.kind)]

    def entries(self, kind: str | None = None, outcome: str | None = None) -> list[dict]:
        with self._cond:
            return [e for e in self.log if kind in (None, e["kind"]) and outcome in (None, e.get("outcome"))]

    def state_dict(self) -> dict:
        with self._model_lock:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @staticmethod
    def kind(method: str, path: str, body: dict | None) -> str:
        """A request's kind, for faults and the log: "row" (a completion), "canary" (a completion with
        ``prompt_logprobs``, or an adapter sync's, whose request id says so), "rpc:<method>" (``/collective_rpc``),
        else the path ("/health", "/pause", ...)."""
        if path == "/v1/completions":
            body = body or {}
            canary = body.get("prompt_logprobs") is not None or str(body.get("request_id")).startswith("rloo-canary")
            return "canary" if canary else "row"
        if path == "/collective_rpc":
            return f"rpc:{(body or {}).get('method')}"
        return path

    # -- serving ------------------------------------------------------------------------------------------------
    def _serve(self, handler: _Handler, method: str) -> None:
        path, _, query = handler.path.partition("?")
        params = dict(p.partition("=")[::2] for p in query.split("&") if p)
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        kind = self.kind(method, path, body)
        seed = body.get("seed") if isinstance(body, dict) else None
        request_id = body.get("request_id") if isinstance(body, dict) else None
        flight = _InFlight(kind, request_id, seed, conn=handler.connection)
        if method == "GET" and path in ("/health", "/metrics"):  # the trainer's liveness looks: counted, not logged
            with self._cond:
                self.probes[path] = self.probes.get(path, 0) + 1
            entry = {"path": path, "kind": kind}
        else:
            entry = self._record(path, kind, seed=seed, request_id=request_id, outcome=None)  # in the order received
        if path == "/abort_requests" and isinstance(body, dict):
            entry["request_ids"] = sorted(body.get("request_ids") or [])
        flight.entry = entry
        with self._cond:
            self._inflight.append(flight)
        try:
            status, payload = self._answer(handler, method, path, params, body, kind, flight)
            if flight.fate in ("drop", "silent"):  # decided while it worked (a restart, a drain)
                raise _Drop() if flight.fate == "drop" else _Silent()
            self._finish(entry, str(status))  # before the answer: a client that has it finds it in the log
            handler.reply(status, payload)
        except _Drop:
            handler.drop()
            self._finish(entry, "client-gone" if entry.get("gone") else "dropped")
        except _Silent:
            self._finish(entry, "silent")
            self._closing.wait()
            handler.drop()
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
            self._finish(entry, "client-gone")
        except Exception as err:  # noqa: BLE001 - a bug of the stand-in: said, not a hang
            self._finish(entry, f"error: {err!r}")
            try:
                handler.reply(500, {"error": {"message": f"stand-in error: {err!r}", "code": 500}})
            except OSError:
                pass
        finally:
            with self._cond:
                self._inflight.remove(flight)
                self._cond.notify_all()

    def _hold(self, flight: _InFlight, why: str) -> str:
        """Wait, without an answer, until another thread decides this request's fate (or the stand-in closes)."""
        with self._cond:
            flight.held, flight.why = True, why
            flight.entry["held"] = why
            self._cond.notify_all()
        self.announce(f"held {flight.kind} {flight.seed}")
        while not flight.decided.wait(0.05):
            if self._closing.is_set():
                flight.decide("drop")
            elif why in ("fault", "paused") and _client_gone(flight.conn):  # as vLLM: a request whose client
                flight.decide("drop")  # went away is aborted (a stopped or draining server sees nothing)
                flight.entry["gone"] = True
        with self._cond:
            flight.held, flight.why = False, ""
        fate = flight.fate
        if fate in ("drop", "silent"):
            raise _Drop() if fate == "drop" else _Silent()
        flight.fate, flight.decided = None, threading.Event()  # served from here on
        return fate

    def _take_fault(self, kind: str) -> str | None:
        with self._cond:
            for fault in self._faults:
                if fault.count > 0 and fault.on in ("any", kind):
                    fault.count -= 1
                    return fault.how
        return None

    def _answer(self, handler, method, path, params, body, kind, flight) -> tuple[int, object]:
        if self.frozen and not (self.frozen == "200" and path == "/health" and method == "GET"):
            self._hold(flight, "frozen")
        if self.draining is not None:
            if path == "/health" and method == "GET":
                return 503, None
            self._hold(flight, "draining")  # raises: silent
        if path == "/health" and method == "GET":
            return (503 if self.engine_dead else 200), None
        given = handler.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or token != self.key:
            return 401, {"error": "Unauthorized"}
        fault = self._take_fault(kind)
        if fault == "500":
            return 500, {"error": {"message": "stand-in fault: internal server error", "type": "InternalServerError",
                                   "code": 500}}
        if fault == "drop":
            raise _Drop()
        if fault == "restart":
            self.restart()
            raise _Drop()
        if fault == "hold":
            fate = self._hold(flight, "fault")
            if fate == "abort" and kind in ("row", "canary"):
                return 200, self._aborted(body)
        status, payload = self._route(method, path, params, body, flight)
        if fault == "drop_after":
            raise _Drop()
        return status, payload

    def _route(self, method, path, params, body, flight) -> tuple[int, object]:
        body = body if isinstance(body, dict) else {}
        if path == "/version" and method == "GET":
            return 200, {"version": self.vllm_version}
        if path == "/v1/models" and method == "GET":
            return 200, {"object": "list", "data": [{"id": self.served_name, "object": "model", "owned_by": "vllm",
                                                     "root": self.model_dir, "max_model_len": self.max_model_len}] + [
                {"id": name, "object": "model", "owned_by": "vllm", "root": folder, "parent": self.served_name}
                for name, folder in self.adapters.items()]}
        if path == "/v1/completions" and method == "POST":
            return self._completion(body, flight)
        if path == "/metrics" and method == "GET":
            return 200, self.metrics()
        if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") and method == "POST" and self.lora_rank:
            return self._adapter(path, body)
        if path == "/abort_requests" and method == "POST":
            ids = set(body.get("request_ids") or [])
            with self._cond:
                hits = [f for f in self._inflight if f.request_id is not None
                        and ({f.request_id, f"cmpl-{f.request_id}"} & ids)]
                for f in hits:
                    f.decide("abort")
                self._cond.notify_all()
            flight.entry["aborted"] = len(hits)
            return 200, {}
        if not self.dev_mode:
            return 404, {"detail": "Not Found"}
        if path == "/collective_rpc" and method == "POST":
            try:
                result = self._rpc(str(body.get("method")), [str(a) for a in body.get("args") or []])
            except Exception as err:  # noqa: BLE001 - as vLLM: the worker's error, as a 500
                return 500, {"error": {"message": f"{type(err).__name__}: {err}", "type": "InternalServerError",
                                       "code": 500}}
            return 200, {"results": [result]}
        if path == "/pause" and method == "POST":
            mode = params.get("mode", "abort")
            self.paused = mode
            if mode == "abort":
                with self._cond:
                    for f in self._inflight:
                        if f.kind in ("row", "canary") and f is not flight:
                            f.decide("abort")
            elif mode == "wait":  # until nothing generates (a held row holds the pause too, as in vLLM)
                self.wait_for(lambda s: not any(f.kind in ("row", "canary") and f.why != "paused"
                                                for f in s._inflight) or s._closing.is_set(), timeout=3600)
            return 200, {"status": "paused"}
        if path == "/resume" and method == "POST":
            with self._cond:
                self.paused = None
                for f in self._inflight:
                    if f.held and f.fate is None and f.why == "paused":
                        f.decide("release")
                self._cond.notify_all()
            return 200, {"status": "resumed"}
        if path == "/is_paused" and method == "GET":
            return 200, {"is_paused": self.paused is not None}
        if path == "/reset_prefix_cache" and method == "POST":
            return 200, None
        return 404, {"detail": "Not Found"}

    def metrics(self) -> str:
        """vLLM's progress series as its ``/metrics`` serves them (Prometheus text, vLLM's labels)."""
        with self._cond:
            working = [f for f in self._inflight if f.kind in ("row", "canary")]
            running = sum(1 for f in working if not f.held and f.entry.get("started"))
            waiting = sum(1 for f in working if f.held and f.why == "paused")
        labels = '{engine="0",model_name="%s"}' % self.served_name
        values = {**{f"vllm:{k}": v for k, v in self.counters.items()}, "vllm:num_requests_running": running,
                  "vllm:num_requests_waiting": waiting, "vllm:kv_cache_usage_perc": 0.0}
        return "".join(f"{name}{labels} {float(v)}\n" for name, v in sorted(values.items()))

    # -- the worker extension -----------------------------------------------------------------------------------
    def _rpc(self, method: str, args: list[str]):
        if method == "rloo_state":
            return f"{self.boot}:{self.version}"
        if method == "rloo_describe":
            c = self.config
            return json.dumps({"architectures": list(getattr(c, "architectures", None) or []),
                               "vocab_size": c.vocab_size, "dtype": "float32", "hidden_size": c.hidden_size,
                               "num_hidden_layers": c.num_hidden_layers, "logprobs_mode": "processed_logprobs",
                               "max_model_len": self.max_model_len, "vllm_version": self.vllm_version,
                               "boot": self.boot, "max_lora_rank": self.lora_rank})
        if method == "rloo_load":
            return self._load(*args)
        raise AttributeError(f"the worker has no method {method!r}")

    def _load(self, folder: str, version: str) -> dict:
        from safetensors import safe_open

        start = time.perf_counter()
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors file in {folder}")
        counted = {"tensors": 0, "bytes": 0}
        with self._model_lock:
            self.version = ""  # a load that fails half-way leaves no version the trainer would trust
            self._merged = {}  # as vLLM's reload_weights: the engine drops every adapter (the registry keeps them)
            params = dict(self.model.named_parameters(remove_duplicate=False))
            params.update(self.model.named_buffers(remove_duplicate=False))
            with self._torch.no_grad():
                for name in files:
                    with safe_open(os.path.join(folder, name), framework="pt", device="cpu") as f:
                        for key in f.keys():
                            if key not in params:
                                raise KeyError(f"the model has no parameter {key!r}")
                            tensor = f.get_tensor(key)
                            if tuple(tensor.shape) != tuple(params[key].shape):
                                raise ValueError(f"{key}: shape {tuple(tensor.shape)}, the model's "
                                                 f"{tuple(params[key].shape)}")
                            if self.load_mode == "nothing":
                                continue
                            if self.load_mode == "ok":
                                params[key].copy_(tensor)
                            counted["tensors"] += 1
                            counted["bytes"] += tensor.numel() * tensor.element_size()
            self.version = version
        return {"version": version, "boot": self.boot, **counted, "seconds": time.perf_counter() - start}

    def _adapter(self, path: str, body: dict) -> tuple[int, object]:
        """``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, with vLLM's answers."""
        name = str(body.get("lora_name"))
        if path.endswith("unload_lora_adapter"):
            self._merged.pop(name, None)
            if self.adapters.pop(name, None) is None:
                return 404, {"error": {"message": f"The lora adapter '{name}' cannot be found.", "code": 404}}
            return 200, f"Success: LoRA adapter '{name}' removed successfully."
        if name in self.adapters:
            return 400, {"error": {"message": f"The lora adapter '{name}' has already been loaded. If you want to "
                                              "load the adapter in place, set 'load_inplace' to True.", "code": 400}}
        folder = str(body.get("lora_path"))
        if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
            return 404, {"error": {"message": f"Loading lora {name} failed: No adapter found for {folder}",
                                   "type": "NotFoundError", "code": 404}}
        rank = json.load(open(os.path.join(folder, "adapter_config.json")))["r"]
        if rank > self.lora_rank:
            return 500, {"error": {"message": f"LoRA rank {rank} is greater than max_lora_rank {self.lora_rank}.",
                                   "code": 500}}
        with self._model_lock:
            self.adapters[name] = folder
            self._merged[name] = self._merge(folder)
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def _merge(self, folder: str):
        """The base with the adapter of ``folder`` merged in (``adapter_mode`` "ignore": the base)."""
        import copy

        import peft

        base = copy.deepcopy(self.model)
        if self.adapter_mode == "ignore":
            return base.eval()
        return peft.PeftModel.from_pretrained(base, folder).merge_and_unload().eval()

    # -- completions --------------------------------------------------------------------------------------------
    def _aborted(self, body: dict | None) -> dict:
        return {"id": f"cmpl-{(body or {}).get('request_id')}", "object": "text_completion",
                "model": self.served_name,
                "choices": [{"index": 0, "text": "", "token_ids": [], "logprobs": {"tokens": [], "token_logprobs": []},
                             "finish_reason": "abort", "stop_reason": None}]}

    def _completion(self, body: dict, flight: _InFlight) -> tuple[int, object]:
        torch = self._torch
        if self.engine_dead:
            return 500, ENGINE_DEAD
        if body.get("model") != self.served_name and body.get("model") not in self.adapters:
            return 404, {"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                   "type": "NotFoundError", "code": 404}}
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            return 400, {"error": {"message": "the stand-in takes one prompt of token ids", "code": 400}}
        if any(not 0 <= t < self.config.vocab_size for t in prompt):
            return 400, {"error": {"message": f"Token id out of vocabulary (size {self.config.vocab_size})",
                                   "code": 400}}
        max_tokens = int(body.get("max_tokens") or 16)
        if len(prompt) + max_tokens > self.max_model_len:
            return 400, {"error": {"message": f"This model's maximum context length is {self.max_model_len} tokens. "
                                              f"However, you requested {len(prompt) + max_tokens} tokens "
                                              f"({len(prompt)} in the messages, {max_tokens} in the completion).",
                                   "type": "BadRequestError", "code": 400}}
        if self.paused is not None:  # a request that comes while paused waits for /resume (as in vLLM)
            fate = self._hold(flight, "paused")
            if fate == "abort":
                return 200, self._aborted(body)
        temperature = float(body.get("temperature", 1.0))
        top_k = int(body.get("top_k", -1) if body.get("top_k") is not None else -1)
        top_p = float(body.get("top_p", 1.0) if body.get("top_p") is not None else 1.0)
        stops = set(body.get("stop_token_ids") or [])
        if not body.get("ignore_eos"):
            eos = self.config.eos_token_id
            stops |= set([eos] if isinstance(eos, int) else (eos or []))
        generator = torch.Generator().manual_seed(int(body.get("seed") or 0) % 2**63)
        flight.entry["started"] = True
        with self._cond:
            self.counters["prompt_tokens_total"] += len(prompt)
            self.counters["prefix_cache_queries_total"] += len(prompt)
        ids, out, logps, finish = list(prompt), [], [], "length"
        prompt_logprobs = None
        with self._model_lock, torch.no_grad():
            name = body.get("model")
            if name in self.adapters and name not in self._merged:  # evicted by a base load: loaded from its folder
                if not os.path.isfile(os.path.join(self.adapters[name], "adapter_config.json")):
                    self.engine_dead = True
                    return 500, ENGINE_DEAD
                self._merged[name] = self._merge(self.adapters[name])
            model = self._merged.get(name, self.model)
            if body.get("prompt_logprobs") is not None:
                x = torch.tensor([prompt])
                logits = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits[0].float()
                table = torch.log_softmax(logits[:-1], -1)
                prompt_logprobs = [None]
                for pos, tok in enumerate(prompt[1:]):
                    value = float(table[pos, tok]) + self.canary_offset
                    rank = int((table[pos] > table[pos, tok]).sum()) + 1
                    prompt_logprobs.append({str(tok): {"logprob": value, "rank": rank,
                                                       "decoded_token": f"token_id:{tok}"}})
            for _ in range(max_tokens):
                if flight.fate is not None:  # aborted (a pause with mode=abort, an abort), dropped or drained
                    if flight.fate == "abort":
                        finish = "abort"
                        break
                    raise _Drop() if flight.fate == "drop" else _Silent()
                x = torch.tensor([ids])
                logits = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits[0, -1]
                logits = logits.float()
                if temperature == 0.0:
                    token = int(logits.argmax())
                    logp = float(torch.log_softmax(logits, -1)[token])
                else:
                    logits = logits / temperature
                    if 0 < top_k < logits.numel():
                        kth = torch.topk(logits, top_k).values[-1]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    if top_p < 1.0:
                        order = torch.sort(logits, descending=True)
                        cum = torch.softmax(order.values, -1).cumsum(-1)
                        cut = order.indices[(cum - torch.softmax(order.values, -1)) > top_p]
                        logits[cut] = float("-inf")
                    processed = torch.log_softmax(logits, -1)
                    token = int(torch.multinomial(processed.exp(), 1, generator=generator))
                    logp = float(processed[token])
                if str(body.get("request_id")).startswith("rloo-canary"):
                    logp += self.canary_offset  # an adapter sync's canary: on the tokens sampled
                ids.append(token)
                out.append(token)
                logps.append(logp)
                with self._cond:
                    self.counters["generation_tokens_total"] += 1
                if self.token_delay:
                    time.sleep(self.token_delay)
                if token in stops:
                    finish = "stop"
                    break
        choice = {"index": 0, "text": "", "finish_reason": finish, "stop_reason": out[-1] if finish == "stop" else None,
                  "prompt_logprobs": prompt_logprobs}
        if body.get("return_token_ids"):
            choice["token_ids"], choice["prompt_token_ids"] = out, list(prompt)
        if body.get("logprobs") is not None:
            choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in out], "token_logprobs": logps,
                                  "top_logprobs": [{f"token_id:{t}": lp} for t, lp in zip(out, logps)],
                                  "text_offset": [0] * len(out)}
        return 200, {"id": f"cmpl-{body.get('request_id') or uuid.uuid4().hex}", "object": "text_completion",
                     "created": int(time.time()), "model": self.served_name, "choices": [choice],
                     "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                               "total_tokens": len(prompt) + len(out)}}


def _client_gone(conn: socket.socket | None) -> bool:
    """The client closed its end of ``conn`` (a read would find the end of the stream)."""
    if conn is None:
        return False
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def _control(standin: StandinVLLM):
    """The script mode's ``/standin/control`` and ``/standin/log`` (behind the key), wrapped around the router."""
    route = standin._route

    def with_control(method, path, params, body, flight):
        if path == "/standin/control" and method == "POST":
            name = (body or {}).get("call")
            if name not in CONTROL:
                return 400, {"error": f"not a control: {name!r}"}
            getattr(standin, name)(**((body or {}).get("kwargs") or {}))
            return 200, {}
        if path == "/standin/log" and method == "GET":
            with standin._cond:
                return 200, {"log": list(standin.log)}
        return route(method, path, params, body, flight)

    standin._route = with_control


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a stand-in vLLM server for the tests (see the module docstring)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--key", default=os.environ.get("VLLM_API_KEY", ""))
    parser.add_argument("--load-format", default="dummy", choices=["dummy", "auto"])
    args = parser.parse_args(argv)

    said = threading.Lock()

    def say(line: str) -> None:  # one write per line, under a lock: held rows are announced from several threads
        with said:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    standin = StandinVLLM(args.model, args.key, port=args.port, load_format=args.load_format, announce=say)
    _control(standin)
    done = threading.Event()

    def on_sigterm(signum, frame):  # vLLM 0.32: abort the requests, close the listener, wait for the connections
        standin.drain("refused")
        say("Waiting for connections to close.")

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, lambda *a: done.set())
    say(f"ready {standin.port}")
    while not done.wait(0.2):
        pass
    standin.close()


if __name__ == "__main__":
    main(sys.argv[1:])
