"""A sampler that is not exactly pi_theta: mismatch diagnostics and importance-sampling corrections.

An engine that samples from pi_s != pi_theta (reduced precision, quantized weights, other kernels) makes
the REINFORCE estimator E_{y~pi_s}[A(y) grad log pi_theta(y)] biased for grad J(theta). With pi_s known
per sampled token, the sequence weight w(y) = pi_theta(y) / pi_s(y) = prod_t pi_theta(y_t|.) / pi_s(y_t|.)
makes it unbiased again: E_{pi_s}[w A grad log pi_theta] = E_{pi_theta}[A grad log pi_theta]. The
leave-one-out baseline stays valid because it excludes sample i (b_i does not depend on y_i). Truncating
(TIS, Yao et al. 2025; verl's rollout correction) or masking large weights buys lower variance with some bias;
per-token weights are cheaper in variance, and biased: they reweight each token, not the prefix it follows.

All weights are detached: they scale the advantage, never carry gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["mismatch_sums", "importance_weights", "weighted_advantages"]

RATIO_BANDS = ((0.5, 2.0), (0.9, 1.1))  # the fraction of token ratios pi_theta/pi_s outside each band is logged


def mismatch_sums(logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """How far the sampler pi_s is from pi_theta on the sampled tokens, as ``(sum, count)`` pairs.

    Tokens are drawn from pi_s, so ``log pi_s - log pi_theta`` averages to KL(pi_s || pi_theta) per token
    (k1, unbiased, may be negative on one batch) and ``(r - 1) - log r`` with ``r = pi_theta / pi_s`` to the same
    KL (k3, Schulman 2020: non-negative, lower variance).

    Args:
        logp: ``[B, T]`` log pi_theta of the sampled tokens (the training forward, at the sampling temperature).
        sampler_logp: ``[B, T]`` log pi_s of the same tokens, as the engine reported them.
        mask: ``[B, T]`` completion mask; values off it are ignored (even ``inf`` or ``NaN``).

    Returns:
        ``mismatch/kl_k1``, ``mismatch/kl_k3`` (per token), ``mismatch/ratio_outside_<lo>_<hi>`` (fraction of
        tokens), ``mismatch/seq_log_ratio`` (mean of log w per sequence) and ``mismatch/seq_log_ratio_sq`` (its
        mean square: the spread of the sequence weights), each ``(sum, count)`` for an exact mean over ranks.
    """
    m, mask = mask.bool(), mask.float()
    # Select, never multiply: a masked inf or NaN log-ratio times 0 is NaN. log r_t, 0 off the mask.
    delta = torch.where(m, logp.detach().float() - sampler_logp.float(), torch.zeros_like(mask))
    tokens, rows = mask.sum(), torch.tensor(float(mask.shape[0]), device=mask.device)
    ratio = torch.exp(delta)
    sums = {
        "mismatch/kl_k1": ((-delta).sum(), tokens),
        "mismatch/kl_k3": (torch.where(m, ratio - 1 - delta, torch.zeros_like(delta)).sum(), tokens),
    }
    for lo, hi in RATIO_BANDS:
        outside = torch.where(m, ((ratio < lo) | (ratio > hi)).float(), torch.zeros_like(ratio))
        sums[f"mismatch/ratio_outside_{lo}_{hi}"] = (outside.sum(), tokens)
    seq = delta.sum(1)
    sums["mismatch/seq_log_ratio"] = (seq.sum(), rows)
    sums["mismatch/seq_log_ratio_sq"] = ((seq * seq).sum(), rows)
    return sums


def importance_weights(logp: Tensor, sampler_logp: Tensor, mask: Tensor, level: str, mode: str = "truncate",
                       cap: float | None = 2.0, lower: float | None = None) -> Tensor:
    """Detached importance weights pi_theta / pi_s for the loss.

    Args:
        logp, sampler_logp, mask: ``[B, T]`` as in :func:`mismatch_sums`.
        level: ``sequence`` (one weight per sample: prod_t r_t) or ``token`` (one per token: r_t).
        mode: ``truncate``: ``min(w, cap)`` (TIS; ``cap=None`` keeps the plain, unbiased weight at sequence
            level); ``mask``: ``w`` inside ``[lower, cap]``, 0 outside (the sample or token leaves the loss).
        cap: the upper bound (None: none).
        lower: ``mask`` mode's lower bound (default ``1 / cap``).

    Returns:
        ``[B]`` (sequence) or ``[B, T]`` (token, 0 off the mask) weights.
    """
    if level not in ("sequence", "token"):
        raise ValueError(f"level must be 'sequence' or 'token', got {level!r}")
    m = mask.bool()
    # Select, never multiply: a masked inf or NaN log-ratio times 0 is NaN (and poisons a sequence's sum).
    log_ratio = logp.detach().float() - sampler_logp.float()
    log_ratio = torch.where(m, log_ratio, torch.zeros_like(log_ratio))
    if level == "sequence":
        log_ratio = log_ratio.sum(1)
    weights = torch.exp(log_ratio)
    if mode == "truncate":
        if cap is not None:
            weights = weights.clamp(max=cap)
    elif mode == "mask":
        high = float("inf") if cap is None else cap
        low = lower if lower is not None else (0.0 if cap is None else 1.0 / cap)
        weights = torch.where((weights >= low) & (weights <= high), weights, torch.zeros_like(weights))
    else:
        raise ValueError(f"mode must be 'truncate' or 'mask', got {mode!r}")
    return torch.where(m, weights, torch.zeros_like(weights)) if level == "token" else weights


def weighted_advantages(advantages: Tensor, weights: Tensor) -> Tensor:
    """``advantages`` (``[B]`` or ``[B, T]``) scaled by importance ``weights`` (``[B]`` or ``[B, T]``).

    A sequence weight scales a sequence advantage (``[B]``) or every token of a token advantage; token
    weights turn a sequence advantage into per-token advantages ``A_i * w_it``.
    """
    if weights.dim() == 1:
        return advantages * weights if advantages.dim() == 1 else advantages * weights[:, None]
    return (advantages[:, None] if advantages.dim() == 1 else advantages) * weights
