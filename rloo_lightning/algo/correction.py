"""A sampler that is not exactly pi_theta: mismatch diagnostics and importance-sampling corrections.

An engine that samples from pi_s != pi_theta (reduced precision, quantized weights, other kernels) makes
the REINFORCE estimator E_{y~pi_s}[A(y) grad log pi_theta(y)] biased for grad J(theta). With pi_s known
per sampled token, the sequence weight w(y) = pi_theta(y) / pi_s(y) = prod_t pi_theta(y_t|.) / pi_s(y_t|.)
makes it unbiased again: E_{pi_s}[w A grad log pi_theta] = E_{pi_theta}[A grad log pi_theta]. The
leave-one-out baseline stays valid because it excludes sample i (b_i does not depend on y_i). Truncating
(TIS, Yao et al. 2025; verl's rollout correction) or masking large weights buys lower variance with some bias;
per-token weights are cheaper in variance, and biased: they reweight each token, not the prefix it follows.
The 2026 family (docs/correction.md names each and its source): the geometric mean of the token ratios as a sequence
weight or filter (verl's geometric level, Geo-Mask), a sequence-level rejection on top of any weights
(:func:`with_rejection`), and TOPR's asymmetric weights (:func:`topr_advantages`). Only the untruncated product
weight is unbiased.

All weights are detached: they scale the advantage, never carry gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["mismatch_sums", "importance_weights", "sequence_log_ratios", "bounded", "with_rejection",
           "topr_advantages", "weighted_advantages"]

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
    """Detached importance weights pi_theta / pi_s for the loss (docs/correction.md: each level's source).

    Args:
        logp, sampler_logp, mask: ``[B, T]`` as in :func:`mismatch_sums`; ``mask`` is the policy's tokens (in an
            episode, the environment's tokens are off it).
        level: ``sequence`` (one weight per sample: prod_t r_t); ``token`` (one per token: r_t); ``geometric`` (one
            per sample: exp(mean_t log r_t), verl's geometric level, biased); ``topr`` (one per sample:
            min(prod_t r_t, 1), the weight TOPR gives a negative advantage, Le Roux et al. 2025; mode and cap
            do not apply: see :func:`topr_advantages` for the positive ones).
        mode, cap, lower: as :func:`bounded` (``truncate``: TIS; ``mask``: MIS; ``reject``: a 0/1 filter).

    Returns:
        ``[B]`` (sequence, geometric, topr) or ``[B, T]`` (token, 0 off the mask) weights.
    """
    if level == "token":
        m = mask.bool()
        log_ratio = torch.where(m, logp.detach().float() - sampler_logp.float(), torch.zeros_like(logp,
                                                                                                 dtype=torch.float))
        weights = bounded(torch.exp(log_ratio), mode, cap, lower)
        return torch.where(m, weights, torch.zeros_like(weights))
    if level == "topr":
        return torch.exp(sequence_log_ratios(logp, sampler_logp, mask)).clamp(max=1.0)
    if level not in ("sequence", "geometric"):
        raise ValueError(f"level must be 'sequence', 'token', 'geometric' or 'topr', got {level!r}")
    return bounded(torch.exp(sequence_log_ratios(logp, sampler_logp, mask, level)), mode, cap, lower)


def sequence_log_ratios(logp: Tensor, sampler_logp: Tensor, mask: Tensor, kind: str = "sequence") -> Tensor:
    """``[B]`` detached log of each sequence's ratio pi_theta/pi_s over the tokens of ``mask`` (the policy's).

    Args:
        logp, sampler_logp, mask: ``[B, T]`` as in :func:`mismatch_sums`.
        kind: ``sequence``: sum_t log r_t = log pi_theta(y)/pi_s(y) (the unbiased sequence weight's log);
            ``geometric``: (1/n) sum_t log r_t with n the row's tokens on ``mask``: the log of the geometric mean of
            the token ratios, length-invariant and not an importance weight (E_s[exp(.)] != 1). A row without any
            token on ``mask`` has 0.
    """
    if kind not in ("sequence", "geometric"):
        raise ValueError(f"kind must be 'sequence' or 'geometric', got {kind!r}")
    m = mask.bool()
    # Select, never multiply: a masked inf or NaN log-ratio times 0 is NaN (and poisons a sequence's sum).
    log_ratio = torch.where(m, logp.detach().float() - sampler_logp.float(), torch.zeros_like(logp, dtype=torch.float))
    total = log_ratio.sum(1)
    return total if kind == "sequence" else total / m.sum(1).clamp(min=1)


def bounded(weights: Tensor, mode: str, cap: float | None, lower: float | None) -> Tensor:
    """``weights`` (any shape) bounded by ``mode``: ``truncate``: min(w, cap) (TIS); ``mask``: w inside
    ``[lower, cap]``, 0 outside (MIS); ``reject``: 1 inside, 0 outside (a filter that keeps no weight). ``cap``
    None: no upper bound; ``lower`` None: 1 / cap (0 without a cap; ``truncate`` has no lower bound)."""
    if mode == "truncate":
        return weights if cap is None else weights.clamp(max=cap)
    if mode not in ("mask", "reject"):
        raise ValueError(f"mode must be 'truncate', 'mask' or 'reject', got {mode!r}")
    high = float("inf") if cap is None else cap
    low = lower if lower is not None else (0.0 if cap is None else 1.0 / cap)
    inside = (weights >= low) & (weights <= high)
    return torch.where(inside, weights if mode == "mask" else torch.ones_like(weights), torch.zeros_like(weights))


def with_rejection(weights: Tensor, logp: Tensor, sampler_logp: Tensor, mask: Tensor, ratio: str,
                   lower: float | None, upper: float | None) -> Tensor:
    """``weights`` (``[B]`` or ``[B, T]``) times a sequence-level rejection: a sample whose ``ratio`` (``sequence``:
    the product, or ``geometric``; :func:`sequence_log_ratios`) lies outside ``[lower, upper]`` gets weight 0 on
    every token (verl's rollout rejection sampling; NeMo-RL's seq-mask-tis with ``geometric``). ``logp``,
    ``sampler_logp``, ``mask``: ``[B, T]``; bounds as :func:`bounded`."""
    keep = bounded(torch.exp(sequence_log_ratios(logp, sampler_logp, mask, ratio)), "reject", upper, lower)
    return weights * (keep if weights.dim() == 1 else keep[:, None])


def topr_advantages(advantages: Tensor, weights: Tensor) -> Tensor:
    """TOPR (Le Roux et al. 2025, "Tapered Off-Policy REINFORCE", arXiv 2503.14286): a sample with advantage >= 0
    keeps weight 1 (its term is the SFT-like ``A grad log pi``, no ratio), one with advantage < 0 takes the truncated
    sequence ratio ``min(pi_theta/pi_s, 1)``.

    Args:
        advantages: ``[B]`` per sample, or ``[B, T]`` per token (then each token's sign decides).
        weights: ``[B]`` the truncated ratios (:func:`importance_weights` at level ``topr``).
    """
    w = weights if advantages.dim() == 1 else weights[:, None]
    return torch.where(advantages >= 0, advantages, advantages * w)


def weighted_advantages(advantages: Tensor, weights: Tensor) -> Tensor:
    """``advantages`` (``[B]`` or ``[B, T]``) scaled by importance ``weights`` (``[B]`` or ``[B, T]``).

    A sequence weight scales a sequence advantage (``[B]``) or every token of a token advantage; token
    weights turn a sequence advantage into per-token advantages ``A_i * w_it``.
    """
    if weights.dim() == 1:
        return advantages * weights if advantages.dim() == 1 else advantages * weights[:, None]
    return (advantages[:, None] if advantages.dim() == 1 else advantages) * weights
