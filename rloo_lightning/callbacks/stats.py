"""Reward-variance statistics, histograms and sample tables for TensorBoard."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from rloo_lightning.callbacks.base import RolloutHook
from rloo_lightning.metrics import log_step_metrics
from rloo_lightning.algo.advantages import group_std

__all__ = ["RewardVarianceLogger", "SampleLogger"]


def _tensorboards(trainer: Trainer) -> list:
    return [lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]


class RewardVarianceLogger(RolloutHook):
    """Per-group reward spread, per-reward-function statistics and histograms.

    Statistics are computed from every rank's rollout (gathered), so they are global. Logs
    ``train/group_reward_std_mean`` / ``_max`` and ``train/zero_variance_fraction`` (on the task
    reward r), and for each reward function ``train/score/<name>_std`` / ``_min`` / ``_max``; every
    ``histogram_every_n_steps`` steps, TensorBoard histograms ``hist/reward``, ``hist/baseline_reward``,
    ``hist/advantage``, ``hist/group_reward_std`` and ``hist/score/<name>`` (written on rank 0).

    Args:
        histogram_every_n_steps: histogram period in optimizer steps (0 = never).
    """

    def __init__(self, histogram_every_n_steps: int = 10) -> None:
        if histogram_every_n_steps < 0:
            raise ValueError(f"histogram_every_n_steps must be >= 0, got {histogram_every_n_steps}")
        self.histogram_every_n_steps = histogram_every_n_steps

    def on_rollout_end(self, trainer: Trainer, pl_module: LightningModule, rollout) -> None:
        k = rollout.k
        gather = lambda t: pl_module.all_gather(t).reshape(-1).float()  # noqa: E731
        rewards = gather(rollout.rewards)
        stds = group_std(rewards, k)
        metrics = {
            "train/group_reward_std_mean": stds.mean().item(),
            "train/group_reward_std_max": stds.max().item(),
            "train/zero_variance_fraction": (stds == 0).float().mean().item(),
        }
        scores = {name: gather(v) for name, v in rollout.scores.items()}
        for name, values in scores.items():
            ok = values[~torch.isnan(values)]
            if ok.numel():
                metrics[f"train/score/{name}_std"] = ok.std(unbiased=False).item()
                metrics[f"train/score/{name}_min"] = ok.min().item()
                metrics[f"train/score/{name}_max"] = ok.max().item()
        log_step_metrics(trainer, metrics, pl_module.global_step)
        step = trainer.global_step
        if not (self.histogram_every_n_steps and step % self.histogram_every_n_steps == 0):
            return
        hists = {"hist/reward": rewards, "hist/baseline_reward": gather(rollout.baseline_rewards),
                 "hist/advantage": gather(rollout.advantages), "hist/group_reward_std": stds}
        hists.update({f"hist/score/{name}": v for name, v in scores.items()})
        if trainer.is_global_zero:
            for writer in _tensorboards(trainer):
                for tag, values in hists.items():
                    values = values[~torch.isnan(values)]
                    if values.numel():
                        writer.add_histogram(tag, values.cpu(), step)


class SampleLogger(RolloutHook):
    """Every ``every_n_steps`` steps, a table of prompt / completion / scores / advantage as TensorBoard text.

    The rows come from rank 0's rollout (the first ``num_rows`` completions: whole prompt groups
    first, so that a group's k answers can be compared). A multi-turn episode's completion is its transcript,
    each message prefixed with its role (``[assistant] ... [user] ...``).

    Args:
        every_n_steps: period in optimizer steps.
        num_rows: completions per table.
        max_chars: prompts and completions are cut to this many characters.
    """

    def __init__(self, every_n_steps: int = 50, num_rows: int = 8, max_chars: int = 400) -> None:
        if every_n_steps < 1 or num_rows < 1 or max_chars < 1:
            raise ValueError("SampleLogger: every_n_steps, num_rows and max_chars must be >= 1")
        self.every_n_steps = every_n_steps
        self.num_rows = num_rows
        self.max_chars = max_chars

    def table(self, rollout) -> str:
        """A markdown table of the first ``num_rows`` completions of ``rollout``."""

        def cell(text: str) -> str:
            text = text[: self.max_chars] + ("…" if len(text) > self.max_chars else "")
            return text.replace("|", "\\|").replace("\n", "⏎")

        names = list(rollout.scores)
        head = ["prompt", "completion", "reward", *[f"score/{n}" for n in names], "advantage"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for i in range(min(self.num_rows, len(rollout.completions))):
            values = [rollout.rewards[i], *[rollout.scores[n][i] for n in names], rollout.advantages[i]]
            lines.append("| " + " | ".join([cell(rollout.prompts[i]), cell(self.completion(rollout, i)),
                                            *[f"{float(v):.4g}" for v in values]]) + " |")
        return "\n".join(lines)

    @staticmethod
    def completion(rollout, i: int) -> str:
        """Row ``i``'s completion, or its episode's messages with their roles."""
        transcript = rollout.columns.get("transcript") if rollout.episodes is not None else None
        if transcript is None:
            return rollout.completions[i]
        return " ".join(f"[{m['role']}] {m['content']}" for m in transcript[i])

    def on_rollout_end(self, trainer: Trainer, pl_module: LightningModule, rollout) -> None:
        step = trainer.global_step
        if step % self.every_n_steps != 0 or not trainer.is_global_zero:
            return
        text = self.table(rollout)
        for writer in _tensorboards(trainer):
            writer.add_text("samples", text, step)
