"""Baselines and advantages: the paper's leave-one-out default beside the anchors' alternatives.

Rewards are ``[N*k]``, prompt-major (the k completions of prompt ``p`` at rows ``p*k ... p*k+k-1``);
``NaN`` marks a missing reward, left out of every baseline with advantage 0. Pure: tensors in,
tensors out (the moving average keeps a float of state).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "BASELINES",
    "leave_one_out_advantages",
    "group_mean_advantages",
    "group_mean_std_advantages",
    "MovingAverageBaseline",
    "baseline_advantages",
    "whiten",
    "informative_groups",
    "group_std",
    "AdvantageEstimator",
]


def _grouped(rewards: Tensor, k: int, name: str, min_k: int = 1) -> Tensor:
    """``[N*k]`` -> ``[N, k]`` view, with the shape and ``k`` checked."""
    if k < min_k:
        raise ValueError(f"{name} needs k >= {min_k}, got k={k}")
    if rewards.dim() != 1 or rewards.numel() % k != 0:
        raise ValueError(f"rewards must be 1-D with a length divisible by k={k}, got shape {tuple(rewards.shape)}")
    return rewards.view(-1, k)


def leave_one_out_advantages(rewards: Tensor, k: int) -> Tensor:
    """Leave-one-out advantages ``A_i = R_i - mean_{j != i} R_j`` within each prompt group.

    Kool et al. 2019 / Ahmadian et al. 2024, Eq. 4: the baseline of sample ``i`` is the mean
    reward of the other ``k-1`` samples of the same prompt, so it is independent of ``y_i``
    and the estimator stays unbiased.

    Args:
        rewards: ``[N*k]`` float, prompt-major: the k completions of prompt ``p`` sit at
            ``p*k ... p*k+k-1``. ``NaN`` marks a missing reward: it is left out of its group's
            baseline and its own advantage is 0.
        k: group size, ``>= 2``.

    Returns:
        ``[N*k]`` advantages, same dtype as ``rewards``. A group with fewer than two valid
        rewards gets advantage 0 everywhere (no baseline can be formed).
    """
    if k < 2:
        raise ValueError(f"k must be >= 2 for a leave-one-out baseline, got k={k}")
    if rewards.dim() != 1 or rewards.numel() % k != 0:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by k={k}, got shape {tuple(rewards.shape)}"
        )
    grouped = rewards.view(-1, k)
    valid = ~torch.isnan(grouped)
    filled = torch.where(valid, grouped, torch.zeros_like(grouped))
    total = filled.sum(dim=1, keepdim=True)
    count = valid.sum(dim=1, keepdim=True)
    # Baseline over the *other* valid samples: (sum - r_i) / (count - 1); vectorised, no loop.
    others = (count - 1).clamp(min=1).to(rewards.dtype)
    baseline = (total - filled) / others
    adv = torch.where(valid & (count >= 2), filled - baseline, torch.zeros_like(filled))
    return adv.view(-1)


def _group_stats(rewards: Tensor, k: int, name: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(groups [N, k], valid [N, k], count [N, 1], mean [N, 1])`` over valid rewards."""
    groups = _grouped(rewards, k, name, min_k=2)
    valid = ~torch.isnan(groups)
    count = valid.sum(1, keepdim=True)
    mean = torch.where(valid, groups, torch.zeros_like(groups)).sum(1, keepdim=True) / count.clamp(min=1)
    return groups, valid, count, mean


def group_mean_advantages(rewards: Tensor, k: int) -> Tensor:
    """Dr.GRPO (Liu et al. 2025): ``A_i = R_i - mean_g R`` with the self-inclusive group mean, no std.

    With ``n`` valid rewards in the group this is exactly ``(n-1)/n`` times the leave-one-out
    advantage (``ANCHORS.md``: ``A^LOO = n/(n-1) (r - mean)``), so it estimates ``(k-1)/k grad J``.

    Args:
        rewards: ``[N*k]`` prompt-major; ``NaN`` = missing (left out of the mean, advantage 0).
        k: ``>= 2``.

    Returns:
        ``[N*k]``; a group with fewer than two valid rewards gets 0 (as ``leave_one_out_advantages``).
    """
    groups, valid, count, mean = _group_stats(rewards, k, "baseline 'group_mean'")
    adv = torch.where(valid & (count >= 2), groups - mean, torch.zeros_like(groups))
    return adv.reshape(-1)


def group_mean_std_advantages(rewards: Tensor, k: int, eps: float = 1e-4) -> Tensor:
    """GRPO (Shao et al. 2024; TRL ``GRPOTrainer``): ``A_i = (R_i - mean_g) / (std_g + eps)``.

    ``std_g`` is the *unbiased* (Bessel, ``torch.std``) std of the group's valid rewards, as TRL;
    ``eps`` = 1e-4 as TRL. Dividing by a std that depends on ``y_i`` makes it biased for ``grad J``.

    Args:
        rewards: ``[N*k]`` prompt-major; ``NaN`` = missing (left out of the statistics, advantage 0).
        k: ``>= 2``.

    Returns:
        ``[N*k]``; a group with fewer than two valid rewards, or all equal, gets 0.
    """
    groups, valid, count, mean = _group_stats(rewards, k, "baseline 'group_mean_std'")
    # Missing entries filled with the group mean add nothing to the squared deviations; torch.std
    # over k then rescaled from k-1 to n-1 (exactly 1 when nothing is missing).
    filled = torch.where(valid, groups, mean)
    rescale = ((k - 1) / (count - 1).clamp(min=1).to(groups.dtype)).sqrt()
    std = filled.std(1, keepdim=True) * rescale
    denom = std + eps
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))  # a constant group is 0, even with eps = 0
    adv = torch.where(valid & (count >= 2), (groups - mean) / denom, torch.zeros_like(groups))
    return adv.reshape(-1)


class MovingAverageBaseline:
    """REINFORCE with a moving-average baseline (the paper's "REINFORCE w/ baseline" comparison).

    ``b`` for the current batch is a bias-corrected exponential moving average of *earlier*
    batches' mean reward (0 for the first batch): it does not depend on the current samples, so
    the estimator stays unbiased. Bias correction as Adam: ``ema_m / (1 - decay**m)`` after ``m``
    updates, so early baselines are not pulled toward 0.

    Args:
        decay: ``0 <= decay < 1``; weight of the past.
    """

    def __init__(self, decay: float = 0.9) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = float(decay)
        self.ema = 0.0
        self.num_updates = 0

    @property
    def value(self) -> float:
        """The baseline for the next batch (bias-corrected; 0.0 before any update)."""
        if self.num_updates == 0:
            return 0.0
        return self.ema / (1.0 - self.decay**self.num_updates)

    def update(self, batch: Tensor | float) -> None:
        """Fold one batch's mean reward into the average.

        Args:
            batch: the batch's rewards (any shape; ``NaN`` ignored; all-``NaN`` is no update) or
                its mean as a number (pass the global mean under data parallelism).
        """
        if isinstance(batch, Tensor) and batch.numel() != 1:
            batch = batch.detach()
            valid = batch[~torch.isnan(batch)]
            if valid.numel() == 0:
                return
            mean = float(valid.mean())
        else:
            mean = float(batch)
            if math.isnan(mean):
                return
        self.ema = self.decay * self.ema + (1.0 - self.decay) * mean
        self.num_updates += 1

    def advantages(self, rewards: Tensor, batch_mean: float | Tensor | None = None) -> Tensor:
        """``A = R - b`` with ``b`` from earlier batches, then update with this batch.

        Args:
            rewards: ``[B]``; ``NaN`` = missing, advantage 0.
            batch_mean: this batch's mean reward to record (e.g. all-reduced across ranks);
                defaults to the mean of the valid ``rewards``.

        Returns:
            ``[B]``.
        """
        valid = ~torch.isnan(rewards)
        adv = torch.where(valid, rewards - self.value, torch.zeros_like(rewards))
        self.update(rewards if batch_mean is None else batch_mean)
        return adv

    def state_dict(self) -> dict[str, float | int]:
        return {"decay": self.decay, "ema": self.ema, "num_updates": self.num_updates}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        if float(state["decay"]) != self.decay:
            raise ValueError(
                f"MovingAverageBaseline state was saved with decay={state['decay']}, this one has decay={self.decay}"
            )
        self.ema = float(state["ema"])
        self.num_updates = int(state["num_updates"])


def _no_baseline(rewards: Tensor, k: int, **_) -> Tensor:
    """Vanilla REINFORCE (the paper's "vanilla PG"): ``A = R``; ``[N*k]`` -> ``[N*k]``, missing -> 0."""
    _grouped(rewards, k, "baseline 'none'")
    return torch.where(torch.isnan(rewards), torch.zeros_like(rewards), rewards)


def _moving_average(rewards: Tensor, k: int, *, moving_average: MovingAverageBaseline | None = None,
                    batch_mean: float | Tensor | None = None, **_) -> Tensor:
    """``R - b`` with ``b`` from earlier batches (the paper's "REINFORCE w/ baseline"); ``[N*k]`` -> ``[N*k]``."""
    _grouped(rewards, k, "baseline 'moving_average'")
    if moving_average is None:
        raise ValueError("baseline 'moving_average' needs a MovingAverageBaseline passed as moving_average=")
    return moving_average.advantages(rewards, batch_mean)


# The baselines by option name (``advantage.baseline``): ``(rewards [N*k], k, *, eps, moving_average, batch_mean)``
# -> advantages ``[N*k]``. The option's allowed values are this table's keys (``BaselineName``).
BASELINES: dict[str, Callable[..., Tensor]] = {
    "leave_one_out": lambda rewards, k, **_: leave_one_out_advantages(rewards, k),
    "none": _no_baseline,
    "moving_average": _moving_average,
    "group_mean_std": lambda rewards, k, *, eps=1e-4, **_: group_mean_std_advantages(rewards, k, eps),
    "group_mean": lambda rewards, k, **_: group_mean_advantages(rewards, k),
}


BaselineName = Literal[tuple(BASELINES)]  # type: ignore[valid-type]  # the option's type, from the table


def baseline_advantages(
    rewards: Tensor,
    k: int,
    baseline: BaselineName = "leave_one_out",
    *,
    eps: float = 1e-4,
    moving_average: MovingAverageBaseline | None = None,
    batch_mean: float | Tensor | None = None,
) -> Tensor:
    """Advantages under the chosen baseline (a name of ``BASELINES``); ``NaN`` rewards (missing) get 0 in every one.

    - ``leave_one_out`` (default; paper Eq. 4): ``leave_one_out_advantages``;
    - ``none`` (vanilla REINFORCE, the paper's "vanilla PG"): ``A = R``;
    - ``moving_average`` (paper's "REINFORCE w/ baseline"): ``R - b`` with ``b`` from
      ``moving_average`` (required; it is updated with this batch, or with ``batch_mean``);
    - ``group_mean_std`` (GRPO, ``eps``): ``group_mean_std_advantages``;
    - ``group_mean`` (Dr.GRPO): ``group_mean_advantages`` = ``(k-1)/k`` x leave-one-out.

    Args:
        rewards: ``[N*k]`` prompt-major. k: group size (``>= 2`` for the group baselines).

    Returns:
        ``[N*k]``.
    """
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {', '.join(map(repr, BASELINES))}; got {baseline!r}")
    return BASELINES[baseline](rewards, k, eps=eps, moving_average=moving_average, batch_mean=batch_mean)


def whiten(values: Tensor, mask: Tensor | None = None, shift_mean: bool = True, eps: float = 1e-4,
           reduce: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """Batch whitening ``(v - mean) / (std + eps)`` over the selected entries (TRL ``normalize_advantages``).

    Statistics are taken over entries that are unmasked and not ``NaN``, with the unbiased (Bessel)
    std, as ``torch.std``; TRL applies it to the globally gathered advantages, so pass the gathered
    tensor for a global whitening. Only the selected entries are transformed; the others come back
    as they came (``NaN`` stays ``NaN``; masked entries are the caller's to mask). With fewer than
    two selected entries the std is taken as 0.

    Args:
        values: any shape, e.g. ``[B]`` sequence advantages or ``[B, T]`` token advantages.
        mask: same shape, 0/1, or ``None`` (all entries).
        shift_mean: if False the mean is added back (scale only), as TRL's old ``masked_whiten``.
        eps: added to the std (TRL: 1e-4).
        reduce: sums a tensor over data-parallel ranks (e.g. an all-reduce), so that the mean and
            std are those of every rank's selected entries; None = this tensor's only.

    Returns:
        same shape and dtype as ``values``.
    """
    reduce = reduce or (lambda t: t)
    selected = ~torch.isnan(values)
    if mask is not None:
        if mask.shape != values.shape:
            raise ValueError(f"mask {tuple(mask.shape)} must match values {tuple(values.shape)}")
        selected &= mask.bool()
    filled = torch.where(selected, values, torch.zeros_like(values))
    total, count = reduce(torch.stack([filled.sum(), selected.sum().to(filled.dtype)]))
    mean = total / count.clamp(min=1)
    centred = torch.where(selected, values - mean, torch.zeros_like(values))
    std = (reduce(centred.pow(2).sum()) / (count - 1).clamp(min=1)).sqrt()
    out = centred / (std + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(selected, out, values)


def informative_groups(rewards: Tensor, k: int, atol: float = 0.0) -> Tensor:
    """Groups whose valid rewards differ: ``max - min > atol`` over at least two valid rewards.

    DAPO's dynamic sampling (verl ``filter_groups``) keeps only these: a group whose rewards are
    all equal has every leave-one-out advantage 0 and contributes no gradient.

    Args:
        rewards: ``[N*k]`` prompt-major; ``NaN`` = missing (ignored).
        k: group size.
        atol: spreads ``<= atol`` count as no spread.

    Returns:
        ``[N]`` bool.
    """
    groups = _grouped(rewards, k, "informative_groups")
    valid = ~torch.isnan(groups)
    high = torch.where(valid, groups, torch.full_like(groups, -math.inf)).max(1).values
    low = torch.where(valid, groups, torch.full_like(groups, math.inf)).min(1).values
    return (valid.sum(1) >= 2) & (high - low > atol)


def group_std(values: Tensor, k: int) -> Tensor:
    """Population std of each prompt group's valid (non-NaN) rewards.

    Args:
        values: ``[N*k]`` prompt-major. Returns ``[N]`` (0 for a group with < 2 valid values).
    """
    groups = values.view(-1, k)
    valid = ~torch.isnan(groups)
    n = valid.sum(1).clamp(min=1)
    filled = torch.where(valid, groups, torch.zeros_like(groups))
    mean = filled.sum(1) / n
    var = torch.where(valid, (groups - mean[:, None]) ** 2, torch.zeros_like(groups)).sum(1) / n
    return torch.where(valid.sum(1) >= 2, var.sqrt(), torch.zeros_like(var))


class AdvantageEstimator:
    """Step 6 as one object: the configured baseline and the transforms around it.

    ``normalize`` (before the rollout hooks) standardises the rewards over the global batch when
    ``normalize_rewards`` is on; ``__call__`` forms the advantages of the kept rows with the baseline,
    then clips and whitens them if asked. The default is the paper's: leave-one-out, nothing else.

    Args:
        k: group size. baseline, decay, normalize_rewards, whiten, clip: as ``AdvantageArgs``.
    """

    def __init__(self, k: int, baseline: BaselineName = "leave_one_out", decay: float = 0.9,
                 normalize_rewards: bool = False, whiten: bool = False,
                 clip: tuple[float, float] | None = None) -> None:
        self.k, self.baseline, self.clip = k, baseline, clip
        self.normalize_rewards, self.whiten = normalize_rewards, whiten
        self.moving_average = MovingAverageBaseline(decay) if baseline == "moving_average" else None

    @classmethod
    def from_args(cls, args, k: int) -> AdvantageEstimator:
        """From an :class:`~rloo_lightning.config.AdvantageArgs` and the group size."""
        return cls(k, args.baseline, args.baseline_decay, args.normalize_rewards, args.whiten, args.clip)

    def normalize(self, rewards: Tensor, reduce: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """``[B]`` rewards standardised over every rank's valid rewards (``normalize_rewards``), else as given."""
        return whiten(rewards, reduce=reduce) if self.normalize_rewards else rewards

    def __call__(self, rewards: Tensor, keep: Tensor, reduce: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """Advantages ``[B]`` of rewards ``[B]``; rows with ``keep`` False count as missing (advantage 0).

        ``reduce`` sums a tensor over data-parallel ranks (global statistics for the moving average
        and whitening); None = this process only.
        """
        rewards = torch.where(keep, rewards, torch.full_like(rewards, torch.nan))
        batch_mean = None
        if self.moving_average is not None:  # every rank folds in the same global mean
            valid = ~torch.isnan(rewards)
            sums = torch.stack([torch.nan_to_num(rewards).sum(), valid.sum().to(rewards.dtype)])
            sums = reduce(sums) if reduce is not None else sums
            batch_mean = float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")
        advantages = baseline_advantages(rewards, self.k, self.baseline, moving_average=self.moving_average,
                                         batch_mean=batch_mean)
        if self.clip is not None:
            advantages = advantages.clamp(*self.clip)
        if self.whiten:  # over every rank's kept rows; dropped rows keep advantage 0
            advantages = whiten(advantages, mask=keep, reduce=reduce)
        return advantages

    def state_dict(self) -> dict:
        return self.moving_average.state_dict() if self.moving_average is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.moving_average is not None and state:
            self.moving_average.load_state_dict(state)
