"""A vLLM server as the rollout engine: generation on GPUs (or nodes) of its own, the weights synced after every
optimizer step and verified.

The trainer's side only: requests go over HTTP with the standard library, and this module never imports vLLM (a
trainer node need not have it). Its HTTP client is ``vllm_http.py``, its sync ``vllm_server_sync.py`` (a LoRA
policy's adapter alone: the base once per server boot, see there), the parts of the sync that need no server
``vllm_sync.py``, what it shares with the colocated engine ``vllm_common.py``. The server's side (the worker extension
that loads a synced folder, the guard that puts every path behind the key) is ``vllm_server_side.py``;
``rloo-lightning serve`` starts a server with both.

One step, seen from the engine (every rank runs it at the same point; docs/vllm_server.md says why it is safe):

1. **Sync, when the policy changed** (after every optimizer step, and at the start of fit / validate / test /
   predict): each rank waits for its own requests in flight, every rank walks the weights (a gather under FSDP2) and
   computes the canary's log-probs; rank 0 writes one safetensors file into a new folder under ``sync_dir``, then
   for each server ``/pause``, the worker extension's load (it counts what it consumed), ``/reset_prefix_cache``,
   ``/resume`` and the canary (the server's log-probs of it must equal the trainer's within ``canary_tolerance``).
   Every rank ends the sync the same way (:func:`~rloo_lightning.engines.vllm_sync.agreed`): a failure on any rank,
   its rows before the sync included, ends every rank with one line.
2. **Generate** (``submit`` / ``collect``, or ``generate``): each row a completions request with its own seed, rows
   mapped to servers by prompt group and rank. Before a rank's rows go to a server its ``"<boot>:<tag>"`` is read:
   another boot or sync loads (and verifies) the current folder first; read again after the rows, a change means
   they are sampled again.

**Liveness decides, not the longest timeout** (``vllm_http.py``): while a call is in flight the client watches the
server (``/health``, and vLLM's progress counters on ``/metrics``), so that a server killed, shutting down, stopped
or hung is known down within ``liveness_timeout + liveness_interval``, and a slow but alive one is never cut. **One
rule for every call** (a row, a load, the canary, a state read): a server found down is waited for up to
``reconnect_timeout``; then the current sync is loaded and verified again if it restarted, and the work done again
with the same seeds (a row is kept once), ``retries`` times at most; otherwise one line naming the address and what
was seen. Every wait in the trainer's thread honours a stop signal (:func:`rloo_lightning.runtime.sigterm.check`).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Literal

import torch

from rloo_lightning.engines.base import GenerationEngine, Submitted
from rloo_lightning.engines.vllm_common import (
    API_KEY_ENV, completion_fields, dtype_name, pad_id, padded_samples, prompt_group_index, refuse_repetition_penalty,
    row_seeds, unpadded_prompts)
from rloo_lightning.engines.vllm_http import ServerClient, ServerDown, ServerFailed, ServerRefused, attempts, stopper
from rloo_lightning.engines.vllm_lora import check_adapter_sync, is_lora_policy, lora_rank
from rloo_lightning.engines.vllm_server_sync import ServerWeightSync, holds, served
from rloo_lightning.engines.vllm_sync import Published, world
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
    sync: Published  # the sync its rows sample from (an adapter sync: its adapter, to the end)


class VLLMServerEngine(ServerWeightSync, GenerationEngine):
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
        request_timeout: seconds a weight load may take (no progress counter moves while vLLM loads), and any call
            that generates nothing. A row or the canary has no bound of its own while the server is alive and makes
            progress; on a server without progress counters (``--disable-log-stats``) request_timeout bounds it.
        connect_timeout: seconds to wait for every server at the start (said every 30 s).
        reconnect_timeout: seconds to wait for a server found down to come back before one line ends the run.
        retries: attempts after the first of a row, a load (with its canary) or a state read whose server was
            found down and came back (or answered HTTP 5xx); then one line naming the server.
        liveness_timeout: while a call is in flight, a server that has not answered ``/health`` (stopped, a lost
            node), or whose progress counters on ``/metrics`` stood still (a hung engine), for this long is down;
            one that refuses connections (shutting down, killed) or answers 503 (its engine ended), at once.
        liveness_interval: seconds between two looks at a server with calls in flight.
        canary_tolerance: the largest difference allowed between the server's and the trainer's log-probs of the
            canary after a sync. 1e-3 is for a float32 server; a bfloat16 server differs by more (set 0.1 or so, and
            a sync that left the old weights is then caught only when they are that far apart).
        canary_tokens: the length of the canary sequence (capped by the server's context).
        max_concurrency: requests in flight at once, per rank.
        lora_sync: how a LoRA policy (``policy.lora``) reaches the servers. ``adapter`` (the default): the base once
            per server boot, then the adapter's tensors alone at each sync, loaded under a new name (the server must
            serve adapters of its rank: ``rloo-lightning serve --lora-rank R``, checked at connect); what vLLM cannot
            serve (DoRA, ``modules_to_save``, trained biases) is refused at setup. ``merged``: base + adapter merged
            into full weights at every sync. Other policies ignore it.

    Default correction: as :class:`~rloo_lightning.engines.vllm.VLLMEngine`, token-level truncated importance weights
    (cap 2) with ``correction.level: auto``: the server's kernels (and its dtype) are not pi_theta's.
    """

    reports_logprobs = True
    overlaps = True  # submit sends the rows and returns; the server samples while the trainer trains
    default_correction = "token"

    def __init__(self, urls: list[str] | None = None, api_key_env: str = API_KEY_ENV, sync_dir: str | None = None,
                 request_timeout: float = 600.0, connect_timeout: float = 600.0, reconnect_timeout: float = 120.0,
                 retries: int = 2, canary_tolerance: float = 1e-3, canary_tokens: int = 32,
                 max_concurrency: int = 64, liveness_timeout: float = 25.0, liveness_interval: float = 5.0,
                 lora_sync: Literal["adapter", "merged"] = "adapter") -> None:
        urls = ["http://127.0.0.1:8000"] if urls is None else ([urls] if isinstance(urls, str) else list(urls))
        if not urls:
            raise ValueError("VLLMServerEngine urls must name at least one server (http://host:port)")
        for url in urls:
            parsed = urllib.parse.urlparse(str(url))
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ValueError(f"VLLMServerEngine urls: {url!r} is not an http(s)://host:port address")
        for name, value in (("request_timeout", request_timeout), ("connect_timeout", connect_timeout),
                            ("reconnect_timeout", reconnect_timeout), ("canary_tolerance", canary_tolerance),
                            ("liveness_timeout", liveness_timeout), ("liveness_interval", liveness_interval)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"VLLMServerEngine {name} must be a number > 0, got {value!r}")
        for name, value, low in (("retries", retries, 0), ("canary_tokens", canary_tokens, 2),
                                 ("max_concurrency", max_concurrency, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"VLLMServerEngine {name} must be an integer >= {low}, got {value!r}")
        if liveness_interval > liveness_timeout:
            raise ValueError(f"VLLMServerEngine liveness_interval ({liveness_interval:g}) must be at most "
                             f"liveness_timeout ({liveness_timeout:g})")
        if lora_sync not in ("adapter", "merged"):
            raise ValueError(f"VLLMServerEngine lora_sync must be adapter or merged, got {lora_sync!r}")
        self.lora_sync = lora_sync
        if not isinstance(api_key_env, str) or not api_key_env:
            raise ValueError(f"VLLMServerEngine api_key_env must name an environment variable, got {api_key_env!r}")
        self.urls, self.api_key_env, self.sync_dir = [str(u).rstrip("/") for u in urls], api_key_env, sync_dir
        self.request_timeout, self.connect_timeout, self.reconnect_timeout = (request_timeout, connect_timeout,
                                                                              reconnect_timeout)
        self.retries, self.canary_tolerance, self.canary_tokens = retries, canary_tolerance, canary_tokens
        self.max_concurrency = max_concurrency
        self.liveness_timeout, self.liveness_interval = liveness_timeout, liveness_interval
        self._reset()

    def _reset(self) -> None:
        self.stale = True
        self.sync_count = 0  # syncs published by this run (not optimizer steps: see vllm_sync.py)
        self._servers: list[ServerClient] | None = None
        self._pool: cf.ThreadPoolExecutor | None = None
        self._rows_pool: cf.ThreadPoolExecutor | None = None
        self._pending: list[Submitted] = []
        self._run = uuid.uuid4().hex[:8]
        self._current: Published | None = None  # the last sync (every rank knows it after a sync, with its own canary)
        self._adapters = False  # the policy's adapter is synced alone (lora_sync: adapter, a LoRA policy)
        self._base: Published | None = None  # its base, written at the run's first sync
        self._made_dir: str | None = None
        self._sums = {"sync_s": 0.0, "sync_mb": 0.0, "load_s": 0.0, "sync_wait_s": 0.0, "retries": 0.0}

    # -- checks and connection, before any rollout -----------------------------------------------
    def prepare(self, model, tokenizer, generation_config) -> None:
        """Connect to every server (waiting up to ``connect_timeout``, saying so every 30 s) and check that it serves
        this policy: the same architecture, vocabulary, hidden size and layers, processed log-probs, a dtype the
        tolerance allows, and a vLLM recent enough. Every difference is said, with the server's address."""
        refuse_repetition_penalty(generation_config, "VLLMServerEngine")
        self._adapters = self.lora_sync == "adapter" and is_lora_policy(model)
        if self._adapters:
            check_adapter_sync(model, "VLLMServerEngine")
        key = os.environ.get(self.api_key_env, "")
        if not key:
            raise ValueError(f"VLLMServerEngine: set {self.api_key_env} to the key the server was started with "
                             f"(rloo-lightning serve reads {API_KEY_ENV})")
        self.close_connections()
        self._servers = [ServerClient(url, key, self.request_timeout, self.liveness_timeout, self.liveness_interval)
                         for url in self.urls]
        # Two pools: a server's batch waits on its rows, so they never share threads (no deadlock when full).
        self._pool = cf.ThreadPoolExecutor(len(self.urls) * 2, thread_name_prefix="rloo-vllm-server")
        self._rows_pool = cf.ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="rloo-vllm-rows")
        dtype = dtype_name(next(model.parameters()).dtype)
        for server in self._servers:
            server.connect(model, dtype, self.canary_tolerance, self.connect_timeout,
                           stop=lambda: sigterm.check("waiting for a vLLM server"), say=sigterm.rank_zero(),
                           lora_rank=lora_rank(model) if self._adapters else None)
        self.stale = True

    def on_weights_updated(self, model) -> None:
        self.stale = True

    @property
    def keeps_versions(self) -> bool:
        """Adapter syncs wait for no request in flight: each batch samples with the adapter it was submitted after."""
        return self._adapters

    def reachable(self) -> None:
        """The key is set and every server answers ``/health`` within 5 s (a checkpoint's engine, for validate, test
        and predict: otherwise they give way to the default engine)."""
        if not os.environ.get(self.api_key_env):
            raise ValueError(f"{self.api_key_env} (the servers' key) is not set")
        for url in self.urls:
            seen = ServerClient(url, "", 5).health(5)
            if seen:
                raise ConnectionError(f"no vLLM server answers at {url} (it "
                                      f"{'did not answer /health within 5 s' if seen == 'silent' else seen})")

    # -- the one rule of every call, and the waits in the trainer's thread ------------------------------------
    def _attempts(self, server: ServerClient, what: str, work, stop):
        """``work(attempt)`` under the one rule (:func:`~rloo_lightning.engines.vllm_http.attempts`)."""
        def retried() -> None:
            self._sums["retries"] += 1

        return attempts(server, what, work, self.retries, self.reconnect_timeout, stop, retried)

    def _wait(self, futures: list, cancelled: threading.Event, where: str) -> bool:
        """Wait for ``futures`` in the trainer's thread, honouring a stop signal as every wait does
        (:func:`rloo_lightning.runtime.sigterm.check`): with one process it raises there; with several ranks the wait
        ends (False) and every call in flight is ended, so that the ranks stop together."""
        try:
            while cf.wait(futures, timeout=0.2).not_done:
                if sigterm.check(where):
                    self._end_calls(cancelled)
                    return False
        except BaseException:
            self._end_calls(cancelled)
            raise
        return True

    def _end_calls(self, cancelled: threading.Event) -> None:
        cancelled.set()
        for server in self._servers or []:
            server.end_calls("stopped waiting (a stop signal)")

    def _row_timeout(self, server: ServerClient) -> float | None:
        """A request that generates has no bound of its own where the watch sees the server's progress."""
        return None if server.progress_signal else self.request_timeout

    def _ensure(self, server: ServerClient, sync: Published) -> str:
        """The server's ``"<boot>:<tag>"`` (its process, and the sync it last loaded), after loading ``sync`` (a
        batch's) when it holds another (a restart, or another trainer's), or when it lacks ``sync``'s adapter (a
        restart that the current sync's reload found first). :class:`ServerDown` when it is down."""
        with server.lock:
            state = server.rpc("rloo_state", timeout=self.request_timeout)
            if state.split(":", 1)[1] != holds(sync) or (sync.adapter and sync.adapter not in server.adapters):
                server.read_model()  # a restart may rename it
                self._load(server, sync, paused=False)
                state = server.rpc("rloo_state", timeout=self.request_timeout)
            return state

    # -- generation --------------------------------------------------------------------------------
    def submit(self, model, tokenizer, prompt_ids, prompt_mask, generation_config, seed) -> Submitted:
        """Sync if the policy changed, send every row and return; :meth:`collect` waits for them."""
        if self._servers is None:
            self.prepare(model, tokenizer, generation_config)
        if self.stale and not self._sync(model):  # a stop signal (several ranks): the step is dropped
            return Submitted(value=padded_samples([([], [])] * len(prompt_ids), pad_id(generation_config),
                                                  prompt_ids.device), seconds=0.0)
        prompts = unpadded_prompts(prompt_ids, prompt_mask)
        params = completion_fields(generation_config)
        seeds = row_seeds(seed, len(prompts))
        world_size, rank = world()
        groups = prompt_group_index(prompts)
        by_server: dict[int, list[int]] = {}
        for i, g in enumerate(groups):
            by_server.setdefault((rank + g * world_size) % len(self._servers), []).append(i)
        stem = f"rloo-{self._run}-r{rank}-s{seed % 10**12}"
        cancelled = threading.Event()
        sync = self._current
        futures = {s: self._pool.submit(self._server_rows, self._servers[s], [(i, prompts[i], seeds[i]) for i in rows],
                                        params, stem, cancelled, sync) for s, rows in by_server.items()}
        handle = Submitted(key=ServerBatch(futures, len(prompts), pad_id(generation_config), prompt_ids.device, stem,
                                           time.perf_counter(), cancelled, sync))
        self._pending.append(handle)
        return handle

    def _server_rows(self, server: ServerClient, rows: list, params: dict, stem: str,
                     cancelled: threading.Event, sync: Published) -> dict[int, tuple]:
        """One server's rows of a batch, sampled from ``sync``: ``{row: (ids, logprobs)}``, sampled again if the
        server restarted while they ran (its boot or its sync changed)."""
        stop = stopper(cancelled)
        check = "the check of its weights before a batch"
        for _ in range(self.retries + 1):
            before = self._attempts(server, check, lambda n: self._ensure(server, sync), stop)
            futures = {i: self._rows_pool.submit(self._row, server, prompt, params, row_seed, f"{stem}-{i}", stop,
                                                 sync) for i, prompt, row_seed in rows}
            cf.wait(futures.values())  # every row ends within its bound; none is left running
            out = {i: f.result() for i, f in futures.items()}
            if self._attempts(server, check, lambda n: self._ensure(server, sync), stop) == before:
                return out
            self._sums["retries"] += 1
        raise ServerFailed(f"VLLMServerEngine: {server.url} restarted during every one of {self.retries + 1} "
                           "attempts at a batch")

    def _row(self, server: ServerClient, prompt: list[int], params: dict, row_seed: int, rid: str, stop,
             sync: Published) -> tuple:
        body = {"model": served(server, sync), "prompt": prompt, "seed": row_seed, **params}

        def attempt(n: int) -> tuple:
            stop()
            if n:  # after the server was down: it may have restarted, and is synced and verified before it samples
                self._ensure(server, sync)
                body["model"] = served(server, sync)
            request_id = f"{rid}-a{n}"
            try:
                answer = server.call("/v1/completions", {**body, "request_id": request_id},
                                     timeout=self._row_timeout(server))
            except ServerDown as down:
                if down.answering:  # it may still be generating it (a hang, a timeout): dropped there first
                    server.abort(request_id)
                raise
            except ServerRefused as err:  # a 4xx: the request itself is wrong, another attempt would be refused too,
                if sync.adapter and err.status == 404:  # except a 404 for the row's adapter: the server restarted
                    # after the batch's check (it lost its adapters), so the next attempt loads it again first
                    raise ServerDown(server.url, f"does not hold adapter {body['model']} (restarted?)") from None
                raise ServerFailed(f"VLLMServerEngine: {server.url} refused a completion request: {err}") from None
            choice = answer["choices"][0]
            if choice.get("finish_reason") == "abort":  # not a sample: vLLM shutting down, or paused with mode=abort
                raise ServerDown(server.url, "aborted the row (shutting down, or paused by another client)", True)
            return list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]

        return self._attempts(server, "a row", attempt, stop)

    def collect(self, handle: Submitted):
        """The batch of a :meth:`submit`, waiting for it (a stop signal is honoured while it waits: with several
        ranks the rows end as empty completions, the step is dropped anyway)."""
        if handle.value is not None:
            return handle.value
        batch: ServerBatch = handle.key
        try:
            if not self._wait(list(batch.futures.values()), batch.cancelled, "waiting for a vLLM server's rows"):
                self._abort_batch(handle)
                return padded_samples([([], [])] * batch.rows, batch.pad, batch.device)
        except BaseException:  # a stop that raises (one process), an interrupt
            self._abort_batch(handle)
            raise
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
        return self.collect(self.submit(model, tokenizer, prompt_ids, prompt_mask, generation_config, seed))

    def _abort_batch(self, handle: Submitted) -> None:
        """Ask every server to drop the rows of ``handle`` (best effort: a stop, an error); they are not retried."""
        batch: ServerBatch = handle.key
        batch.cancelled.set()
        if handle in self._pending:
            self._pending.remove(handle)
        ids = [f"{batch.stem}-{i}-a{a}" for i in range(batch.rows) for a in range(self.retries + 1)]
        for server in self._servers or []:
            server.abort(*ids)

    def _drain(self) -> bool:
        """Wait for this rank's requests in flight (kept for their :meth:`collect`); False: a stop ended the wait."""
        for handle in list(self._pending):
            self.collect(handle)
            if handle.seconds is None:  # ended by a stop: empty
                return False
        return True

    # -- figures -----------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Since the last call: ``train/weight_sync_s`` (rank 0's write, loads and checks), ``train/weight_sync_mb``,
        ``train/weight_load_s`` (the slowest server's own load), ``train/weight_sync_wait_s`` (this rank's wait:
        gather, canary, the outcome's gather) and ``train/server_retries``."""
        s = self._sums
        values = {"train/weight_sync_s": s["sync_s"], "train/weight_sync_mb": s["sync_mb"], "train/weight_load_s":
                  s["load_s"], "train/weight_sync_wait_s": s["sync_wait_s"], "train/server_retries": s["retries"]}
        self._sums = dict.fromkeys(s, 0.0)
        return values

    def close_connections(self) -> None:
        """End the threads and watches of this engine's connections (a second prepare starts afresh)."""
        for pool in (self._pool, self._rows_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        for server in self._servers or []:
            server.close()

    def close(self) -> None:
        """Drop the connections and the temporary sync folder; the servers keep running (and their weights)."""
        self.close_connections()
        if self._made_dir is not None:
            shutil.rmtree(self._made_dir, ignore_errors=True)
        self._reset()

    def __getstate__(self) -> dict:  # a deep copy or pickle of the module carries the options, not the connections
        state = dict(self.__dict__)
        state.update(_servers=None, _pool=None, _rows_pool=None, _pending=[], stale=True, _made_dir=None, _base=None,
                     _current=None)
        return state
