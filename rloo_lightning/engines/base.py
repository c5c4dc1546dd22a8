"""The contract between the module and what samples the completions (:class:`GenerationEngine`), and how a
checkpoint names an engine and builds it again (:func:`engine_spec`, :func:`engine_class`, :func:`build_engine`).

The engines themselves have modules of their own in this package: the default
:class:`~rloo_lightning.engines.decode.DecodeLoopEngine` (``decode.py``), the policy's ``generate``
(``hf_generate.py``), a reduced-precision copy (``reduced_precision.py``) and vLLM (``vllm.py``, its child process
in ``vllm_child.py``).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import GenerationConfig

__all__ = ["GenerationEngine", "Submitted", "build_engine", "engine_class", "engine_spec"]


@dataclass
class Submitted:
    """A handle of :meth:`GenerationEngine.submit`: the result when it is known (``value``), the engine's seconds
    on it (``seconds``, None: not known) and what the engine keeps to find it (``key``: a frozen dataclass of the
    engine's own, with named fields, e.g. :class:`~rloo_lightning.engines.vllm.ChildRequest`)."""

    value: Any = None
    seconds: float | None = None
    key: Any = None


class GenerationEngine:
    """The seam between :class:`~rloo_lightning.RLOOModule` and whatever samples the completions.

    Prompts in, token ids out; the module builds masks, texts and everything else from the ids,
    so an engine only has to sample faithfully. The module's default,
    :class:`~rloo_lightning.engines.decode.DecodeLoopEngine`, decodes over the live policy's KV cache;
    :class:`~rloo_lightning.engines.hf_generate.HFGenerateEngine` calls its ``generate``. A faster engine
    (e.g. vLLM on a GPU) subclasses this, samples from its own copy of the weights, and refreshes that copy in
    :meth:`on_weights_updated`,
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

    #: Whether :meth:`submit` returns before its sampling is done, so that it runs while the trainer computes
    #: (``rollout.lag >= 1``). False: :meth:`submit` samples at once (the default below).
    overlaps: bool = False

    def submit(self, model, tokenizer, prompt_ids: Tensor, prompt_mask: Tensor,
               generation_config: GenerationConfig, seed: int):
        """Start sampling what :meth:`generate` would return for these arguments, from the weights as they are now,
        and return a handle for :meth:`collect` (``rollout.lag >= 1``).

        Contract, for an engine that overlaps (:attr:`overlaps` True):
            - the sample is a function of the weights at this call: an :meth:`on_weights_updated` that follows, and
              the optimizer step that changes the model's tensors before it, must not reach a request already
              submitted (hold the weights it needs, or finish it before loading newer ones);
            - each call is one engine batch of its own (what other requests are pending does not change it), so
              that a run and its resume sample the same tokens;
            - :meth:`generate` may be called while requests are pending (validation, dynamic sampling's extra
              rounds): it samples from the weights as they are then.

        The default samples now with :meth:`generate` and holds the result: exact, and no overlap.
        """
        start = time.perf_counter()
        value = self.generate(model, tokenizer, prompt_ids, prompt_mask, generation_config, seed)
        return Submitted(value=value, seconds=time.perf_counter() - start)

    #: Whether each submitted request keeps the weights it was submitted from while newer ones load: a sync does not
    #: wait for the requests in flight (a LoRA policy's adapters, one version per sync). True lets a rollout
    #: generate across the syncs of the steps between (``rollout.lag >= 2``): the pipeline does not collect it at
    #: each step's end. False (the default): the pipeline collects every request before the next sync.
    keeps_versions: bool = False

    def collect(self, handle):
        """What :meth:`generate` would have returned for the :meth:`submit` that gave ``handle``; waits for it.
        Each handle is collected once, in any order. ``handle.seconds``, when set, is the time the engine spent
        on it (the step's ``train/engine_idle_s`` is computed from it)."""
        return handle.value

    def metrics(self) -> dict[str, float]:
        """The engine's own figures since the last call (``train/<name>``: value), logged with the step's metrics as
        the mean over ranks. None by default; a server engine's weight syncs, for one."""
        return {}

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

    def reachable(self) -> None:
        """Called at setup of validate, test and predict when the engine was rebuilt from the checkpoint: raise at once
        if what it samples with cannot be reached now (a server), so that the command samples with the default engine
        instead of waiting. Nothing to reach by default."""


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
    from rloo_lightning.runtime.importpath import ImportPathError, import_object

    try:
        cls = import_object(class_path, "generation engine")
    except ImportPathError as err:  # its message names the path and the closest name there
        raise ImportError(str(err)) from err.__cause__
    if not (isinstance(cls, type) and issubclass(cls, GenerationEngine)):
        raise TypeError(f"generation engine {class_path} is not a GenerationEngine subclass")
    return cls


def build_engine(spec: dict) -> GenerationEngine:
    """The engine that :func:`engine_spec` (or a ``{class_path, init_args}`` mapping in YAML) describes."""
    if not isinstance(spec, dict) or not isinstance(spec.get("class_path"), str):
        raise TypeError(f"generation_engine must be an engine or a mapping with a class_path, got {spec!r}")
    return engine_class(spec["class_path"])(**dict(spec.get("init_args") or {}))
