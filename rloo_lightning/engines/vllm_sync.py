"""The pieces of :class:`~rloo_lightning.engines.vllm_server.VLLMServerEngine`'s weight sync that need no server: the
weights rank 0 writes (:func:`weights_to_write`) and the folder it writes them into (:func:`write_sync_folder`,
:func:`memory_folder`), the canary that verifies a load (:class:`Canary`, :func:`canary_ids`,
:func:`canary_logprobs`), and how a sync ends on every rank alike (:class:`Published`, :func:`agreed`).

A sync is numbered by ``sync_id`` (1, 2, ... in a run) and named on the servers by its ``tag``,
``"<run>:<sync_id>"``. It is not an optimizer step: the policy is synced when it changed (after an optimizer step,
and at the start of each fit / validate / test / predict), so counts of syncs and of steps differ.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import torch
from torch import Tensor

from rloo_lightning.engines.vllm_common import named_weights

__all__ = ["Canary", "Published", "agreed", "canary_ids", "canary_logprobs", "memory_folder",
           "remove_older_syncs", "sampled_canary", "sync_folder", "weights_to_write", "world", "write_sync_folder"]

_CANARY_SEED = 20240214


@dataclass(frozen=True)
class Canary:
    """A fixed token sequence and the trainer's log-probs of each token after the first: a server's must match.

    An adapter sync's canary (``rows`` set) is checked on tokens the server samples instead, at the end of a few
    prefixes of the sequence: vLLM (0.32) computes the prompt log-probs of a request under a LoRA adapter wrongly, or
    fails, when other requests share its batch, as the rows of earlier syncs do while an adapter sync loads
    (``keeps_versions``). ``rows`` ``[len(prefixes), V]``: the trainer's log-probs of every token after each prefix."""

    ids: list[int]
    logprobs: list[float]
    prefixes: tuple[int, ...] = ()
    rows: Tensor | None = None


@dataclass(frozen=True)
class Published:
    """A sync as rank 0 wrote and loaded it: broadcast to every rank, so that each knows the current folder."""

    folder: str  # where the weights are (a restarted server loads them from there)
    tag: str  # its name on the servers, "<run>:<sync_id>"
    sync_id: int  # 1, 2, ... in this run
    tensors: int  # what the file holds, which a server's load must match
    bytes: int
    load_s: float = 0.0  # the slowest server's own load
    seconds: float = 0.0  # rank 0's write, loads and checks
    adapter: str | None = None  # an adapter sync (lora_sync: adapter): the adapter's name on the servers
    base: Published | None = None  # and the base it adapts (bytes: what this sync wrote, the base at the first)
    canary: Canary | None = None  # the trainer's log-probs of the canary at this sync (a reload is verified by it)


def world() -> tuple[int, int]:
    """``(world size, rank)`` of the process group (``(1, 0)`` without one)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


def agreed(outcome: Published | str | None, world_size: int) -> Published | str | None:
    """How a sync ends, the same on every rank (one gather; ``outcome`` itself with one process). Each rank gives
    its ``outcome``: rank 0 the :class:`Published` sync, or a failure's line; another rank "" (its part went well),
    a failure's line (its requests before the sync failed: held, so that no rank waits for it in a collective), or
    None (a stop signal ended its wait). Any failure: the failures' lines (each with its rank when they differ);
    else None if any rank was stopped; else rank 0's sync."""
    if world_size == 1:
        return outcome
    every: list = [None] * world_size
    torch.distributed.all_gather_object(every, outcome)
    failed = {rank: o for rank, o in enumerate(every) if isinstance(o, str) and o}
    if failed:
        lines = set(failed.values())
        return lines.pop() if len(lines) == 1 else "; ".join(f"rank {r}: {line}" for r, line in failed.items())
    return None if any(o is None for o in every) else every[0]


def weights_to_write(model, rank: int, merged: bool = True) -> dict[str, Tensor]:
    """The policy's weights on the CPU for rank 0's file (empty on another rank), a LoRA policy's merged unless
    ``merged`` is False (the base alone). Every rank calls this at the same point: a gather under FSDP2 walks every
    weight on every rank."""
    weights, seen = {}, set()
    for name, tensor in named_weights(model, merged=merged):
        if rank == 0:
            # No copy where the policy already is on the CPU: nothing changes the weights until the file is written
            # (the sync runs before the step's rollout, after its optimizer step). A tensor that shares another's
            # memory (tied embeddings) is copied: a file holds each once. Each is written: vLLM's reload needs
            # lm_head.weight even where it ties it (the canary caught a sync without).
            tensor = tensor.to("cpu").contiguous()
            weights[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
            seen.add(tensor.data_ptr())
    return weights


def memory_folder(size: int) -> str | None:
    """``/dev/shm`` when it has room for three copies of ``size`` bytes of weights (a memory file system: a file
    written there never waits for a disk; on a disk, 621 MB written every step made the write stall for 0.3–6 s as
    the kernel flushed the previous ones), else None (the system's temporary folder)."""
    try:
        return "/dev/shm" if shutil.disk_usage("/dev/shm").free > 3 * size else None
    except OSError:
        return None


def _sync_prefix(run: str) -> str:
    return f"{run}-sync"


def sync_folder(root: str, run: str, sync_id: int) -> str:
    """The folder of sync ``sync_id`` of ``run`` under ``root``."""
    return os.path.join(root, f"{_sync_prefix(run)}{sync_id:06d}")


def write_sync_folder(root: str, run: str, sync_id: int, tag: str, weights: dict[str, Tensor]) -> str:
    """Write ``weights`` as one safetensors file into a new folder under ``root``, atomically (a partial folder is
    never named); the folder."""
    from safetensors.torch import save_file

    folder = sync_folder(root, run, sync_id)
    partial = folder + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    save_file(weights, os.path.join(partial, "model.safetensors"), metadata={"sync": tag})
    os.replace(partial, folder)
    return folder


def remove_older_syncs(root: str, run: str, keep: list[str]) -> None:
    """Remove this run's sync folders in ``root`` but those of ``keep``: a restarted server loads those only (the
    current sync, and the adapters of requests still in flight)."""
    for old in os.listdir(root):
        if old.startswith(_sync_prefix(run)) and os.path.join(root, old) not in keep:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def canary_ids(vocab_size: int, length: int) -> list[int]:
    """The canary's tokens: ``length`` ids drawn from a fixed seed (the same on every rank and run)."""
    generator = torch.Generator().manual_seed(_CANARY_SEED)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def _canary_table(model, ids: list[int]) -> Tensor:
    """``[len(ids) - 1, V]`` the policy's log-probs of the next token after each prefix of ``ids`` (eval mode, the
    weights' own precision: autocast off, as the server computes in its dtype, not in a mixed-precision trainer's)."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.autocast(device.type, enabled=False):
            logits = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits[0, :-1].float()
    finally:
        model.train(was_training)
    return torch.log_softmax(logits, -1)


def canary_logprobs(model, ids: list[int]) -> list[float]:
    """The policy's log-probs of ``ids[1:]`` given the tokens before each."""
    table = _canary_table(model, ids)
    return table.gather(-1, torch.tensor(ids[1:], device=table.device)[:, None])[:, 0].tolist()


def sampled_canary(model, ids: list[int], positions: int = 8) -> Canary:
    """An adapter sync's canary (see :class:`Canary`): ``positions`` prefixes of ``ids`` spread over its length, and
    the policy's log-probs of every token after each."""
    last = len(ids) - 1
    prefixes = tuple(sorted({1 + i * (last - 1) // max(1, positions - 1) for i in range(min(positions, last))}))
    table = _canary_table(model, ids)
    return Canary(ids, [], prefixes, table[[p - 1 for p in prefixes]].cpu())
