"""The one seam to the private APIs of the libraries the package runs on: what to mend on an upgrade.

Every use of a private name (``_name``) of Lightning, LightningCLI, jsonargparse / argparse, TensorBoard, torch
(FSDP, the c10d store, ``nn.Module`` internals, fused ops), DeepSpeed, tqdm, Hugging Face datasets and
transformers, and the standard library's ``multiprocessing``, goes through a function of this module; its
docstring names the private API it wraps and the versions it was tested with. ``tests/test_framework.py``
exercises each function against the installed libraries (a vanished API fails there, named) and checks that no
other module of the package reaches a private name of these libraries itself.

Tested with: Lightning 2.6.6 (``lightning>=2.6.4,<2.7`` in ``pyproject.toml``), jsonargparse 4.53.0, torch 2.13.0,
TensorBoard 2.21.0, tqdm 4.70.1, datasets 5.2.0, transformers 5.25.0, Python 3.11; DeepSpeed is not installed
where the tests run (:func:`zero3_register_hooks` is tested with stand-ins).

Known dependencies that cannot pass through a function here (a subclass overriding a private method); the tests
check that the base class still has each, and still calls it:

* ``LightningCLI._parse_ckpt_path`` (Lightning 2.6.6), overridden by ``rloo_lightning.cli.RLOOCLI`` to do
  nothing: the checkpoint's options are applied as parser defaults in ``RLOOCLI.parse_arguments`` instead. Were
  Lightning to rename it, its own loader would run again and override the options given.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable

__all__ = [
    "OVERRIDDEN_PRIVATE_METHODS", "callbacks_state", "checkpoint_io_of", "cli_get", "cli_parser",
    "cli_subcommand_parsers", "dataset_fingerprint", "default_store", "foreach_norm", "forkserver_preload_modules",
    "fsdp1_handles", "fsdp1_params_kept_after_forward", "fsdp2_lazy_init", "fsdp2_reshard_settings_restored",
    "fsdp_state_dict_type", "is_wrapping_checkpoint_io", "last_saved_step", "loops_state", "mark_sigterm_received",
    "mkldnn_bf16_supported", "module_trainer", "no_split_modules", "parser_actions", "persistent_buffers",
    "save_checkpoint_edited", "saves_distributed_checkpoint", "saves_within_epoch", "set_sigterm_notifier",
    "set_wrapped_checkpoint_io", "tensorboard_available", "tensorboard_scalars_event", "tqdm_bar", "tqdm_bars",
    "tqdm_leave", "tqdm_should_update", "zero3_register_hooks",
]

# (base class path, method) a class of this package overrides: see the module docstring.
OVERRIDDEN_PRIVATE_METHODS = (("lightning.pytorch.cli.LightningCLI", "_parse_ckpt_path"),)


# -- Lightning: the trainer and its connectors -------------------------------------------------------------------
def set_sigterm_notifier(trainer: Any, fn: Callable[[int, Any], None]) -> None:
    """``fn`` in place of Lightning's SIGTERM notifier, which the trainer registers when its run starts (a
    trainer without a signal connector: nothing). Wraps ``Trainer._signal_connector._sigterm_notifier_fn``
    (Lightning 2.6.6)."""
    connector = getattr(trainer, "_signal_connector", None)
    if connector is not None:
        connector._sigterm_notifier_fn = fn


def mark_sigterm_received(trainer: Any) -> None:
    """Set Lightning's own "SIGTERM received" flag, so that its stops at a batch's end apply (a trainer without a
    signal connector: nothing). Wraps ``Trainer._signal_connector.received_sigterm`` (Lightning 2.6.6)."""
    if getattr(trainer, "_signal_connector", None) is not None:
        trainer._signal_connector.received_sigterm = True


def loops_state(trainer: Any) -> dict:
    """The loops' state as a checkpoint written now holds it (``fit_loop``, ``validate_loop``, ...; not a copy).
    Wraps ``Trainer._checkpoint_connector._get_loops_state_dict()`` (Lightning 2.6.6)."""
    return trainer._checkpoint_connector._get_loops_state_dict()


def callbacks_state(trainer: Any) -> dict:
    """The callbacks' states as a checkpoint written now holds them (keyed by ``state_key``; not a copy). Wraps
    ``lightning.pytorch.trainer.call._call_callbacks_state_dict`` (Lightning 2.6.6)."""
    from lightning.pytorch.trainer import call

    return call._call_callbacks_state_dict(trainer)


def save_checkpoint_edited(trainer: Any, filepath: Any, edit: Callable[[dict], None]) -> None:
    """``trainer.save_checkpoint(filepath, weights_only=False)`` with ``edit(checkpoint)`` applied between the
    checkpoint's making (every ``on_save_checkpoint`` hook has run) and its writing: the same steps, in the same
    order. Wraps ``Trainer._checkpoint_connector.dump_checkpoint`` (Lightning 2.6.6), as
    ``Trainer.save_checkpoint`` calls it."""
    with trainer.profiler.profile("save_checkpoint"):
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(False)
        edit(checkpoint)
        trainer.strategy.save_checkpoint(checkpoint, filepath, storage_options=None)
        trainer.strategy.barrier("Trainer.save_checkpoint")


def module_trainer(module: Any) -> Any:
    """The trainer ``module`` is attached to, or None (``LightningModule.trainer`` raises then). Wraps
    ``LightningModule._trainer`` (Lightning 2.6.6)."""
    return module._trainer


def last_saved_step(checkpoint: Any) -> int | None:
    """The global step of the last checkpoint a ``ModelCheckpoint`` wrote (None if unknown). Wraps
    ``ModelCheckpoint._last_global_step_saved`` (Lightning 2.6.6)."""
    return getattr(checkpoint, "_last_global_step_saved", None)


def saves_within_epoch(checkpoint: Any) -> Any:
    """A truthy value when a ``ModelCheckpoint`` saves every n training steps or every time interval (not only at
    an epoch's end): ``every_n_train_steps``, else ``train_time_interval``. Wraps
    ``ModelCheckpoint._every_n_train_steps`` and ``._train_time_interval`` (Lightning 2.6.6)."""
    return getattr(checkpoint, "_every_n_train_steps", 0) or getattr(checkpoint, "_train_time_interval", None)


def checkpoint_io_of(strategy: Any) -> Any:
    """The checkpoint IO plugin set on ``strategy``, or None when none is yet (the public ``checkpoint_io``
    property would make a default one). Wraps ``Strategy._checkpoint_io`` (Lightning 2.6.6)."""
    return getattr(strategy, "_checkpoint_io", None)


def is_wrapping_checkpoint_io(io: Any) -> bool:
    """Whether ``io`` wraps another checkpoint IO (``AsyncCheckpointIO``). Wraps
    ``lightning.pytorch.plugins.io.wrapper._WrappingCheckpointIO`` (Lightning 2.6.6)."""
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

    return isinstance(io, _WrappingCheckpointIO)


def set_wrapped_checkpoint_io(io: Any, inner: Any) -> None:
    """Replace the checkpoint IO that the wrapper ``io`` wraps (its ``checkpoint_io`` setter only fills an empty
    slot). Wraps ``_WrappingCheckpointIO._checkpoint_io`` (Lightning 2.6.6)."""
    io._checkpoint_io = inner


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """Whether a ``ModelParallelStrategy`` saves a torch.distributed.checkpoint folder (its
    ``save_distributed_checkpoint`` argument). Wraps ``ModelParallelStrategy._save_distributed_checkpoint``
    (Lightning 2.6.6)."""
    return bool(getattr(strategy, "_save_distributed_checkpoint", True))


def fsdp_state_dict_type(strategy: Any) -> str:
    """An ``FSDPStrategy``'s ``state_dict_type``: ``full`` or ``sharded``. Wraps ``FSDPStrategy._state_dict_type``
    (Lightning 2.6.6)."""
    return getattr(strategy, "_state_dict_type", "full")


# -- Lightning: TQDMProgressBar's internals (for its subclass StepProgressBar) ------------------------------------
_TQDM_BARS = {"train": "_train_progress_bar", "val": "_val_progress_bar", "test": "_test_progress_bar",
              "predict": "_predict_progress_bar"}


def tqdm_bar(callback: Any, stage: str) -> Any:
    """The tqdm bar of ``stage`` (``train``, ``val``, ``test`` or ``predict``) of a ``TQDMProgressBar``, or None
    (its public properties raise then). Wraps ``TQDMProgressBar._<stage>_progress_bar`` (Lightning 2.6.6)."""
    if stage not in _TQDM_BARS:
        raise ValueError(f"no tqdm bar for stage {stage!r}: one of {tuple(_TQDM_BARS)}")
    return getattr(callback, _TQDM_BARS[stage])


def tqdm_leave(callback: Any) -> bool:
    """A ``TQDMProgressBar``'s ``leave`` argument. Wraps ``TQDMProgressBar._leave`` (Lightning 2.6.6)."""
    return callback._leave


def tqdm_should_update(callback: Any, n: int, total: Any) -> bool:
    """Whether a ``TQDMProgressBar`` redraws a bar at count ``n`` of ``total`` (its refresh rate, and always at the
    end). Wraps ``TQDMProgressBar._should_update`` (Lightning 2.6.6)."""
    return callback._should_update(n, total)


# -- LightningCLI and its parsers (jsonargparse, argparse) -------------------------------------------------------
def cli_get(cli: Any, config: Any, key: str, default: Any = None) -> Any:
    """The value of ``key`` in a LightningCLI ``config``, under the subcommand's section when there is one. Wraps
    ``LightningCLI._get`` (Lightning 2.6.6)."""
    return cli._get(config, key, default=default)


def cli_parser(cli: Any, subcommand: str | None) -> Any:
    """The parser of ``subcommand`` (the main parser for None). Wraps ``LightningCLI._parser`` (Lightning 2.6.6)."""
    return cli._parser(subcommand)


def cli_subcommand_parsers(cli: Any) -> dict:
    """``{subcommand: parser}``; empty before the parsers are made, or without subcommands (``run=False``). Wraps
    ``LightningCLI._subcommand_parsers`` (Lightning 2.6.6)."""
    return getattr(cli, "_subcommand_parsers", {})


def parser_actions(parser: Any) -> list:
    """The actions (options) of an argument parser. Wraps ``argparse.ArgumentParser._actions``, which
    jsonargparse's ``ArgumentParser`` inherits (Python 3.11, jsonargparse 4.53.0)."""
    return parser._actions


# -- TensorBoard ---------------------------------------------------------------------------------------------------
def tensorboard_available() -> bool:
    """Whether Lightning's ``TensorBoardLogger`` can write here (``tensorboard`` or ``tensorboardX`` installed), as
    Lightning decides its default logger. Wraps ``lightning.fabric.loggers.tensorboard._TENSORBOARD_AVAILABLE``
    and ``_TENSORBOARDX_AVAILABLE`` (Lightning 2.6.6)."""
    from lightning.fabric.loggers.tensorboard import _TENSORBOARD_AVAILABLE, _TENSORBOARDX_AVAILABLE

    return bool(_TENSORBOARD_AVAILABLE or _TENSORBOARDX_AVAILABLE)


def tensorboard_scalars_event(logger: Any, writer: Any, values: dict[str, float], step: int) -> None:
    """All of ``values`` as one event of torch's ``SummaryWriter`` ``writer`` (the ``logger``'s experiment), under
    the tags that ``logger.log_metrics`` gives them (its prefix). Wraps ``TensorBoardLogger._prefix`` (Lightning
    2.6.6), ``SummaryWriter._get_file_writer()`` (torch 2.13.0) and TensorBoard's ``Summary`` protocol buffer
    (``tensorboard.compat.proto.summary_pb2``, TensorBoard 2.21.0)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    prefix = f"{logger._prefix}{logger.LOGGER_JOIN_CHAR}" if logger._prefix else ""  # as its log_metrics prefixes
    summary = Summary(value=[Summary.Value(tag=prefix + name, simple_value=v) for name, v in values.items()])
    writer._get_file_writer().add_summary(summary, step)


# -- torch ---------------------------------------------------------------------------------------------------------
def default_store() -> Any:
    """The default process group's key-value store (raises when there is none). Wraps
    ``torch.distributed.distributed_c10d._get_default_store`` (torch 2.13.0)."""
    import torch

    return torch.distributed.distributed_c10d._get_default_store()


def persistent_buffers(module: Any) -> list[tuple[str, Any]]:
    """``module``'s own buffers (not its children's) that its ``state_dict`` holds: ``(name, buffer)``, a buffer
    may be None. Wraps ``nn.Module._buffers`` and ``._non_persistent_buffers_set`` (torch 2.13.0)."""
    return [(name, buffer) for name, buffer in module._buffers.items()
            if name not in module._non_persistent_buffers_set]


def foreach_norm(tensors: list, ord: float) -> list:
    """Each tensor's ``ord``-norm, in one fused op for all of them. Wraps ``torch._foreach_norm`` (torch 2.13.0)."""
    import torch

    return torch._foreach_norm(tensors, ord=ord)


def mkldnn_bf16_supported() -> bool:
    """Whether oneDNN has native bf16 kernels on this CPU (raises AttributeError or RuntimeError where torch
    cannot tell). Wraps ``torch.ops.mkldnn._is_mkldnn_bf16_supported`` (torch 2.13.0)."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def fsdp2_lazy_init(module: Any) -> None:
    """Run the lazy initialisation FSDP2 does at the root module's first forward (where the state has it). Wraps
    ``FSDPModule._get_fsdp_state()`` and ``FSDPState._lazy_init`` (torch 2.13.0)."""
    state = module._get_fsdp_state()
    if hasattr(state, "_lazy_init"):
        state._lazy_init()


@contextlib.contextmanager
def fsdp2_reshard_settings_restored(modules: list) -> Iterator[None]:
    """Inside: the FSDP2 ``modules``' reshard-after-forward settings may be changed and their parameters gathered;
    after: each setting is as before, and the parameter groups that were sharded before are resharded (which frees
    the gathered parameters: no collective). Wraps ``FSDPModule._get_fsdp_state()``, ``FSDPState._fsdp_param_groups``
    and ``._auto_reshard_after_forward``, and ``FSDPParamGroup.post_forward_mesh_info`` / ``.is_unsharded`` /
    ``.reshard()`` (torch 2.13.0)."""
    saved = []
    for m in modules:
        state = m._get_fsdp_state()
        groups = [(g, g.post_forward_mesh_info, g.is_unsharded) for g in state._fsdp_param_groups]
        saved.append((state, state._auto_reshard_after_forward, groups))
    try:
        yield
    finally:
        for state, auto, groups in saved:
            state._auto_reshard_after_forward = auto
            for group, mesh_info, was_unsharded in groups:
                group.post_forward_mesh_info = mesh_info
                if not was_unsharded:
                    group.reshard()  # frees the gathered parameters: no collective


def fsdp1_handles(units: list) -> list:
    """The flat-parameter handles of FSDP1 ``units`` (``FullyShardedDataParallel`` modules) that have one. Wraps
    ``FullyShardedDataParallel._handle`` (torch 2.13.0)."""
    return [u._handle for u in units if getattr(u, "_handle", None) is not None]


@contextlib.contextmanager
def fsdp1_params_kept_after_forward(handles: list) -> Iterator[None]:
    """Inside: the FSDP1 ``handles`` use the variant of their sharding strategy that keeps the parameters after
    forward (FULL_SHARD as SHARD_GRAD_OP, HYBRID_SHARD as its ZeRO-2 variant); after: their own again. Wraps
    ``torch.distributed.fsdp._flat_param.HandleShardingStrategy`` (with its ``_HYBRID_SHARD_ZERO2``) and
    ``FlatParamHandle._sharding_strategy`` (torch 2.13.0)."""
    from torch.distributed.fsdp._flat_param import HandleShardingStrategy as S

    keep = {S.FULL_SHARD: S.SHARD_GRAD_OP, S.HYBRID_SHARD: S._HYBRID_SHARD_ZERO2}
    saved = [(h, h._sharding_strategy) for h in handles]
    try:
        for h, strategy in saved:
            h._sharding_strategy = keep.get(strategy, strategy)
        yield
    finally:
        for h, strategy in saved:
            h._sharding_strategy = strategy


# -- DeepSpeed -----------------------------------------------------------------------------------------------------
def zero3_register_hooks(offload: Any) -> None:
    """Register ZeRO-3's module hooks again on ``offload.module`` (after they were removed). Wraps DeepSpeed's
    ``DeepSpeedZeRoOffload._register_deepspeed_module`` (DeepSpeed >= 0.16.4), else its earlier
    ``_register_hooks_recursively`` (not installed where the tests run: tested with stand-ins)."""
    if hasattr(offload, "_register_deepspeed_module"):  # DeepSpeed >= 0.16.4
        offload._register_deepspeed_module(offload.module)
    else:
        offload._register_hooks_recursively(offload.module)


# -- tqdm, Hugging Face, the standard library --------------------------------------------------------------------
def tqdm_bars() -> list:
    """Every tqdm bar alive in this process (call it holding ``tqdm.get_lock()``). Wraps ``tqdm._instances``
    (tqdm 4.70.1)."""
    from tqdm import tqdm

    return list(getattr(tqdm, "_instances", []))


def dataset_fingerprint(dataset: Any) -> str | None:
    """A Hugging Face ``Dataset``'s fingerprint (what datasets keys its own cache on; None if it has none). Wraps
    ``Dataset._fingerprint`` (datasets 5.2.0)."""
    return getattr(dataset, "_fingerprint", None)


def no_split_modules(model: Any) -> list[str] | None:
    """The class names of a transformers model's blocks that must not be split (its decoder layers), or None.
    Wraps ``PreTrainedModel._no_split_modules`` (transformers 5.25.0)."""
    return getattr(model, "_no_split_modules", None)


def forkserver_preload_modules() -> list[str]:
    """The modules the forkserver is set to preload (``["__main__"]`` when none were set). Wraps
    ``multiprocessing.forkserver._forkserver._preload_modules`` (Python 3.11)."""
    from multiprocessing import forkserver

    return list(getattr(forkserver._forkserver, "_preload_modules", ["__main__"]))
