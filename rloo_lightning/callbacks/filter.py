"""Zero-variance group filtering (the filter of DAPO's dynamic sampling, without resampling)."""

from __future__ import annotations

from typing import Literal

import torch
from lightning.pytorch import LightningModule, Trainer

from rloo_lightning.algo.advantages import informative_groups
from rloo_lightning.callbacks.base import RolloutHook
from rloo_lightning.metrics import log_step_metrics

__all__ = ["ZeroVarianceFilter"]


class ZeroVarianceFilter(RolloutHook):
    """Drop prompt groups whose k rewards are all equal.

    Such a group has leave-one-out advantages that are all 0 on the task reward, so it adds no
    reward signal; dropping it makes the loss an average over the informative sequences only
    (DAPO, Yu et al. 2025, "dynamic sampling"; here without drawing replacement prompts).

    Dropped rows leave the loss, and the loss is normalised by the number of kept sequences over
    all ranks. Dropping a group also drops its KL gradient: with ``beta > 0`` the shaped reward
    ``r - beta*KL`` of a dropped group was not constant, and that pull toward the reference is lost
    for those prompts. A rank whose groups are all dropped still runs its forward and backward
    (a zero loss that touches the graph), so DDP does not hang.

    Args:
        signal: ``"score"`` decides on the task reward r, before the KL term (DAPO's choice);
            ``"baseline"`` on the reward the baseline sees, ``r - beta*KL`` (which is almost never exactly
            constant when beta > 0).
        atol: a group whose rewards spread by at most this much counts as zero-variance.

    Logs ``train/filtered_groups`` (fraction of groups dropped this step) and keeps running totals
    in its state (``dropped_groups``, ``seen_groups``), restored on resume.
    """

    def __init__(self, signal: Literal["score", "baseline"] = "score", atol: float = 0.0) -> None:
        if signal not in ("score", "baseline"):
            raise ValueError(f"ZeroVarianceFilter: `signal` must be 'score' or 'baseline', got {signal!r}")
        if atol < 0:
            raise ValueError(f"ZeroVarianceFilter: `atol` must be >= 0, got {atol}")
        self.signal = signal
        self.atol = atol
        self.dropped_groups = 0
        self.seen_groups = 0

    def on_rollout(self, trainer: Trainer, pl_module: LightningModule, rollout) -> None:
        values = rollout.rewards if self.signal == "score" else rollout.baseline_rewards
        informative = informative_groups(values, rollout.k, self.atol)
        rollout.keep &= informative.repeat_interleave(rollout.k)
        counts = torch.stack([(~informative).sum(), torch.tensor(informative.numel(), device=values.device)])
        counts = pl_module.reduce_across_ranks(counts.float(), "sum")
        self.dropped_groups += int(counts[0])
        self.seen_groups += int(counts[1])
        log_step_metrics(trainer, {"train/filtered_groups": (counts[0] / counts[1]).item()}, pl_module.global_step)

    def state_dict(self) -> dict:
        return {"dropped_groups": self.dropped_groups, "seen_groups": self.seen_groups}

    def load_state_dict(self, state_dict: dict) -> None:
        self.dropped_groups = state_dict["dropped_groups"]
        self.seen_groups = state_dict["seen_groups"]
