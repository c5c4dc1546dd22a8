"""Sharded training: FSDP2 (``ModelParallelStrategy``), FSDP (``FSDPStrategy``) and DeepSpeed ZeRO-2/3.

RLOO samples its rollouts inside ``training_step``, token by token, and the ranks stop at different lengths
(each stops when all of *its* completions have ended). Under a sharded strategy every forward of the policy
would all-gather its parameters, layer by layer: a collective per layer *per token*. A rank that finishes
early stops calling them and the others wait for it forever (or, worse, pair their all-gathers with its next,
unrelated collective). :func:`gathered_for_generation` avoids that by gathering once per ``generate`` call:

==================  ==============================================================================================
strategy            what happens around ``generate``
==================  ==============================================================================================
FSDP2               every ``FSDPModule`` of the policy is unsharded (one all-gather each, the same order on every
                    rank) and its reshard-after-forward is turned off for the duration, so the forwards inside
                    ``generate`` find their parameters in place and issue no collective; the settings are
                    restored and the parameters resharded afterwards.
FSDP (FSDP1)        ``FullyShardedDataParallel.summon_full_params(policy, writeback=False)`` gathers every FSDP unit
                    of the policy once, and the units' reshard-after-forward is switched off for the duration (else
                    the units' own post-forward would free the gathered parameters after the first token).
                    For both FSDPs ``synced_gpus=False`` is passed to ``generate`` explicitly: transformers turns
                    it on for FSDP-managed models (a scalar all-reduce per token), which is not needed any more.
DeepSpeed ZeRO-3    ``deepspeed.zero.GatheredParameters`` over the policy's parameters, with ZeRO-3's fetch/release
                    module hooks removed for the duration (as TRL does), and ``synced_gpus=True`` passed to
                    ``generate`` explicitly: transformers only detects ZeRO-3 through its own ``HfDeepSpeedConfig``,
                    which Lightning does not create, so it would otherwise leave ``synced_gpus`` off.
                    ``gather=False`` keeps the parameters partitioned (less memory, a collective per layer
                    per token) and relies on ``synced_gpus=True`` alone (so for FSDP and FSDP2 too).
DDP, ZeRO-1/2,      nothing: every rank holds the whole policy.
one process
==================  ==============================================================================================

The reference policy and reward models are never sharded: RLOOModule keeps them outside its registered
submodules (no strategy wraps them), as whole frozen replicas on every rank. FSDP2's :func:`shard_policy` and
FSDP's wrapping in ``strategy.setup`` both come after ``configure_model`` copied the reference; under ZeRO-3,
where ``configure_model`` itself runs inside ``deepspeed.zero.Init``, :func:`replicated_init_context` lets the
reference and reward models be built whole and :func:`pretrained_init_context` lets ``from_pretrained`` load the
policy into its partitions.

``deepspeed`` is imported only on the ZeRO-3 paths, ``torch.distributed.fsdp`` only on the FSDP ones.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import nn

from rloo_lightning.runtime import framework

__all__ = [
    "GenerationPath",
    "decoder_layers",
    "gathered_for_generation",
    "generation_path",
    "is_zero3",
    "pretrained_init_context",
    "replicated_init_context",
    "shard_policy",
]

GenerationPath = Literal["none", "fsdp2", "fsdp", "deepspeed_zero3"]


# -- which strategy ----------------------------------------------------------------------------------------------
def is_zero3(strategy: Any) -> bool:
    """True for a Lightning ``DeepSpeedStrategy`` whose config says ZeRO stage 3."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if not isinstance(strategy, DeepSpeedStrategy):
        return False
    config = getattr(strategy, "config", None) or {}
    return (config.get("zero_optimization") or {}).get("stage") == 3


def _fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _fsdp1_units(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]


def generation_path(model: nn.Module, strategy: Any = None) -> GenerationPath:
    """How :func:`gathered_for_generation` treats ``model``: by the strategy's type when there is one
    (``ModelParallelStrategy`` -> ``fsdp2``, ``FSDPStrategy`` -> ``fsdp``, ``DeepSpeedStrategy`` at stage 3 ->
    ``deepspeed_zero3``, ``SingleDeviceStrategy`` / ``DDPStrategy`` themselves -> ``none``), else (no strategy, or
    another one) by what the model holds (FSDP2 modules, FSDP units, ZeRO-3 partitioned parameters)."""
    from lightning.pytorch.strategies import (
        DDPStrategy,
        DeepSpeedStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
        SingleDeviceStrategy,
    )

    if isinstance(strategy, DeepSpeedStrategy):
        return "deepspeed_zero3" if is_zero3(strategy) else "none"  # ZeRO-1/2: whole parameters everywhere
    if isinstance(strategy, FSDPStrategy):
        return "fsdp"
    if isinstance(strategy, ModelParallelStrategy):
        return "fsdp2"
    if type(strategy) in (SingleDeviceStrategy, DDPStrategy):
        return "none"  # whole parameters on every rank; and no scan of every module and parameter, twice a step
    if _fsdp2_modules(model):
        return "fsdp2"
    if _fsdp1_units(model):
        return "fsdp"
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return "deepspeed_zero3"
    return "none"


# -- FSDP2 -------------------------------------------------------------------------------------------------------
def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face causal LM: the modules whose class is named in the model's
    ``_no_split_modules`` (``LlamaDecoderLayer``, ``Qwen2DecoderLayer``, ...), else the children of the first
    ``nn.ModuleList`` (``model.model.layers``)."""
    names = set(framework.no_split_modules(model) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if layers:
        return layers
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0:
            return list(m)
    return []


def shard_policy(policy: nn.Module, device_mesh: Any, **fully_shard_kwargs: Any) -> nn.Module:
    """FSDP2: ``fully_shard`` each decoder layer, then the whole policy (the root: embeddings, final norm and a
    tied LM head share its group), over the ``data_parallel`` dimension of Lightning's device mesh.

    Call it in ``configure_model`` after anything that must see whole parameters (the reference copy).
    ``fully_shard_kwargs`` go to every call (``mp_policy``, ``offload_policy``, ``reshard_after_forward``).
    A ``tensor_parallel`` dimension larger than 1 is refused: RLOOModule has no tensor-parallel plan, and the
    ranks of such a dimension would sample the same prompts (the sampler shards over ``data_parallel`` only).
    """
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh
    names = tuple(getattr(device_mesh, "mesh_dim_names", None) or ())
    if "tensor_parallel" in names and device_mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            f"ModelParallelStrategy with tensor_parallel_size={device_mesh['tensor_parallel'].size()}: RLOOModule "
            "shards the policy with FSDP2 over the data-parallel dimension only; set "
            "`tensor_parallel_size: 1` and `data_parallel_size` to the number of processes (devices x nodes)"
        )
    if "data_parallel" in names:
        mesh = device_mesh["data_parallel"]
    layers = decoder_layers(policy)
    if not layers:
        raise ValueError(f"no decoder layers found in {type(policy).__name__} to shard (no _no_split_modules, "
                         "no ModuleList)")
    for layer in layers:
        fully_shard(layer, mesh=mesh, **fully_shard_kwargs)
    fully_shard(policy, mesh=mesh, **fully_shard_kwargs)
    return policy


@contextlib.contextmanager
def _fsdp2_gathered(model: nn.Module) -> Iterator[None]:
    modules = _fsdp2_modules(model)
    if not modules:
        yield
        return
    if modules[0] is model:
        # What the root's first forward would do anyway: settle FSDP's default that the root keeps its
        # parameters after forward, before the setting is changed below and restored afterwards.
        framework.fsdp2_lazy_init(model)
    with framework.fsdp2_reshard_settings_restored(modules):  # and the parameters resharded after
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
        for m in modules:  # one all-gather per FSDP module, in module order: the same on every rank
            m.unshard()
        yield


# -- FSDP (FSDP1, Lightning's FSDPStrategy) ----------------------------------------------------------------------
@contextlib.contextmanager
def _fsdp1_gathered(model: nn.Module) -> Iterator[None]:
    """``summon_full_params`` on the policy (not on the strategy's root wrapper: ``training_step`` runs inside
    the root's forward, where FSDP refuses to unshard it; the root's own parameters are unsharded for that
    forward already). Inside it each unit's forward would still free its parameters afterwards (FULL_SHARD /
    HYBRID_SHARD reshard after forward), so they are switched to the keep-after-forward variant meanwhile."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    handles = framework.fsdp1_handles(_fsdp1_units(model))
    if not handles:
        yield
        return
    with FullyShardedDataParallel.summon_full_params(model, writeback=False, recurse=True):
        with framework.fsdp1_params_kept_after_forward(handles):
            yield


# -- DeepSpeed ZeRO-3 --------------------------------------------------------------------------------------------
def _zero3_offload(engine: Any) -> Any:
    """The object holding ZeRO-3's module hooks (``forward_hooks``/``backward_hooks``), or None."""
    optimizer = getattr(engine, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", None) or optimizer
    return offload if offload is not None and hasattr(offload, "forward_hooks") else None


def _ds_params(module: nn.Module) -> list[nn.Parameter]:
    params = list(module.parameters(recurse=True))
    for m in module.modules():
        external = getattr(m, "ds_external_parameters", None)
        if callable(external):
            params += [p for _, p in external()]
    return params


def _remove_zero3_hooks(offload: Any) -> None:
    for p in _ds_params(offload.module):
        active = getattr(p, "ds_active_sub_modules", None)
        if active is not None:
            active.clear()
    for hook in list(offload.forward_hooks) + list(offload.backward_hooks):
        hook.remove()
    offload.forward_hooks = []
    offload.backward_hooks = []


def _add_zero3_hooks(offload: Any) -> None:
    framework.zero3_register_hooks(offload)


@contextlib.contextmanager
def _generate_defaults(model: nn.Module, **kwargs: Any) -> Iterator[None]:
    """``model.generate`` called with ``kwargs`` added (an instance attribute shadowing the method, removed after)."""
    had_own = "generate" in vars(model)
    own = vars(model).get("generate")
    model.generate = functools.partial(model.generate, **kwargs)
    try:
        yield
    finally:
        if had_own:
            model.generate = own
        else:
            del model.generate


@contextlib.contextmanager
def _zero3_gathered(model: nn.Module, strategy: Any, gather: bool) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if gather:
            import deepspeed

            offload = _zero3_offload(getattr(strategy, "model", None))
            # One all-gather of the whole policy (read-only: modifier_rank=None, nothing is written back)
            stack.enter_context(deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None))
            if offload is not None:
                # Else each module's post-forward hook would release (re-partition) what was just gathered.
                _remove_zero3_hooks(offload)
                stack.callback(_add_zero3_hooks, offload)  # runs before the parameters are re-partitioned
        # Explicit: transformers detects ZeRO-3 only through its own HfDeepSpeedConfig, which Lightning does not
        # create. With the hooks removed it costs one scalar all-reduce per token and no deadlock if a
        # DeepSpeed version still fetches something inside a forward; without gathering it is what keeps a
        # finished rank stepping (and serving its all-gathers) until every rank is done.
        stack.enter_context(_generate_defaults(model, synced_gpus=True))
        yield


@contextlib.contextmanager
def pretrained_init_context(strategy: Any) -> Iterator[None]:
    """Around the policy's ``from_pretrained`` in ``configure_model``. Under ZeRO-3 (where Lightning runs
    ``configure_model`` inside ``deepspeed.zero.Init``) a ``transformers.integrations.HfDeepSpeedConfig`` is
    kept alive meanwhile, so that transformers builds the model partitioned and loads each checkpoint tensor
    into its partitions (instead of building it on the meta device); it is dropped afterwards, so that models
    loaded later (reference, reward models) are not partitioned. A no-op for every other strategy."""
    if not is_zero3(strategy):
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    config = HfDeepSpeedConfig(strategy.config)  # the global weakref lives as long as this reference
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del config


@contextlib.contextmanager
def replicated_init_context(strategy: Any) -> Iterator[None]:
    """Around building a model that must stay whole on every rank (the frozen reference, reward models) inside
    ``configure_model``: under ZeRO-3 Lightning's ``deepspeed.zero.Init`` is suspended meanwhile (it would
    partition every module built there, and nothing would gather those for their forwards). A no-op otherwise."""
    if not is_zero3(strategy):
        yield
        return
    from deepspeed.zero.partition_parameters import restore_init_context, shutdown_init_context

    shutdown_init_context()
    try:
        yield
    finally:
        restore_init_context()


# -- the entry point ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def gathered_for_generation(model: nn.Module, strategy: Any = None, gather: bool = True) -> Iterator[None]:
    """Gather ``model``'s parameters once around a ``generate`` call, so that nothing inside it is a collective
    and ranks that stop at different lengths cannot deadlock (see the module docstring for each strategy).

    Args:
        model: the Hugging Face causal LM that ``generate`` is called on (not a strategy wrapper).
        strategy: the trainer's strategy, if any; picks the path (:func:`generation_path`).
        gather: False keeps a sharded policy sharded during generation (the memory of one shard instead of
            the whole model, for a policy that does not fit whole on one device) and passes
            ``synced_gpus=True`` instead: every forward gathers its layers again, and a rank that has finished
            keeps stepping (with dummy forwards) until all have, so that the collectives still pair up.

    A no-op for unsharded models (DDP, ZeRO-1/2, one process). Every rank must enter it (the gathers are
    collectives); it runs under ``torch.no_grad``.
    """
    path = generation_path(model, strategy)
    with torch.no_grad(), contextlib.ExitStack() as stack:
        if path in ("fsdp2", "fsdp"):
            if gather:
                stack.enter_context(_fsdp2_gathered(model) if path == "fsdp2" else _fsdp1_gathered(model))
            # Explicit either way. Gathered: nothing inside generate needs the other ranks, while transformers
            # would turn synced_gpus on by itself for FSDP2 (fully_shard marks the modules it shards) and cost a
            # scalar all-reduce per token. Not gathered: it is what keeps the per-forward all-gathers paired
            # (transformers does not detect the FSDP1 units inside an unwrapped policy).
            stack.enter_context(_generate_defaults(model, synced_gpus=not gather))
        elif path == "deepspeed_zero3":
            stack.enter_context(_zero3_gathered(model, strategy, gather=gather))
        yield
