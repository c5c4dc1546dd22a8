"""The embedded-task record: :class:`Task` (a dataset, a reward and a tiny offline model builder)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch.utilities import rank_zero_info

from rloo_lightning.models.tiny import cache_dir

__all__ = ["Task", "segments_nll"]


@dataclass(frozen=True)
class Task:
    """An embedded task.

    Attributes:
        name: the name used in ``tiny:<name>`` and ``PromptDataModule(task=...)``.
        make_rows: ``(n, seed) -> rows``; each row has ``prompt`` and the columns its reward reads.
        reward: a reward function (see :mod:`rloo_lightning.rewards`).
        build_tiny_model: ``(directory) -> None``; saves a tokenizer and a warm-started model there
            (None for tasks meant for real pretrained models).
        version: bump when the builder or the rows change, so that stale caches (tiny models, prompt caches)
            are not reused.
        hold_out_prompts: remove validation rows whose prompt is a training prompt. False for a task whose
            prompt tells nothing about the row (the answer is hidden in a column), where every prompt repeats.
    """

    name: str
    make_rows: Callable[[int, int], list[dict]]
    reward: Callable[..., list[float | None]]
    build_tiny_model: Callable[[Path], None] | None
    version: int = 1
    hold_out_prompts: bool = True

    def tiny_model_dir(self) -> Path:
        """Build the tiny model once (atomically: concurrent ranks may race) and return its directory."""
        if self.build_tiny_model is None:
            raise ValueError(f"task {self.name!r} has no tiny model: use a real model with it")
        final = cache_dir() / f"tiny-{self.name}-v{self.version}"
        if (final / "config.json").exists():
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        # A warm start of seconds to minutes on a CPU, before anything else is said: one line says why the wait.
        rank_zero_info(f"tiny:{self.name}: building the task's tiny model (a short warm start on the CPU, done once: "
                       f"it is cached in {final})")
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        try:
            self.build_tiny_model(tmp)
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / "config.json").exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final


def warm_start(model, steps: int, lr: float, seed: int, batch_loss: Callable[[], torch.Tensor]) -> None:
    """A tiny model's supervised warm start: ``steps`` AdamW updates at ``lr``, each on a fresh ``batch_loss()``.

    Torch's RNG is seeded with ``seed`` inside and restored after, so that building a task's model neither
    depends on nor moves the caller's random state. The model is left in eval mode.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        model.train()
        for _ in range(steps):
            loss = batch_loss()
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()


def segments_nll(model, pad: int, transcripts: list[list[tuple[list[int], bool]]]) -> torch.Tensor:
    """Mean NLL of the trained segments of each transcript, given everything before them (for warm starts).

    ``transcripts[i]`` is a list of ``(ids, trained)`` segments; row ``i`` is their concatenation, right-padded
    with ``pad``. Returns a scalar: the model's token-mean cross-entropy over the ``trained`` segments' tokens.
    """
    flat = [[t for seg, _ in segs for t in seg] for segs in transcripts]
    width = max(map(len, flat))
    ids = torch.full((len(flat), width), pad)
    labels = torch.full((len(flat), width), -100)
    attn = torch.zeros((len(flat), width), dtype=torch.long)
    for i, segs in enumerate(transcripts):
        at = 0
        for seg, trained in segs:
            ids[i, at:at + len(seg)] = torch.tensor(seg)
            if trained:
                labels[i, at:at + len(seg)] = torch.tensor(seg)
            at += len(seg)
        attn[i, :at] = 1
    return model(input_ids=ids, attention_mask=attn, labels=labels).loss
