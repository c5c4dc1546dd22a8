"""How much room a fit's checkpoints need, checked before its first step (:meth:`FinalCheckpoint.check_space`)."""

from __future__ import annotations

import os

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from rloo_lightning.runtime import framework
from rloo_lightning.runtime.atomic_checkpoint import MB, free_bytes, nearest_existing
from rloo_lightning.runtime.checkpoint_check import optimizer_state_ratio

__all__ = ["checkpoint_bytes", "space_problem", "is_local", "same_path", "LAST"]

LAST = "last.ckpt"


def checkpoint_bytes(trainer: Trainer, pl_module: LightningModule) -> int:
    """About how many bytes a checkpoint of this fit holds, before its first step: a lower bound.

    The trainable parameters, each with its optimizer's state (:func:`optimizer_state_ratio`: AdamW's two moments
    make a parameter count 3 times; the state itself exists only after a first step), and the persistent buffers.
    Whole sizes on every rank: a DTensor's (FSDP2) is its global size, a ZeRO-3 parameter's its ``ds_numel``;
    under ``FSDPStrategy`` (FSDP1, whose parameters are this rank's shards) the ranks' sums are added up (a
    collective). Not counted: frozen parameters (LoRA's base is not saved; a frozen part another module saves makes
    the estimate low), the pickled structure and small entries, a reference model saved under
    ``kl.ref_sync_steps`` (estimated against written, measured: see ``docs/reliability.md``, "A full disk").
    """
    from lightning.pytorch.strategies import FSDPStrategy

    ratios: dict[int, float] = {}
    for optimizer in trainer.optimizers:
        ratio = optimizer_state_ratio(optimizer)
        for group in optimizer.param_groups:
            for param in group["params"]:
                ratios[id(param)] = max(ratio, ratios.get(id(param), 0.0))
    fsdp1 = isinstance(trainer.strategy, FSDPStrategy)
    whole = shards = 0.0
    for param in pl_module.parameters():
        if not param.requires_grad:
            continue
        numel = getattr(param, "ds_numel", None)  # DeepSpeed ZeRO-3: a placeholder here, ds_numel is the whole
        nbytes = (param.numel() if numel is None else numel) * param.element_size() * (1 + ratios.get(id(param), 0.0))
        if fsdp1 and numel is None:
            shards += nbytes
        else:
            whole += nbytes
    seen: set[int] = set()
    for module in pl_module.modules():
        for _, buffer in framework.persistent_buffers(module):
            if buffer is not None and id(buffer) not in seen:
                seen.add(id(buffer))
                whole += buffer.numel() * buffer.element_size()
    if fsdp1:
        total = torch.tensor(shards, dtype=torch.float64, device=trainer.strategy.root_device)
        shards = float(trainer.strategy.reduce(total, reduce_op="sum"))
    return int(whole + shards)


def space_problem(trainer: Trainer, folder: str, size: int) -> str | None:
    """Why the filesystem of ``folder`` cannot take this fit's checkpoints (see :meth:`FinalCheckpoint.check_space`),
    or None."""
    device = os.stat(nearest_existing(folder)).st_dev
    others, folders = 0, {os.path.realpath(folder)}
    validating = trainer.limit_val_batches != 0
    for cb in trainer.checkpoint_callbacks:
        if not isinstance(cb, ModelCheckpoint) or cb.dirpath is None or "://" in str(cb.dirpath):
            continue
        path = str(cb.dirpath)
        if os.stat(nearest_existing(path)).st_dev != device:
            continue  # another filesystem's space is its own
        saves = validating or framework.saves_within_epoch(cb)
        if not saves:
            continue  # only at an epoch's end, which this fit may never reach: left out, the estimate stays low
        folders.add(os.path.realpath(path))
        others += max(cb.save_top_k, 1) if cb.save_top_k != 0 else 0  # -1 (keep all): at least one
        own_last = os.path.join(path, cb.CHECKPOINT_NAME_LAST + cb.FILE_EXTENSION)
        if cb.save_last is True and not same_path(own_last, os.path.join(folder, LAST)):
            others += 1
    at_once = 1 + others + 1  # last.ckpt, the ModelCheckpoints' files, the one being written beside them
    there = sum(_tree_bytes(entry.path) for path in folders if os.path.isdir(path)
                for entry in os.scandir(path) if entry.name.endswith(".ckpt"))
    need = max(size, at_once * size - there)
    free = free_bytes(folder)
    if free >= need:
        return None
    kept = f"last.ckpt, {others} kept by ModelCheckpoint" if others else "last.ckpt"
    less = f", less {there / MB:.1f} MB of checkpoints already there" if there else ""
    return (f"not enough space in {folder} for this fit's checkpoints: {free / MB:.1f} MB free, ~{need / MB:.1f} MB "
            f"needed (a checkpoint of ~{size / MB:.1f} MB, {at_once} at once: {kept} and the next one written beside "
            f"them{less}); free some space or write checkpoints elsewhere (trainer.default_root_dir)")


def _tree_bytes(path: str) -> int:
    """Bytes of a checkpoint file, or of a sharded checkpoint folder's files."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def same_path(a: str | None, b: str | None) -> bool:
    if not a or not b:
        return False
    return os.path.realpath(a) == os.path.realpath(b)
