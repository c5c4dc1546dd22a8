"""Generation engines: the interface between the module and what samples the completions, and the engines that
ship besides the default.

- :class:`GenerationEngine`: the contract (prompts in, token ids and optionally log pi_s out).
- :class:`HFGenerateEngine`: the policy's own ``generate`` (every sampling option transformers has; pi_theta).
- :class:`ReducedPrecisionEngine`: a bf16 / fp16 / int8 copy of the policy, refreshed after every optimizer step.
  It samples from pi_s != pi_theta, so it reports log pi_s of what it sampled: the module logs
  ``train/mismatch/*`` and, with ``model.correction.level``, corrects the estimator for it.

The default engine, :class:`~rloo_lightning.decode.DecodeLoopEngine` (a decode loop over the policy's KV cache,
exactly pi_theta), has a module of its own: ``rloo_lightning.decode``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import math
from collections.abc import Iterator
from typing import Literal

import torch
from torch import Tensor
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from rloo_lightning import stop
from rloo_lightning.logprobs import _base_model, cache_keyword, prefill_groups

__all__ = ["GenerationEngine", "HFGenerateEngine", "ReducedPrecisionEngine", "build_engine", "cpu_supports_bf16",
           "engine_class", "engine_spec", "generates_synced",
           "prompt_groups", "shared_prefill"]


class GenerationEngine:
    """The seam between :class:`~rloo_lightning.RLOOModule` and whatever samples the completions.

    Prompts in, token ids out; the module builds masks, texts and everything else from the ids,
    so an engine only has to sample faithfully. The module's default,
    :class:`~rloo_lightning.decode.DecodeLoopEngine`, decodes over the live policy's KV cache;
    :class:`HFGenerateEngine` calls its ``generate``. A faster engine (e.g. vLLM on a GPU) subclasses this, samples
    from its own copy of the weights, and refreshes that copy in :meth:`on_weights_updated`,
    which the module calls after every optimizer step (on-policy: the next rollout must come
    from the updated policy). Select one with ``RLOOModule(generation_engine=...)``.

    Contract of :meth:`generate`:
        - sample from exactly ``generation_config`` (temperature, top_k/top_p off by default, EOS
          ids, ``max_new_tokens``); nothing from the model's shipped generation config;
        - be deterministic given ``seed`` and leave the global RNG as it was;
        - return ``[B, T']`` completion ids, ``T' <= max_new_tokens``, right-padded with any id
          after a completion's first EOS (the module's mask ends at the first EOS / stop string);
        - or ``(ids, logprobs)``: with ``[B, T']`` log-probabilities of each sampled token under the
          distribution the engine actually sampled from (its temperature and truncation included). An
          engine that is not exactly pi_theta (reduced precision, quantized, other kernels) should: the
          module then logs ``train/mismatch/*`` and can correct for it (``correction.level``).

    Checkpoints name the engine by its class path and every argument of its constructor (captured when it is
    made), so that validate, test, predict and a resume rebuild it: a user's engine is stored too when its class
    imports by that path and its arguments are plain values (numbers, strings, lists, mappings); otherwise fit
    says, in one line, that it is not stored.
    """

    def __new__(cls, *args, **kwargs):
        # The arguments the engine was built with, so that a checkpoint can name it (``engine_spec``) and
        # validate, test, predict and a resume rebuild it, for a user's subclass as for ours.
        engine = super().__new__(cls)
        engine._given_args = (args, kwargs)
        return engine

    #: Whether :meth:`generate` returns ``(ids, logprobs)``: True or False when known in advance, None when
    #: only a rollout tells (``correction.level`` then fails at the first rollout without log-probs).
    reports_logprobs: bool | None = None

    def generate(self, model, tokenizer, prompt_ids: Tensor, prompt_mask: Tensor,
                 generation_config: GenerationConfig, seed: int) -> Tensor:
        """Completion ids ``[B, T']`` (or ``(ids, logprobs)``) for ``B`` left-padded prompts ``[B, P]`` (already
        repeated k times)."""
        raise NotImplementedError

    #: The ``correction.level`` that ``level: auto`` means with this engine (None: ``none``).
    default_correction: str | None = None

    def on_weights_updated(self, model) -> None:
        """Called after each optimizer step, and at the start of fit, validate, test and predict (weights may have
        been restored from a checkpoint): an engine holding its own copy of the weights refreshes it before its
        next generation."""

    def prepare(self, model, tokenizer, generation_config) -> None:
        """Called once the policy is loaded, with the module's sampling config: raise if this engine cannot sample
        from this model with these options (before any rollout)."""

    def check(self, device: torch.device) -> None:
        """Called at setup, before any model is loaded: raise if this engine cannot run on ``device``."""


def _plain(value) -> bool:
    """Whether ``value`` is made of None, bool, int, float, str, lists and str-keyed dicts (what a checkpoint's
    hyperparameters may hold: they are read with ``weights_only``)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def engine_spec(engine: GenerationEngine) -> tuple[dict | None, str | None]:
    """``({"class_path": ..., "init_args": {...}}, None)``: how to build ``engine`` again (every argument of its
    constructor, defaults included, so a later default does not change a resumed run); or ``(None, why)`` when it
    cannot be named: a class not importable by its path (defined in ``__main__`` or a function), or an argument
    that is not a plain value."""
    cls = type(engine)
    class_path = f"{cls.__module__}.{cls.__qualname__}"
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        return None, f"its class {class_path} cannot be imported by that path"
    args, kwargs = getattr(engine, "_given_args", ((), {}))
    try:
        bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs)
    except TypeError as err:
        return None, f"its arguments do not match {cls.__name__}'s signature ({err})"
    bound.apply_defaults()
    init_args = dict(list(bound.arguments.items())[1:])  # without self
    for name, value in list(init_args.items()):
        kind = inspect.signature(cls.__init__).parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            init_args.pop(name)
            init_args.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            return None, f"{cls.__name__} takes *{name} (positional arguments have no name to store)"
    bad = next((name for name, value in init_args.items() if not _plain(value)), None)
    if bad is not None:
        return None, f"its argument {bad}={init_args[bad]!r} is not a plain value"
    return {"class_path": class_path, "init_args": {k: list(v) if isinstance(v, tuple) else v
                                                     for k, v in init_args.items()}}, None


def engine_class(class_path: str) -> type:
    """The :class:`GenerationEngine` subclass at ``class_path`` (``package.module.Class``); ImportError or
    TypeError naming it otherwise."""
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name) if module_name else None
    except (ImportError, AttributeError) as err:
        raise ImportError(f"generation engine {class_path} cannot be imported: {err}") from err
    if cls is None:
        raise ImportError(f"generation engine {class_path} cannot be imported: not a module.Class path")
    if not (isinstance(cls, type) and issubclass(cls, GenerationEngine)):
        raise TypeError(f"generation engine {class_path} is not a GenerationEngine subclass")
    return cls


def build_engine(spec: dict) -> GenerationEngine:
    """The engine that :func:`engine_spec` (or a ``{class_path, init_args}`` mapping in YAML) describes."""
    if not isinstance(spec, dict) or not isinstance(spec.get("class_path"), str):
        raise TypeError(f"generation_engine must be an engine or a mapping with a class_path, got {spec!r}")
    return engine_class(spec["class_path"])(**dict(spec.get("init_args") or {}))


class HFGenerateEngine(GenerationEngine):
    """``model.generate`` with the KV cache, in eval mode, stopping when every row has ended.

    Args:
        return_logprobs: also return log pi_s of each sampled token, from the processed logits ``generate``
            sampled from (temperature and any top-k / top-p applied): the mismatch diagnostics then measure
            how far cached decoding is from the training forward.
        sampler_temperature: sample at this temperature instead of ``sampling.temperature`` (the log-probs
            follow it): a sampler that differs from pi_theta by a known amount, to test the correction.
        share_prompt: prefill each distinct prompt once and share its KV cache across its k samples
            (:func:`shared_prefill`), instead of prefilling all ``N*k`` rows: the same distribution, the
            same random draws, (k-1)/k less prefill compute.
    """

    def __init__(self, return_logprobs: bool = False, sampler_temperature: float | None = None,
                 share_prompt: bool = True) -> None:
        if sampler_temperature is not None and sampler_temperature <= 0:
            raise ValueError(f"sampler_temperature must be > 0, got {sampler_temperature}")
        self.return_logprobs = return_logprobs or sampler_temperature is not None
        self.sampler_temperature = sampler_temperature
        self.share_prompt = share_prompt

    @property
    def reports_logprobs(self) -> bool:
        """Whether sampled rollouts come with log pi_s (what ``correction.level`` needs)."""
        return self.return_logprobs

    def generate(self, model, tokenizer, prompt_ids, prompt_mask, generation_config, seed):
        # A peft wrapper generates with its base model's generation_config.
        base = _base_model(model)
        was_training, shipped = model.training, base.generation_config
        # transformers fills every unset field of our config from the model's shipped one (min_p,
        # suppress_tokens, ... would truncate the sampler); an empty one leaves nothing to merge.
        base.generation_config = GenerationConfig()
        model.eval()  # eval: no dropout, and transformers keeps the KV cache even when checkpointing
        logprobs = self.return_logprobs and generation_config.do_sample
        if logprobs:
            generation_config = copy.deepcopy(generation_config)
            generation_config.output_scores = generation_config.return_dict_in_generate = True
            if self.sampler_temperature is not None:
                generation_config.temperature = self.sampler_temperature
        try:
            # Not where every forward gathers sharded weights (synced_gpus): ranks must run the same forwards.
            share = self.share_prompt and not generates_synced(model)
            prefilled = shared_prefill(model, prompt_ids, prompt_mask) if share else {}
            with _seeded_global_rng(seed, prompt_ids.device):
                out = model.generate(
                    input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=generation_config,
                    tokenizer=tokenizer if generation_config.stop_strings else None, **prefilled,
                    stopping_criteria=StoppingCriteriaList([_StopRequested()]),
                )
        finally:
            model.train(was_training)
            base.generation_config = shipped
        if not logprobs:
            return out[:, prompt_ids.shape[1] :]
        ids = out.sequences[:, prompt_ids.shape[1] :]
        # scores: one [B, V] tensor per generated position, the processed logits that were sampled from.
        scores = torch.stack(out.scores, dim=1).float()
        return ids, torch.log_softmax(scores, dim=-1).gather(-1, ids[..., None]).squeeze(-1)


class _StopRequested(StoppingCriteria):
    """A SIGTERM (:func:`rloo_lightning.stop.check`): one process stops at this token; with several ranks every
    row of this rank ends here (under ``synced_gpus`` it keeps serving the others' forwards until they end too)."""

    def __call__(self, input_ids: Tensor, scores, **kwargs) -> Tensor:
        return torch.full((input_ids.shape[0],), stop.check("generation"), dtype=torch.bool, device=input_ids.device)


def generates_synced(model) -> bool:
    """Whether ``model.generate`` was given ``synced_gpus=True`` (a sharded policy that gathers per forward: every
    rank must run the same forwards, so nothing may add or skip one)."""
    return bool(getattr(getattr(model, "generate", None), "keywords", {}).get("synced_gpus", False))


def prompt_groups(prompt_ids: Tensor, prompt_mask: Tensor) -> int:
    """The largest ``g`` such that the rows are runs of ``g`` equal consecutive prompts (ids and mask): the gcd of
    the runs' lengths, so ``k`` (or a multiple of it) for a rollout's ``N*k`` rows even when two neighbouring
    prompts are equal; 1 when no row repeats."""
    rows = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    _, counts = torch.unique_consecutive(rows, dim=0, return_counts=True)
    return math.gcd(*counts.tolist())


def shared_prefill(model, prompt_ids: Tensor, prompt_mask: Tensor) -> dict:
    """The keyword that hands ``generate`` a KV cache of all but the last prompt column, computed once per
    distinct prompt and repeated over its k rows (``{}`` when the rows are not groups of equal prompts, the
    prompt is one column wide, or the model returns no cache).

    ``generate`` then runs only the last prompt column and the decode steps: its sampling (and so its random
    draws) is unchanged, the prefill costs ``N`` rows instead of ``N*k``.
    """
    k = prompt_groups(prompt_ids, prompt_mask)
    if k == 1 or prompt_ids.shape[1] < 2:
        return {}
    cache, _ = prefill_groups(model, prompt_ids[:, :-1], prompt_mask[:, :-1], k)
    return {} if cache is None else {cache_keyword(model): cache}


@contextlib.contextmanager
def _seeded_global_rng(seed: int, device: torch.device) -> Iterator[None]:
    """The global RNG of ``device`` (and the CPU's) seeded with ``seed`` inside, restored after.

    Not ``fork_rng`` + ``torch.manual_seed``: those seed every accelerator type torch knows of, and on
    a machine where CUDA is not initialised each call formats a stack trace (``torch.cuda._lazy_call``):
    0.18 ms a call against 0.006 ms here, measured on CPU.
    """
    cpu_state = torch.get_rng_state()
    cuda = device.type == "cuda"
    cuda_state = torch.cuda.get_rng_state(device) if cuda else None
    torch.default_generator.manual_seed(seed)
    if cuda:
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if cuda:
            torch.cuda.set_rng_state(cuda_state, device)


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_supports_bf16() -> bool:
    """Whether this CPU has native bf16 arithmetic (AVX512-BF16 or AMX): elsewhere bf16 is emulated, and slow."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class ReducedPrecisionEngine(GenerationEngine):
    """Samples from a reduced-precision copy of the policy, refreshed after every optimizer step.

    The copy is ``bfloat16`` / ``float16`` (weights and activations) or ``int8`` (int8 weights,
    activations in the policy's dtype, through ``torchao``'s weight-only quantization). It is made at
    the first rollout and refreshed lazily at the rollout after each optimizer step (the module calls
    :meth:`on_weights_updated`), so gradient accumulation costs one refresh per step. It samples
    with the policy's own ``generate`` (KV cache, the module's explicit generation config) and
    returns ``(ids, log pi_s)``: the log-probabilities of the copy's processed logits, the
    distribution it actually sampled from.

    Args:
        dtype: ``bfloat16`` (checked at setup: a CPU without native bf16 is refused, since emulated
            bf16 is slower than fp32), ``float16`` (GPU) or ``int8`` (needs ``torchao``).

    Memory: one extra copy of the weights at the reduced precision. A policy sharded by FSDP2 /
    FSDP / ZeRO-3 is refused (each rank would need the whole copy).
    """

    def __init__(self, dtype: Literal["bfloat16", "float16", "int8"] = "bfloat16") -> None:
        if dtype not in (*DTYPES, "int8"):
            raise ValueError(f"ReducedPrecisionEngine dtype must be one of {[*DTYPES, 'int8']}, got {dtype!r}")
        self.dtype = dtype
        self.copy: torch.nn.Module | None = None
        self.stale = True
        self.refreshes = 0
        self._sampler = HFGenerateEngine(return_logprobs=True)

    reports_logprobs = True

    def check(self, device: torch.device) -> None:
        if self.dtype == "bfloat16" and device.type == "cpu" and not cpu_supports_bf16():
            raise RuntimeError("generation_engine ReducedPrecisionEngine(dtype=bfloat16): this CPU has no native "
                               "bf16 (AVX512-BF16 / AMX); emulated bf16 is slower than fp32. Use dtype int8 or "
                               "the default engine")
        if self.dtype == "float16" and device.type == "cpu":
            raise RuntimeError("generation_engine ReducedPrecisionEngine(dtype=float16) is for GPUs; on a CPU use "
                               "bfloat16 or int8")
        if self.dtype == "int8":
            try:
                import torchao  # noqa: F401
            except ImportError as err:
                raise ImportError("ReducedPrecisionEngine(dtype=int8) needs torchao: pip install torchao") from err

    def on_weights_updated(self, model) -> None:
        self.stale = True

    def refresh(self, model: torch.nn.Module) -> torch.nn.Module:
        """The reduced-precision copy of ``model``'s current weights (made or updated in place)."""
        if any(hasattr(p, "full_tensor") for p in model.parameters()):
            raise ValueError("ReducedPrecisionEngine does not support a sharded (FSDP2 / FSDP / ZeRO-3) policy")
        # Normal tensors, whatever grad mode the module generates in: the copy is reused across rollouts.
        with torch.inference_mode(False), torch.no_grad():
            if self.copy is not None and self.dtype in DTYPES:
                for target, source in zip(self.copy.state_dict().values(), model.state_dict().values()):
                    target.copy_(source)  # cast to the copy's dtype
            else:  # first use, or int8 (quantized weights are rebuilt from the fp weights)
                self.copy = self._build(model)
        self.stale = False
        self.refreshes += 1
        return self.copy

    def _build(self, model: torch.nn.Module) -> torch.nn.Module:
        fresh = copy.deepcopy(model).eval().requires_grad_(False)
        if self.dtype in DTYPES:
            return fresh.to(DTYPES[self.dtype])
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(fresh, Int8WeightOnlyConfig())
        return fresh

    def generate(self, model, tokenizer, prompt_ids, prompt_mask, generation_config, seed):
        sampler = self.refresh(model) if self.stale or self.copy is None else self.copy
        return self._sampler.generate(sampler, tokenizer, prompt_ids, prompt_mask, generation_config, seed)
