"""The training loader and sampler (exact resume, rank sharding) and the prompt batch's collate."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler

__all__ = ["ResumableDataLoader", "ResumableSampler", "collate_prompts"]


class ResumableDataLoader(DataLoader):
    """The training loader: a ``DataLoader`` that Lightning counts as resumable (``state_dict`` / ``load_state_dict``).

    The resume position is not kept here: the :class:`ResumableSampler`'s ``position`` (the
    trainer's restored global step) is the one source of truth, so :meth:`load_state_dict` takes the
    saved state and changes nothing. Lightning only stores the state in the checkpoint and hands it
    back on restore (it skips no batches itself), so nothing is skipped twice; being stateful only
    tells Lightning that a mid-epoch resume continues exactly (no "not resumable" warning).
    """

    def state_dict(self) -> dict:
        """``consumed_batches``: the batches this rank had consumed when the checkpoint was written."""
        position = getattr(self.sampler, "position", None)
        return {"consumed_batches": int(position()) if callable(position) else 0}

    def load_state_dict(self, state_dict: dict) -> None:
        """Accepts the saved state; the sampler's position (the restored global step) already places the data."""


class ResumableSampler(DistributedSampler):
    """Shuffled, rank-sharded indices; the data order is a function of (seed, batches consumed) only.

    A ``DistributedSampler`` subclass, so Lightning uses it as is instead of wrapping it; each
    rank gets its own shard (a prompt's k completions are all sampled on its rank).

    With ``position`` (a callable giving the batches already consumed, e.g. the restored global
    step), every pass starts from it: epoch ``consumed // batches_per_epoch``, skipping the
    batches of that epoch already used. A resumed run therefore continues exactly where the
    interrupted one stopped, mid-epoch or at an epoch boundary, whatever Lightning's own epoch
    counter says (after a resume at an epoch's last batch it can lag by one). Without
    ``position`` it behaves as a ``DistributedSampler`` (``set_epoch`` picks the permutation).

    Args:
        batch_size: batches per epoch are ``len(self) // batch_size`` (``drop_last`` loaders).
        repeat: each batch is yielded this many times in a row (rollout reuse); the position
            counts the repeated batches.
    """

    def __init__(self, dataset, num_replicas: int = 1, rank: int = 0, seed: int = 0, batch_size: int = 1,
                 position=None, repeat: int = 1) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.batch_size = batch_size
        self.position = position
        self.repeat = repeat

    def __len__(self) -> int:
        return (self.num_samples // self.batch_size) * self.batch_size * self.repeat

    def set_epoch(self, epoch: int) -> None:
        if self.position is None:
            super().set_epoch(epoch)

    def __iter__(self):
        skip = 0
        if self.position is not None:
            self.epoch, done = divmod(self.position(), self._per_epoch())
            skip = done * self.batch_size
        order = self._batches(self.epoch).repeat_interleave(self.repeat, dim=0).flatten()
        # len() stays the full shard: Lightning numbers a resumed epoch's batches from its restored count.
        return (i for chunk in order[skip:].split(4096) for i in chunk.tolist())

    def batch_at(self, position: int) -> list[int]:
        """The dataset indices of the batch this rank's loader yields after ``position`` batches (repeats
        counted), without iterating: fixed-lag rollouts (``rollout.lag``) sample a later step's prompts
        ahead of it."""
        epoch, done = divmod(position, self._per_epoch())
        return self._batches(epoch)[done // self.repeat].tolist()

    def _per_epoch(self) -> int:
        return max(1, (self.num_samples // self.batch_size) * self.repeat)

    def _batches(self, epoch: int):
        """``[batches, batch_size]`` this rank's batches of ``epoch`` (before repeats)."""
        if getattr(self, "_cached", (None,))[0] == epoch:
            return self._cached[1]
        # DistributedSampler's own permutation (shuffle, drop_last), kept as a tensor: a prompt set of
        # millions of rows costs 8 bytes a row here, not a Python int each.
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        order = torch.randperm(len(self.dataset), generator=generator)[:self.total_size]
        order = order[self.rank:self.total_size:self.num_replicas]
        b = self.batch_size
        self._cached = (epoch, order[:(len(order) // b) * b].view(-1, b))
        return self._cached[1]


def collate_prompts(rows: list[dict], pad_token_id: int) -> dict:
    """Left-pad prompts (generation appends on the right).

    Returns:
        ``input_ids`` / ``attention_mask`` ``[N, P]``, ``prompt`` (N prompts as given: strings or
        messages lists), ``columns`` (``{name: N values}``; a column missing from a row is None) and
        ``row_index`` ``[N]`` (each prompt's index in its source, the prompt cache's ``row``; -1 for a row
        built by hand without one).
    """
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, width - n :] = torch.tensor(r["input_ids"])
        mask[i, width - n :] = 1
    names = sorted({c for r in rows for c in r["columns"]})
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "prompt": [r["prompt"] for r in rows],
        "columns": {c: [r["columns"].get(c) for r in rows] for c in names},
        "row_index": torch.tensor([r.get("row", -1) for r in rows], dtype=torch.long),
    }
