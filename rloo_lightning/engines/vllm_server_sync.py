""":class:`~rloo_lightning.engines.vllm_server.VLLMServerEngine`'s weight sync: publish the policy to every server,
load it there and verify it with the canary (step 1 of that module's docstring), the weights merged or, for a LoRA
policy under ``lora_sync: adapter``, the base once per server boot and the adapter alone at each sync.

An adapter sync: every rank gathers the adapter (and, at a run's first sync, the base); rank 0 writes the base into a
folder of its own once (``<run>-base-sync000000``) and the adapter of each sync into a new folder
(``<run>-sync<id>``, PEFT's format); for each server, the base is loaded (``rloo_load``, behind ``/pause``) when the
server does not hold it (the first sync, a restart), every adapter the server lists then unloaded (vLLM's engine
drops them when its base reloads, its registry keeps their names), then the adapter under a name new to the run and
the sync (``/v1/load_lora_adapter``: no pause, the requests on the previous adapters go on), and the canary sent
with the new name: the base and the adapter are verified together, at every sync. Such a sync waits for no request
in flight (``keeps_versions``): each batch names the adapter of the sync it was submitted after, and samples with it
to the end, also after a restart (its adapter is loaded again, from its folder, and verified by its own canary).
The adapters of no pending batch are unloaded at the next sync and their folders removed: with ``rollout.lag`` K, K
batches are in flight at a sync, so at most K + 1 adapters are loaded (``rloo-lightning serve --max-loras``).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import replace

import torch

from rloo_lightning.engines.kv_cache import base_model
from rloo_lightning.engines.vllm_http import ServerClient, ServerFailed, ServerRefused, one_line, stopper
from rloo_lightning.engines.vllm_lora import adapter_name, adapter_tensors, write_adapter_folder
from rloo_lightning.engines.vllm_sync import (
    Canary, Published, agreed, canary_ids, canary_logprobs, memory_folder, remove_older_syncs, sampled_canary,
    sync_folder, weights_to_write, world, write_sync_folder)

__all__ = ["ServerWeightSync"]


class ServerWeightSync:
    """The sync's methods of :class:`~rloo_lightning.engines.vllm_server.VLLMServerEngine` (mixed into it: they use
    its options, servers and pools)."""

    def _sync(self, model) -> bool:
        """Publish the policy's weights to every server and verify them (see the module docstring); every rank
        calls this at the same point, and every rank ends it the same way: synced (True), stopped by a signal (False),
        or one ServerFailed line, also when the failure was one rank's (its rows before the sync)."""
        start = time.perf_counter()
        world_size, rank = world()
        mine: Published | str | None = ""
        try:  # merged weights replace the ones in use: this rank's requests in flight end first (adapters: no wait)
            if not self._adapters and not self._drain():
                mine = None
        except Exception as err:  # noqa: BLE001 - held: every rank learns it below, none waits in a collective
            mine = one_line(err)
        with torch.no_grad():  # gathers under FSDP2: every rank walks every weight it writes
            if self._adapters:
                base = weights_to_write(model, rank, merged=False) if self._base is None else None
                weights = (base, adapter_tensors(model))
            else:
                weights = weights_to_write(model, rank)
            ids = self._canary_ids(model)  # a forward: every rank (each keeps its own canary, the rows are large)
            canary = sampled_canary(model, ids) if self._adapters else Canary(ids, canary_logprobs(model, ids))
        if rank == 0 and mine == "":
            try:
                mine = self._publish(weights, canary, model)
            except Exception as err:  # noqa: BLE001 - every rank learns it below, and all stop with this line
                mine = one_line(err)
        outcome = agreed(mine, world_size)
        if isinstance(outcome, str):
            raise ServerFailed(outcome)
        if outcome is None:
            return False
        outcome = replace(outcome, canary=canary)
        self._current, self.sync_count = outcome, outcome.sync_id
        if outcome.base is not None:
            self._base = outcome.base
        self.stale = False
        self._sums["sync_s"] += outcome.seconds
        self._sums["sync_mb"] += outcome.bytes / 2**20
        self._sums["load_s"] += outcome.load_s
        self._sums["sync_wait_s"] += time.perf_counter() - start
        return True

    def _publish(self, weights, canary: Canary, model) -> Published | None:
        """Rank 0: write the folder (an adapter sync: the base too, at the run's first), load it into every server,
        verify; the outcome every rank takes (None: a stop signal ended it)."""
        start = time.perf_counter()
        base, tensors = weights if self._adapters else (None, weights)
        size = sum(t.numel() * t.element_size() for t in (base or tensors).values())
        root = self.sync_dir or self._made_dir
        if root is None:  # a folder of this process's: removed with it (the servers keep what they loaded)
            root = self._made_dir = tempfile.mkdtemp(prefix="rloo_sync_", dir=memory_folder(size))
            atexit.register(shutil.rmtree, root, True)
        sync_id = self.sync_count + 1
        tag = f"{self._run}:{sync_id}"
        if not self._adapters:
            folder = write_sync_folder(root, self._run, sync_id, tag, tensors)
            self._current = Published(folder, tag, sync_id, len(tensors), size, canary=canary)
        else:
            if base is not None:  # the run's first sync: the base, once (a restarted server loads it again)
                base_tag = f"{self._run}:base"
                folder = write_sync_folder(root, f"{self._run}-base", 0, base_tag, base)
                self._base = Published(folder, base_tag, 0, len(base), size)
            folder = sync_folder(root, self._run, sync_id)
            written = write_adapter_folder(folder, model, tensors) + (size if base is not None else 0)
            self._current = Published(folder, tag, sync_id, len(tensors), written,
                                      adapter=adapter_name(sync_id, self._run), base=self._base, canary=canary)
        # the syncs of the batches still in flight (every rank's are these: each collects its batches at the same
        # steps, before that step's collectives): their adapters stay loaded beside the new one
        in_flight = [b.key.sync for b in self._pending]
        kept = sorted({s.adapter for s in in_flight} - {None})
        cancelled = threading.Event()
        stop = stopper(cancelled)
        sync = self._current

        def load(server: ServerClient) -> float:
            with server.lock:
                seconds = self._attempts(server, f"weight sync {tag}", lambda n: self._load(server, sync, True), stop)
                if sync.adapter is not None:
                    retire_adapters(server, [*kept, sync.adapter], self.request_timeout)
                return seconds

        futures = [self._pool.submit(load, server) for server in self._servers]
        if not self._wait(futures, cancelled, "loading the weights into a vLLM server"):
            return None
        load_s = max(f.result() for f in futures)
        # a restarted server loads the current sync, and a batch in flight its own: nothing else
        remove_older_syncs(root, self._run, [folder] + [s.folder for s in in_flight if s.adapter])
        return replace(self._current, load_s=load_s, seconds=time.perf_counter() - start,
                       canary=None)  # every rank has its own

    def _load(self, server: ServerClient, sync: Published, paused: bool) -> float:
        """Load ``sync`` into ``server`` and verify it (caller holds ``server.lock``); its load seconds. An adapter
        sync loads the base first where the server does not hold it (``paused`` applies to that load) and the adapter
        without a pause. :class:`ServerDown` when the server is found down at any of these calls."""
        if sync.adapter is None:
            seconds = self._load_folder(server, sync, paused)
        else:
            seconds = 0.0
            if server.rpc("rloo_state", timeout=self.request_timeout).split(":", 1)[1] != sync.base.tag:
                seconds += self._load_folder(server, sync.base, paused)
                drop_adapters(server, self.request_timeout)
            start = time.perf_counter()
            load_adapter(server, sync, self.request_timeout)
            seconds += time.perf_counter() - start
        self._verify(server, sync)
        return seconds

    def _load_folder(self, server: ServerClient, sync: Published, paused: bool) -> float:
        """Load the weights of ``sync``'s folder into ``server`` (behind ``/pause``, which waits for what it still
        generates, and ``/resume`` when ``paused``; a server just restarted has nothing in flight), checking that it
        consumed what was written; the server's own load seconds."""
        try:
            if paused:
                server.call("/pause?mode=wait", {})
            try:  # a load moves no progress counter: bounded by request_timeout, and ended when the server is down
                loaded = server.rpc("rloo_load", sync.folder, sync.tag, timeout=self.request_timeout, watch="health",
                                    refused_5xx=True)  # the worker's own error: said with the folder, not retried
                server.call("/reset_prefix_cache", {}, timeout=self.request_timeout)
            finally:
                if paused:
                    server.call("/resume", {}, timeout=self.request_timeout)
        except ServerRefused as err:
            raise ServerFailed(f"VLLMServerEngine: {server.url} failed to load weight sync {sync.tag} from "
                               f"{sync.folder}: {err} (the server must read sync_dir: a file system both see)") \
                from None
        if not isinstance(loaded, dict) or (loaded.get("tensors"), loaded.get("bytes")) != (sync.tensors, sync.bytes):
            raise ServerFailed(f"VLLMServerEngine: {server.url} loaded {loaded!r} of weight sync {sync.tag}, not the "
                               f"{sync.tensors} tensors ({sync.bytes} bytes) written")
        return float(loaded.get("seconds") or 0.0)

    def _verify(self, server: ServerClient, sync: Published) -> None:
        """The canary: the server's log-probs of a fixed sequence (under the sync's adapter: of the tokens it samples
        after prefixes of it, :class:`~rloo_lightning.engines.vllm_sync.Canary`) equal the trainer's at that sync
        within the tolerance."""
        canary = sync.canary
        try:
            if canary.rows is None:
                answer = self._canary_call(server, sync, canary.ids, prompt_logprobs=0)
                steps = answer["choices"][0]["prompt_logprobs"][1:]
                got = [float(step[str(tok)]["logprob"]) for tok, step in zip(canary.ids[1:], steps)]
                gap = max(abs(a - b) for a, b in zip(got, canary.logprobs))
            else:  # the prefixes at once: one batch on the server
                calls = [self._rows_pool.submit(self._canary_call, server, sync, canary.ids[:prefix], logprobs=0,
                                                seed=prefix, return_token_ids=True) for prefix in canary.prefixes]
                gap = 0.0
                for row, call in zip(canary.rows, calls):
                    choice = call.result()["choices"][0]
                    token, got = choice["token_ids"][0], float(choice["logprobs"]["token_logprobs"][0])
                    gap = max(gap, abs(got - float(row[token])))
        except ServerRefused as err:
            raise ServerFailed(f"VLLMServerEngine: {server.url} refused the canary of weight sync "
                               f"{sync.tag}: {err}") from None
        if not gap <= self.canary_tolerance:
            what = f"weights (adapter {sync.adapter} on its base)" if sync.adapter else "weights"
            raise ServerFailed(f"VLLMServerEngine: after weight sync {sync.tag}, {server.url} gives canary "
                               f"log-probs up to {gap:.3g} from the trainer's (canary_tolerance="
                               f"{self.canary_tolerance:g}): the server samples from other {what} than the policy's")

    def _canary_call(self, server: ServerClient, sync: Published, prompt: list[int], **fields) -> dict:
        """One canary completion of ``prompt``: one token, at temperature 1, under ``sync``'s adapter if any."""
        body = {"model": served(server, sync), "prompt": prompt, "max_tokens": 1, "temperature": 1.0, "seed": 0,
                "request_id": f"rloo-canary-{self._run}-{uuid.uuid4().hex[:8]}", **fields}
        return server.call("/v1/completions", body, timeout=self._row_timeout(server))

    def _canary_ids(self, model) -> list[int]:
        if self._current is not None:
            return self._current.canary.ids
        limit = min(server.max_model_len or self.canary_tokens + 1 for server in self._servers)
        return canary_ids(base_model(model).config.vocab_size, max(2, min(self.canary_tokens, limit - 1)))


def served(server: ServerClient, sync: Published | None) -> str:
    """The ``model`` a request sampled from ``sync`` names: its adapter, else the served model."""
    return sync.adapter if sync is not None and sync.adapter else server.model


def holds(sync: Published) -> str:
    """The tag a server holding ``sync`` reports (``rloo_state``): an adapter sync's base's."""
    return sync.base.tag if sync.adapter else sync.tag


def drop_adapters(server: ServerClient, timeout: float) -> None:
    """Unload every adapter ``server`` lists, after a base load: vLLM's engine drops them then but its registry keeps
    their names and folders, and loads one again from its folder when a request names it (another run's folder,
    removed since, kills the engine: vLLM 0.32)."""
    listed = server.call("/v1/models", timeout=timeout)["data"]
    _unload(server, [entry["id"] for entry in listed if entry.get("parent")], timeout)
    server.adapters = []


def _unload(server: ServerClient, names: list[str], timeout: float) -> None:
    """``/v1/unload_lora_adapter`` for each of ``names``; one the server no longer holds (a restart) is skipped."""
    for name in names:
        try:
            server.call("/v1/unload_lora_adapter", {"lora_name": name}, timeout=timeout, watch="health")
        except ServerRefused:  # not there any more: nothing to unload
            pass


def load_adapter(server: ServerClient, sync: Published, timeout: float) -> None:
    """Load ``sync``'s adapter into ``server`` under its name (``/v1/load_lora_adapter``; a name it holds already,
    after a retried call that went through, is loaded)."""
    try:
        server.call("/v1/load_lora_adapter", {"lora_name": sync.adapter, "lora_path": sync.folder}, timeout=timeout,
                    watch="health", refused_5xx=True)
    except ServerRefused as err:
        if not (err.status == 400 and "already been loaded" in err.text):
            hint = (" (the server must run with LoRA on and runtime adapter loading: `rloo-lightning serve "
                    "--lora-rank <the adapter's rank>`, or set the engine's lora_sync: merged)" if err.status == 404
                    and "does not exist" not in err.text else "")
            raise ServerFailed(f"VLLMServerEngine: {server.url} failed to load the adapter of weight sync {sync.tag} "
                               f"from {sync.folder}: {err}{hint}") from None
    server.adapters = [*[name for name in getattr(server, "adapters", []) if name != sync.adapter], sync.adapter]


def retire_adapters(server: ServerClient, keep: list[str], timeout: float) -> None:
    """Unload the adapters ``server`` holds for this run but ``keep`` (those of the batches in flight, and the new
    one): vLLM's API forgets them, its engine evicts them as new ones come."""
    _unload(server, [name for name in getattr(server, "adapters", []) if name not in keep], timeout)
    server.adapters = [name for name in getattr(server, "adapters", []) if name in keep]
