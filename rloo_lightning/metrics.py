"""Metrics: the training step's (sum, count) pairs, reduced once across ranks, and unbiased pass@k."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from torch import Tensor

from rloo_lightning.algo.advantages import group_std
from rloo_lightning.algo.logprobs import masked_sum
from rloo_lightning.environments.episodes import CUT_KINDS
from rloo_lightning.rewards.protocol import RewardError, short_repr
from rloo_lightning.runtime import framework

__all__ = [
    "train_metric_sums",
    "log_step_metrics",
    "write_to_loggers",
    "pass_at_k",
    "MissingRewardWatch",
    "NoSignalWatch",
    "step_means",
]


def log_step_metrics(trainer, metrics: Mapping[str, float], step: int, prog_bar: Collection[str] = ()) -> None:
    """One training step's values, already reduced across ranks, to the trainer, without ``LightningModule.log``.

    ``self.log`` costs the same time a key on a CPU whatever the value (Lightning moves the key's whole result
    state to the value's device at every call), several times what this costs (measured: see
    ``benchmarks/README.md``, ``bench_logging``); the step logs 12-20 keys. These values need none of what it
    adds: they are already global means, and each is one step's value (no epoch aggregation). They go to
    ``trainer.callback_metrics`` (what a ``ModelCheckpoint`` or ``EarlyStopping`` ``monitor`` and the progress
    bar read), ``trainer.progress_bar_metrics`` for the keys in ``prog_bar``, and the loggers at the steps
    Lightning writes training metrics (:func:`write_to_loggers`).
    Without a trainer (a module driven by hand), nothing.
    """
    if trainer is None or not metrics:
        return
    trainer.callback_metrics.update({name: torch.tensor(float(v)) for name, v in metrics.items()})
    if prog_bar:
        trainer.progress_bar_metrics.update({name: float(metrics[name]) for name in prog_bar if name in metrics})
    write_to_loggers(trainer, metrics, step)


def write_to_loggers(trainer, metrics: Mapping[str, float], step: int) -> None:
    """``metrics`` to every logger at ``step``, where Lightning would write a training step's ``self.log`` values:
    at every ``log_every_n_steps``-th step (``(step + 1) % n == 0``) and when the trainer is stopping, with the
    ``epoch`` Lightning adds. The loggers write on rank 0 only (they are ``rank_zero_only``). Without a trainer,
    nothing."""
    if trainer is None:
        return
    n = trainer.log_every_n_steps
    if not trainer.loggers or not n or ((step + 1) % n and not trainer.should_stop):
        return
    values = {name: float(v) for name, v in metrics.items()}
    values.setdefault("epoch", trainer.current_epoch)
    for logger in trainer.loggers:
        if not _tensorboard_event(logger, values, step):
            logger.log_metrics(values, step=step)


def _tensorboard_event(logger, values: dict[str, float], step: int) -> bool:
    """Lightning's own ``TensorBoardLogger`` with torch's ``SummaryWriter``: all of a step's scalars as one event.

    Its ``log_metrics`` calls ``add_scalar`` per key: one event, one serialized record and one (pure-Python)
    checksum each, on the writer's thread. One ``Summary`` holding every value is the same data to every
    TensorBoard reader (the same tags, steps and float32 values), in a fraction of the time on the calling thread
    (measured: see ``benchmarks/step_time.md``). False for any other logger or writer, which then gets
    ``log_metrics``.
    """
    if type(logger) is not TensorBoardLogger:
        return False
    if rank_zero_only.rank != 0:
        return True  # the logger writes on rank 0 only
    from torch.utils.tensorboard import SummaryWriter

    writer = logger.experiment
    if type(writer) is not SummaryWriter:
        return False
    framework.tensorboard_scalars_event(logger, writer, values, step)
    return True


def pass_at_k(successes: Tensor, n: int, k: int) -> Tensor:
    """Unbiased pass@k from ``n`` samples per prompt (Chen et al. 2021, Eq. 1): ``1 - C(n-c, k) / C(n, k)``.

    Args:
        successes: ``[N]`` number of successful samples ``c`` per prompt, ``0 <= c <= n``.
        n: samples per prompt; k: ``1 <= k <= n``.

    Returns:
        ``[N]`` float probabilities that at least one of k samples drawn without replacement succeeds.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    c = successes.long()
    # prod_{i=n-c+1}^{n} (1 - k/i) = C(n-c, k)/C(n, k), stable for large n (no factorials).
    i = torch.arange(1, n + 1, device=successes.device, dtype=torch.float64)
    factors = torch.where(i[None] > (n - c)[:, None], 1.0 - k / i[None], torch.ones_like(i[None]))
    fail = torch.where(n - c < k, torch.zeros_like(c, dtype=torch.float64), factors.prod(1))
    return (1.0 - fail).float()


def train_metric_sums(rollout, entropy: Tensor, loss: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """The step's ``train/*`` metrics as ``(sum, count)`` pairs, so that one all-reduce gives exact global means.

    Args:
        rollout: a scored :class:`~rloo_lightning.rollout.Rollout` after the loss (``advantages`` set).
        entropy: ``[B, T]`` per-token entropies of the policy.
        loss: the step's scalar loss.

    Returns:
        ``{metric name: (sum, count)}``; a mean is ``sum / count`` after both are summed over ranks.
    """
    mask, rewards = rollout.completion_mask, rollout.rewards
    valid = ~torch.isnan(rewards)
    stds = group_std(rewards, rollout.k)
    num_groups = torch.tensor(stds.shape[0])
    rows = torch.ones_like(rewards).sum()
    sums = {
        "train/reward": (torch.nan_to_num(rewards).sum(), valid.sum()),  # NaN when no reward is present
        "train/reward_missing": ((~valid).sum(), rows),
        "train/reward_std": (stds.sum(), num_groups),
        "train/zero_std_groups": ((stds == 0).sum(), num_groups),
        "train/advantage_abs": (rollout.advantages.abs().sum(), rows),
        "train/completion_length": (mask.sum(), rows),
        "train/clipped_ratio": (rollout.missing_eos.sum(), rows),
        "train/entropy": (masked_sum(entropy, mask).sum(), mask.sum()),
        "train/loss": (loss.detach(), torch.tensor(1.0)),
    }
    if rollout.kl is not None:
        kl = rollout.kl
        weights = rollout.is_weights
        if weights is not None:  # samples from pi_s: the importance-weighted estimate of the KL under pi_theta
            kl = weights * kl if weights.dim() == 1 else (weights * rollout.token_kl).sum(1)
        sums["train/kl"] = (kl.sum(), rows)
    for name, pair in (rollout.mismatch or {}).items():
        sums[f"train/{name}"] = pair
    if rollout.is_weights is not None:
        w = rollout.is_weights
        on = torch.ones_like(w) if w.dim() == 1 else mask  # per sample, or per completion token
        sums["train/correction/weight_mean"] = ((w * on).sum(), on.sum())
        sums["train/correction/zero_fraction"] = (((w == 0).float() * on).sum(), on.sum())
    for name, (total, count) in (rollout.clip_stats or {}).items():
        sums[f"train/{name}"] = (torch.as_tensor(total), torch.as_tensor(count))
    if (episodes := rollout.episodes) is not None:  # a multi-turn rollout: per episode
        context = episodes.context_mask
        sums["train/turns"] = (episodes.turns.sum(), rows)
        sums["train/truncated_episodes"] = (rollout.truncated.sum(), rows)
        sums["train/policy_tokens"] = (mask.sum(), rows)
        sums["train/env_tokens"] = ((context - mask).sum(), rows)
        for kind in CUT_KINDS:  # why episodes were cut, each kind's share
            sums[f"train/cut/{kind}"] = (rows.new_tensor(float(sum(c == kind for c in episodes.cut_by))), rows)
        for name, values in episodes.metrics.items():  # the environment's own, per episode that did not fail
            ok = ~torch.isnan(values.float())
            sums[f"train/{name}"] = (torch.nan_to_num(values.float()).sum(), ok.sum())
    for name, values in rollout.scores.items():
        ok = ~torch.isnan(values)
        sums[f"train/score/{name}"] = (torch.nan_to_num(values).sum(), ok.sum())
    return sums


def single_values(values: Mapping[str, float]) -> dict[str, tuple[Tensor, Tensor]]:
    """Per-rank values (the pipeline's, an engine's) as ``(value, 1)`` pairs: their global mean is over ranks."""
    return {name: (torch.tensor(float(value)), torch.tensor(1.0)) for name, value in values.items()}


def global_means(sums: Mapping[str, tuple[Tensor, Tensor]], reduce, device) -> dict[str, float]:
    """``{name: (sum, count)}`` -> ``{name: exact global mean}``: every pair stacked and summed over ranks in one
    ``reduce(tensor, "sum")``, then divided (:func:`step_means`)."""
    stacked = torch.stack([torch.stack([s.float().to(device), n.float().to(device)]) for s, n in sums.values()])
    return dict(zip(sums, step_means(reduce(stacked, "sum"))))


def step_means(sums: Tensor) -> list[float]:
    """``[M, 2]`` (sum, count) pairs -> M means; NaN where the count is 0 (nothing to average: a step whose every
    reward is missing logs ``train/reward`` NaN, not 0)."""
    return torch.where(sums[:, 1] > 0, sums[:, 0] / sums[:, 1].clamp(min=1), torch.nan).tolist()


class MissingRewardWatch:
    """Stops the run when ``patience`` training steps in a row had no reward at all (``train/reward_missing`` = 1):
    every reward call failed or timed out under ``rewards.on_error: none``, returned None, or every episode failed.
    Such a run learns nothing, yet would end with status 0. ``patience`` 0: never stop."""

    def __init__(self, patience: int = 10) -> None:
        self.patience, self.streak = patience, 0

    def update(self, metrics: dict[str, float], step: int, prompts: Sequence[str] = ()) -> None:
        """``metrics``: the step's global means (``train/reward_missing``, ``train/score/<name>``); ``prompts``: the
        step's prompts on this rank (every one of them went without a reward), named in the error."""
        self.streak = self.streak + 1 if metrics["train/reward_missing"] >= 1.0 else 0
        if not self.patience or self.streak < self.patience:
            return
        scores = {k[len("train/score/"):]: v for k, v in metrics.items() if k.startswith("train/score/")}
        silent = [name for name, v in scores.items() if math.isnan(v)]
        if silent == ["environment"]:
            source = "the environment gave no reward (every episode failed, or its final_reward returned None)"
        elif silent:
            source = "no value from " + ", ".join(
                "the environment" if n == "environment" else f"reward function {n!r}" for n in silent) + \
                " (None, or an error or timeout scored None by rewards.on_error)"
        else:
            source = "every completion missed at least one of " + ", ".join(repr(n) for n in scores) + \
                "'s rewards (a None from any function makes the weighted sum missing)"
        distinct = list(dict.fromkeys(prompts))  # each prompt is repeated k times
        named = ""
        if distinct:
            shown = ", ".join(short_repr(p, 60) for p in distinct[:3])
            more = f" and {len(distinct) - 3} more" if len(distinct) > 3 else ""
            named = f"; the prompts of step {step}: {shown}{more}"
        raise RewardError(f"no reward in any of the last {self.streak} training steps (up to step {step}): "
                           f"{source}{named}. Nothing is learnt from such a step; set "
                           "rewards.stop_after_missing_steps 0 to train on regardless")


class NoSignalWatch:
    """Warns once when every group's k task rewards were equal for ``patience`` training steps in a row.

    Such a group has a leave-one-out advantage of 0 for the task (only the KL term moves the policy), so a
    run where it is always so learns nothing: a reward that never varies, or a task too hard or too easy.
    """

    def __init__(self, patience: int = 20) -> None:
        self.patience, self.streak, self.warned = patience, 0, False

    def update(self, zero_std_fraction: float, step: int) -> None:
        """``zero_std_fraction``: the step's ``train/zero_std_groups`` (a global mean over ranks)."""
        self.streak = self.streak + 1 if zero_std_fraction >= 1.0 else 0
        if self.streak >= self.patience and not self.warned:
            self.warned = True
            rank_zero_warn(
                f"no learning signal: in each of the last {self.streak} steps (up to step {step}) every group's "
                f"k rewards were equal (train/zero_std_groups = 1), so every task advantage is 0. Check that the "
                "reward varies between completions (train/score/<name>), or raise sampling.k / "
                "sampling.temperature, or use dynamic_sampling.enabled to resample such groups")
