"""A vLLM server as the rollout engine: generation on GPUs (or nodes) of its own, the weights synced after every
optimizer step and verified.

The trainer's side only: requests go over HTTP with the standard library, and this module never imports vLLM (a
trainer node need not have it). Its HTTP client is ``vllm_http.py``, the parts of the sync that need no server
``vllm_sync.py``, what it shares with the colocated engine ``vllm_common.py``. The server's side (the worker extension
that loads a synced folder, the guard that puts every path behind the key) is ``vllm_server_side.py``;
``rloo-lightning serve`` starts a server with both.

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
   ``"<boot>:<tag>"`` is read (its process, and the sync it loaded last): another boot (a restarted server) or
   another sync loads the current folder first, and is verified by the canary, so a restarted server is synced
   before it samples; read again after the rows, a change means they are sampled again. A request past
   ``request_timeout`` is aborted on the server, then sent again with the same id stem and seed (a row is kept once:
   a retry can neither duplicate nor drop a sample).

Every failure ends in one line naming the address, within a bounded time: ``connect_timeout`` at start,
``(retries + 1) × (request_timeout + reconnect_timeout)`` for a request, never a hang.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import os
import shutil
import tempfile
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, replace

import torch

from rloo_lightning.engines.base import GenerationEngine, Submitted
from rloo_lightning.engines.kv_cache import base_model
from rloo_lightning.engines.vllm_common import (
    API_KEY_ENV, dtype_name, pad_id, padded_samples, refuse_repetition_penalty, row_seeds,
    sampling_params, unpadded_prompts)
from rloo_lightning.engines.vllm_http import (
    ServerClient, ServerFailed, ServerRefused, ServerTimedOut, ServerUnreachable, one_line)
from rloo_lightning.engines.vllm_sync import (
    Canary, Published, canary_ids, canary_logprobs, from_rank_zero, memory_folder, remove_older_syncs,
    weights_to_write, world, write_sync_folder)
from rloo_lightning.runtime import sigterm

__all__ = ["ServerBatch", "VLLMServerEngine"]


@dataclass(frozen=True)
class ServerBatch:
    """What :meth:`VLLMServerEngine.collect` needs to gather a submitted batch (``Submitted.key``)."""

    futures: dict[int, cf.Future]  # server index -> its rows' future, {row: (ids, logprobs)}
    rows: int  # the batch's rows
    pad: int  # the id the completions are right-padded with
    device: torch.device  # where the prompts were, and the completions go
    stem: str  # the request ids' stem: "<stem>-<row>-a<attempt>"
    start: float  # time.perf_counter() at submit
    cancelled: threading.Event  # set: rows not sent yet are not sent (the batch was aborted)


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
            node only. Only the current sync is kept (two while a sync replaces it): a restarted server loads it.
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

    def __init__(self, urls: list[str] | None = None, api_key_env: str = API_KEY_ENV, sync_dir: str | None = None,
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
        self.sync_count = 0  # syncs published by this run (not optimizer steps: see vllm_sync.py)
        self._servers: list[ServerClient] | None = None
        self._pool: cf.ThreadPoolExecutor | None = None
        self._rows_pool: cf.ThreadPoolExecutor | None = None
        self._pending: list[Submitted] = []
        self._run = uuid.uuid4().hex[:8]
        self._current: Published | None = None  # the last sync (every rank knows it after a sync)
        self._canary: Canary | None = None
        self._made_dir: str | None = None
        self._sums = {"sync_s": 0.0, "sync_mb": 0.0, "load_s": 0.0, "sync_wait_s": 0.0, "retries": 0.0}

    # -- checks and connection, before any rollout -----------------------------------------------
    def prepare(self, model, tokenizer, generation_config) -> None:
        """Connect to every server (waiting up to ``connect_timeout``) and check that it serves this policy: the same
        architecture, vocabulary, hidden size and layers, processed log-probs, a dtype the tolerance allows, and a
        vLLM recent enough. Every difference is said, with the server's address."""
        refuse_repetition_penalty(generation_config, "VLLMServerEngine")
        key = os.environ.get(self.api_key_env, "")
        if not key:
            raise ValueError(f"VLLMServerEngine: set {self.api_key_env} to the key the server was started with "
                             f"(rloo-lightning serve reads {API_KEY_ENV})")
        self._servers = [ServerClient(url, key, self.request_timeout) for url in self.urls]
        for pool in (self._pool, self._rows_pool):  # a second prepare (another stage) starts afresh
            if pool is not None:
                pool.shutdown(wait=False)
        # Two pools: a server's batch waits on its rows, so they never share threads (no deadlock when full).
        self._pool = cf.ThreadPoolExecutor(len(self.urls) * 2, thread_name_prefix="rloo-vllm-server")
        self._rows_pool = cf.ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="rloo-vllm-rows")
        dtype = dtype_name(next(model.parameters()).dtype)
        for server in self._servers:
            try:
                server.wait_up(self.connect_timeout)
            except ServerUnreachable as err:
                raise ServerFailed(f"VLLMServerEngine: no vLLM server answered at {server.url} within "
                                   f"connect_timeout={self.connect_timeout:g} s ({err}); start one with "
                                   f"`rloo-lightning serve --model <policy> --port <port>` (docs/vllm_server.md)") \
                    from None
            server.check_serves(model, dtype, self.canary_tolerance)
        self.stale = True

    def on_weights_updated(self, model) -> None:
        self.stale = True

    def reachable(self) -> None:
        """The key is set and every server answers ``/health`` within 5 s (a checkpoint's engine, for validate, test
        and predict: otherwise they give way to the default engine)."""
        if not os.environ.get(self.api_key_env):
            raise ValueError(f"{self.api_key_env} (the servers' key) is not set")
        for url in self.urls:
            try:
                ServerClient(url, "", 5).call("/health", timeout=5)
            except (ServerUnreachable, ServerTimedOut, ServerRefused) as err:
                raise ConnectionError(f"no vLLM server answers at {url} ({err})") from None

    # -- the sync ----------------------------------------------------------------------------------
    def _sync(self, model) -> None:
        """Publish the policy's weights to every server and verify them (see the module docstring); every rank
        calls this at the same point."""
        start = time.perf_counter()
        self._drain()
        world_size, rank = world()
        outcome: Published | str = ""
        with torch.no_grad():
            weights = weights_to_write(model, rank)  # a gather under FSDP2: every rank walks every weight
            ids = self._canary_ids(model)
            canary = Canary(ids, canary_logprobs(model, ids))  # a forward: every rank
        if rank == 0:
            try:
                outcome = self._publish(weights, canary)
            except Exception as err:  # every rank learns it below, and all stop with this line
                outcome = one_line(err)
        outcome = from_rank_zero(outcome, world_size)
        if isinstance(outcome, str):
            raise ServerFailed(outcome)
        self._current, self._canary, self.sync_count = outcome, canary, outcome.sync_id
        self.stale = False
        self._sums["sync_s"] += outcome.seconds
        self._sums["sync_mb"] += outcome.bytes / 2**20
        self._sums["load_s"] += outcome.load_s
        self._sums["sync_wait_s"] += time.perf_counter() - start

    def _publish(self, weights: dict, canary: Canary) -> Published:
        """Rank 0: write the folder, load it into every server, verify; the outcome every rank takes."""
        start = time.perf_counter()
        size = sum(t.numel() * t.element_size() for t in weights.values())
        root = self.sync_dir or self._made_dir
        if root is None:  # a folder of this process's: removed with it (the servers keep what they loaded)
            root = self._made_dir = tempfile.mkdtemp(prefix="rloo_sync_", dir=memory_folder(size))
            atexit.register(shutil.rmtree, root, True)
        sync_id = self.sync_count + 1
        tag = f"{self._run}:{sync_id}"
        folder = write_sync_folder(root, self._run, sync_id, tag, weights)
        self._current, self._canary = Published(folder, tag, sync_id, len(weights), size), canary
        load_s = 0.0
        for server in self._servers:
            with server.lock:
                load_s = max(load_s, self._load(server, paused=True))
        remove_older_syncs(root, self._run, folder)  # a restarted server loads the current sync; nothing older
        return replace(self._current, load_s=load_s, seconds=time.perf_counter() - start)

    def _load(self, server: ServerClient, paused: bool) -> float:
        """Load the current folder into ``server`` and verify it (caller holds ``server.lock``). ``paused``: behind
        ``/pause`` (it waits for what the server still generates) and ``/resume``; a server just restarted has
        nothing in flight."""
        sync = self._current
        for attempt in range(self.retries + 1):
            try:
                if paused:
                    server.call("/pause?mode=wait", {}, timeout=self.request_timeout)
                try:
                    loaded = server.rpc("rloo_load", sync.folder, sync.tag, timeout=self.request_timeout)
                    server.call("/reset_prefix_cache", {}, timeout=self.request_timeout)
                finally:
                    if paused:
                        server.call("/resume", {}, timeout=self.request_timeout)
                break
            except (ServerUnreachable, ServerTimedOut) as err:
                if attempt == self.retries:
                    raise ServerFailed(f"VLLMServerEngine: {server.url} did not take weight sync {sync.tag} in "
                                       f"{self.retries + 1} attempts ({err})") from None
                self._await_restart(server)
            except ServerRefused as err:
                raise ServerFailed(f"VLLMServerEngine: {server.url} failed to load weight sync {sync.tag} from "
                                   f"{sync.folder}: {err} (the server must read sync_dir: a file system both "
                                   "see)") from None
        if not isinstance(loaded, dict) or (loaded.get("tensors"), loaded.get("bytes")) != (sync.tensors, sync.bytes):
            raise ServerFailed(f"VLLMServerEngine: {server.url} loaded {loaded!r} of weight sync {sync.tag}, not the "
                               f"{sync.tensors} tensors ({sync.bytes} bytes) written")
        self._verify(server)
        return float(loaded.get("seconds") or 0.0)

    def _verify(self, server: ServerClient) -> None:
        """The canary: the server's log-probs of a fixed sequence equal the trainer's within the tolerance."""
        ids, expected = self._canary.ids, self._canary.logprobs
        answer = server.call("/v1/completions", {"model": server.model, "prompt": ids, "max_tokens": 1,
                                                 "temperature": 1.0, "prompt_logprobs": 0, "seed": 0},
                             timeout=self.request_timeout)
        steps = answer["choices"][0]["prompt_logprobs"][1:]
        got = [float(step[str(tok)]["logprob"]) for tok, step in zip(ids[1:], steps)]
        gap = max(abs(a - b) for a, b in zip(got, expected))
        if not gap <= self.canary_tolerance:
            raise ServerFailed(f"VLLMServerEngine: after weight sync {self._current.tag}, {server.url} gives canary "
                               f"log-probs up to {gap:.3g} from the trainer's (canary_tolerance="
                               f"{self.canary_tolerance:g}): the server samples from other weights than the policy's")

    def _await_restart(self, server: ServerClient) -> None:
        try:
            server.wait_up(self.reconnect_timeout)
        except ServerUnreachable as err:
            raise ServerFailed(f"VLLMServerEngine: {server.url} stopped answering and did not come back within "
                               f"reconnect_timeout={self.reconnect_timeout:g} s ({err})") from None

    def _ensure_current(self, server: ServerClient) -> str:
        """The server's ``"<boot>:<tag>"`` (its process, and the sync it last loaded), after loading the current
        sync when it holds another (a restart, or another trainer's)."""
        with server.lock:
            for attempt in range(self.retries + 1):
                try:
                    state = server.rpc("rloo_state", timeout=self.request_timeout)
                    break
                except (ServerUnreachable, ServerTimedOut) as err:
                    if attempt == self.retries:
                        raise ServerFailed(f"VLLMServerEngine: {server.url} does not answer ({err})") from None
                    self._await_restart(server)
            if state.split(":", 1)[1] != self._current.tag:
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
        prompts = unpadded_prompts(prompt_ids, prompt_mask)
        params = _request_params(generation_config)
        seeds = row_seeds(seed, len(prompts))
        world_size, rank = world()
        groups = _group_index(prompts)
        by_server: dict[int, list[int]] = {}
        for i, g in enumerate(groups):
            by_server.setdefault((rank + g * world_size) % len(self._servers), []).append(i)
        stem = f"rloo-{self._run}-r{rank}-s{seed % 10**12}"
        cancelled = threading.Event()
        futures = {s: self._pool.submit(self._server_rows, self._servers[s], [(i, prompts[i], seeds[i]) for i in rows],
                                        params, stem, cancelled) for s, rows in by_server.items()}
        handle = Submitted(key=ServerBatch(futures, len(prompts), pad_id(generation_config), prompt_ids.device, stem,
                                           time.perf_counter(), cancelled))
        self._pending.append(handle)
        return handle

    def _server_rows(self, server: ServerClient, rows: list, params: dict, stem: str,
                     cancelled: threading.Event) -> dict[int, tuple]:
        """One server's rows of a batch: ``{row: (ids, logprobs)}``, sampled again if the server restarted while
        they ran (its boot or its sync changed)."""
        for _ in range(self.retries + 1):
            before = self._ensure_current(server)
            futures = {i: self._rows_pool.submit(self._row, server, prompt, params, row_seed, f"{stem}-{i}",
                                                 cancelled) for i, prompt, row_seed in rows}
            out = {i: f.result() for i, f in futures.items()}
            if self._ensure_current(server) == before:
                return out
            self._sums["retries"] += 1
        raise ServerFailed(f"VLLMServerEngine: {server.url} restarted during every one of {self.retries + 1} "
                           "attempts at a batch")

    def _row(self, server: ServerClient, prompt: list[int], params: dict, row_seed: int, rid: str,
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
            except ServerTimedOut:
                last = f"no answer within request_timeout={self.request_timeout:g} s"
                server.abort(request_id)
            except ServerUnreachable as err:
                last = f"connection lost ({err})"
                self._await_restart(server)
                self._ensure_current(server)
            except ServerRefused as err:
                if err.status < 500:  # the request itself is wrong: another attempt would be refused too
                    raise ServerFailed(f"VLLMServerEngine: {server.url} refused a completion request: {err}") \
                        from None
                last = str(err)
            self._sums["retries"] += 1
        raise ServerFailed(f"VLLMServerEngine: {server.url} did not complete a row in {self.retries + 1} attempts "
                           f"({last})")

    def collect(self, handle: Submitted):
        if handle.value is not None:
            return handle.value
        batch: ServerBatch = handle.key
        samples: list = [([], [])] * batch.rows
        try:
            for future in batch.futures.values():
                for i, sample in future.result().items():
                    samples[i] = sample
        finally:
            if handle in self._pending:
                self._pending.remove(handle)
        handle.value = padded_samples(samples, batch.pad, batch.device)
        handle.seconds = time.perf_counter() - batch.start
        return handle.value

    def generate(self, model, tokenizer, prompt_ids, prompt_mask, generation_config, seed):
        """:meth:`collect` of a :meth:`submit`; a stop signal while it waits aborts the rows on the servers (see
        :func:`rloo_lightning.runtime.sigterm.check`): with several ranks they end as empty completions, the step is
        dropped anyway."""
        handle = self.submit(model, tokenizer, prompt_ids, prompt_mask, generation_config, seed)
        batch: ServerBatch = handle.key
        futures = list(batch.futures.values())
        try:
            while cf.wait(futures, timeout=0.2).not_done:
                if sigterm.check("generation"):  # several ranks: every row ends here, the step is dropped
                    self._abort_batch(handle)
                    return padded_samples([([], [])] * batch.rows, batch.pad, batch.device)
        except BaseException:  # a stop that raises (one process), an interrupt
            self._abort_batch(handle)
            raise
        return self.collect(handle)

    def _abort_batch(self, handle: Submitted) -> None:
        """Ask every server to drop the rows of ``handle`` (best effort: a stop, an error); they are not retried."""
        batch: ServerBatch = handle.key
        batch.cancelled.set()
        if handle in self._pending:
            self._pending.remove(handle)
        ids = [f"{batch.stem}-{i}-a{a}" for i in range(batch.rows) for a in range(self.retries + 1)]
        for server in self._servers or []:
            server.abort(*ids)

    def _drain(self) -> None:
        """Wait for this rank's requests in flight (kept for their :meth:`collect`)."""
        for handle in list(self._pending):
            self.collect(handle)

    def _canary_ids(self, model) -> list[int]:
        if self._canary is not None:
            return self._canary.ids
        limit = min(server.max_model_len or self.canary_tokens + 1 for server in self._servers)
        return canary_ids(base_model(model).config.vocab_size, max(2, min(self.canary_tokens, limit - 1)))

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


def _request_params(config) -> dict:
    """The completions request's sampling fields for the module's generation config (those of ``VLLMEngine``)."""
    params = sampling_params(config)
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
