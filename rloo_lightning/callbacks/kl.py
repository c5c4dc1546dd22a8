"""KL monitoring, the adaptive KL controller, and a KL limit."""

from __future__ import annotations

from typing import Literal

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from rloo_lightning.callbacks.base import RolloutHook
from rloo_lightning.metrics import log_step_metrics

__all__ = ["KLMonitor", "adaptive_beta"]


def adaptive_beta(beta: float, kl: float, target: float, horizon: int, num_samples: int) -> float:
    """One update of the adaptive KL controller of Ziegler et al. 2019 (Sec. 2.2).

    ``e = clip(KL / target - 1, -0.2, 0.2)``; ``beta <- beta * (1 + e * num_samples / horizon)``:
    beta grows while the KL is above target and shrinks while it is below.
    """
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * num_samples / horizon)


class KLMonitor(RolloutHook):
    """KL to the reference, per sequence and per token; optional adaptive beta and a limit.

    Logs ``train/kl_seq_mean``, ``train/kl_seq_max``, ``train/kl_seq_q<p>`` (quantiles of the
    sequence KL over every rank's sequences), ``train/kl_token_mean`` (token-weighted over all
    ranks: sums and counts are reduced), ``train/kl_token_max`` and ``train/beta``.

    Args:
        quantiles: quantiles of the sequence KL to log, each in (0, 1).
        target: if set, the adaptive controller of Ziegler et al. 2019 steers beta so that the
            mean sequence KL approaches it (``beta`` is a checkpointed buffer of the module).
        horizon: the controller's horizon in samples (Ziegler et al. use 10000).
        limit: if set, a mean sequence KL above it triggers ``on_limit``.
        on_limit: ``"warn"`` or ``"stop"`` (ends training after this step, with a message that
            says at which step and by how much the KL exceeded the limit).
    """

    def __init__(
        self,
        quantiles: list[float] = (0.5, 0.9, 0.99),
        target: float | None = None,
        horizon: int = 10000,
        limit: float | None = None,
        on_limit: Literal["warn", "stop"] = "warn",
    ) -> None:
        if any(not 0 < q < 1 for q in quantiles):
            raise ValueError(f"KLMonitor: quantiles must be in (0, 1), got {list(quantiles)}")
        if target is not None and target <= 0:
            raise ValueError(f"KLMonitor: target must be > 0, got {target}")
        if horizon < 1:
            raise ValueError(f"KLMonitor: horizon must be >= 1, got {horizon}")
        if on_limit not in ("warn", "stop"):
            raise ValueError(f"KLMonitor: on_limit must be 'warn' or 'stop', got {on_limit!r}")
        self.quantiles = list(quantiles)
        self.target = target
        self.horizon = horizon
        self.limit = limit
        self.on_limit = on_limit
        self.limit_hits: list[tuple[int, float]] = []

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and float(pl_module.cfg.kl.beta) == 0.0:
            raise ValueError(
                "KLMonitor needs a reference model, but model.kl.beta = 0 loads none; set model.kl.beta > 0 "
                "(the adaptive controller cannot start from beta = 0 either)"
            )

    def on_rollout_end(self, trainer: Trainer, pl_module: LightningModule, rollout) -> None:
        if rollout.kl is None:
            return
        seq = pl_module.all_gather(rollout.kl).reshape(-1).float()
        tok = torch.stack([rollout.token_kl.sum(), rollout.completion_mask.sum()]).float()
        tok_max = (rollout.token_kl + (rollout.completion_mask - 1) * 1e30).amax().float()
        tok = pl_module.reduce_across_ranks(tok, "sum")
        tok_max = pl_module.reduce_across_ranks(tok_max, "max")
        mean_kl = seq.mean().item()
        metrics = {
            "train/kl_seq_mean": mean_kl,
            "train/kl_seq_max": seq.max().item(),
            "train/kl_token_mean": (tok[0] / tok[1].clamp(min=1)).item(),
            "train/kl_token_max": tok_max.item(),
        }
        for q, v in zip(self.quantiles, torch.quantile(seq, torch.tensor(self.quantiles, device=seq.device))):
            metrics[f"train/kl_seq_q{q * 100:g}"] = v.item()
        metrics["train/beta"] = float(pl_module.beta)
        log_step_metrics(trainer, metrics, pl_module.global_step)
        if self.target is not None:
            new = adaptive_beta(float(pl_module.beta), mean_kl, self.target, self.horizon, seq.numel())
            pl_module.beta.fill_(new)
        if self.limit is not None and mean_kl > self.limit:
            step = trainer.global_step
            self.limit_hits.append((step, mean_kl))
            message = (f"KLMonitor: mean sequence KL {mean_kl:.4f} exceeds the limit {self.limit} by "
                       f"{mean_kl - self.limit:.4f} at step {step}")
            if self.on_limit == "stop":
                trainer.should_stop = True
                message += "; stopping training"
            rank_zero_warn(message)

    def state_dict(self) -> dict:
        return {"limit_hits": list(self.limit_hits)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.limit_hits = [tuple(x) for x in state_dict["limit_hits"]]
