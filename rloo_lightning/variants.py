"""Pure tensor functions for the anchors' variants of RLOO: parity options and other baselines.

The default algorithm lives in ``objectives.py`` (paper-faithful). Everything here reproduces a
choice that TRL, OpenRLHF or verl make differently (see ``ANCHORS.md``), as an explicit option:
KL estimators k1/k2/k3, OpenRLHF's per-token KL placed *after* the baseline with reward-to-go,
verl's four loss aggregations, the clipped surrogates used when a rollout is reused, batch
whitening and clipping, the REINFORCE / moving-average / GRPO / Dr.GRPO baselines, TR-DPO's
reference mixing and the zero-variance-group test of dynamic sampling.

Nothing here imports Lightning or transformers: tensors in, tensors out. Shapes use ``B`` =
number of sequences (prompts x k, prompt-major: the k completions of prompt ``p`` sit at rows
``p*k ... p*k+k-1``), ``T`` = completion length, ``N`` = number of prompts, ``k`` = group size.
``NaN`` in a reward marks a missing reward, as in ``objectives.leave_one_out_advantages``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Literal

import torch
from torch import Tensor

from rloo_lightning.objectives import leave_one_out_advantages, masked_sum

__all__ = [
    "KL_ESTIMATORS",
    "AGGREGATION_MODES",
    "BASELINES",
    "kl_per_token",
    "clip_rewards",
    "token_rewards_after_baseline",
    "reward_to_go",
    "aggregate_token_loss",
    "sequence_clipped_surrogate",
    "token_clipped_surrogate",
    "whiten",
    "normalize_rewards",
    "group_mean_advantages",
    "group_mean_std_advantages",
    "MovingAverageBaseline",
    "baseline_advantages",
    "mix_into_reference",
    "informative_groups",
]

KLEstimator = Literal["k1", "k2", "k3"]
AggregationMode = Literal["seq_sum", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
BaselineName = Literal["leave_one_out", "none", "moving_average", "group_mean_std", "group_mean"]

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
AGGREGATION_MODES: tuple[str, ...] = ("seq_sum", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
BASELINES: tuple[str, ...] = ("leave_one_out", "none", "moving_average", "group_mean_std", "group_mean")


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def _grouped(rewards: Tensor, k: int, name: str, min_k: int = 1) -> Tensor:
    """``[N*k]`` -> ``[N, k]`` view, with the shape and ``k`` checked."""
    if k < min_k:
        raise ValueError(f"{name} needs k >= {min_k}, got k={k}")
    if rewards.dim() != 1 or rewards.numel() % k != 0:
        raise ValueError(f"rewards must be 1-D with a length divisible by k={k}, got shape {tuple(rewards.shape)}")
    return rewards.view(-1, k)


# -- KL estimators -------------------------------------------------------------------------------
def kl_per_token(
    logp: Tensor, ref_logp: Tensor, estimator: KLEstimator = "k1", clamp: float | None = None
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token's log-probs.

    Schulman, "Approximating KL divergence" (2020), with ``x = logp - ref_logp`` and ``y ~ pi``:

    - ``k1 = x``: unbiased, can be negative (the paper's and TRL's estimator, summed over tokens);
    - ``k2 = x**2 / 2``: non-negative, biased, low variance (OpenRLHF ``k2``, verl ``mse``);
    - ``k3 = exp(-x) + x - 1``: non-negative and unbiased for KL(pi || pi_ref) (OpenRLHF ``k3``,
      verl ``low_var_kl``, GRPO's KL loss term).

    Masking is the caller's (``objectives.masked_sum``): values at padding are whatever the inputs
    hold there.

    Args:
        logp, ref_logp: ``[B, T]`` log-probs of the sampled tokens under the policy and the reference.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        clamp: if set, the estimate is clamped to ``[-clamp, clamp]`` afterwards (OpenRLHF clamps
            every estimator's output to ``[-10, 10]``). The clamp zeroes the gradient outside it.

    Returns:
        ``[B, T]``, in the dtype of ``logp - ref_logp``.
    """
    _check_choice("estimator", estimator, KL_ESTIMATORS)
    x = logp - ref_logp
    if estimator == "k1":
        kl = x
    elif estimator == "k2":
        kl = 0.5 * x**2
    else:
        # r = pi_ref/pi = exp(-x); k3 = (r - 1) - log r, the Bregman form: >= 0, and E_pi[r - 1] = 0.
        kl = torch.exp(-x) + x - 1.0
    if clamp is not None:
        kl = kl.clamp(min=-clamp, max=clamp)
    return kl


# -- clipping and OpenRLHF's per-token placement ----------------------------------------------------
def clip_rewards(values: Tensor, clip_range: float | tuple[float, float]) -> Tensor:
    """Clamp rewards (before the baseline) or advantages (after it); ``NaN`` stays ``NaN``.

    TRL's ``reward_clip_range`` clamps the scalar reward before the baseline; OpenRLHF clamps
    ``r_i - b_i`` to ``(-10, 10)`` after it (``token_rewards_after_baseline`` calls this).

    Args:
        values: any shape.
        clip_range: ``c`` for ``[-c, c]``, or ``(low, high)``.
    """
    low, high = (-clip_range, clip_range) if isinstance(clip_range, (int, float)) else clip_range
    if low > high:
        raise ValueError(f"clip_range must have low <= high, got ({low}, {high})")
    return values.clamp(min=low, max=high)


def _last_token_onehot(mask: Tensor) -> Tensor:
    """``[B, T]`` bool, True at the last unmasked position of each row (none for an empty row)."""
    m = mask.bool()
    positions = torch.arange(m.shape[-1], device=m.device).expand_as(m)
    last = torch.where(m, positions, torch.full_like(positions, -1)).max(dim=-1, keepdim=True).values
    return (positions == last) & m


def token_rewards_after_baseline(
    advantages_seq: Tensor,
    token_kl: Tensor,
    mask: Tensor,
    beta: float,
    clip_range: float | tuple[float, float] | None = None,
) -> Tensor:
    """OpenRLHF's ``rloo`` placement: the KL is a per-token reward added *after* the baseline.

    ``R_t = -beta * kl_t + 1[t = last unmasked token] * clip(A_i)``, where ``A_i = r_i - b_i`` is the
    leave-one-out advantage of the raw score (no KL in it). Follow with ``reward_to_go``. This is
    not the paper's placement (KL in the sequence reward before the baseline, ``objectives``): the
    KL term here has no baseline, so it is a different, higher-variance estimator.

    Args:
        advantages_seq: ``[B]`` per-sequence advantages ``r_i - b_i``.
        token_kl: ``[B, T]`` per-token KL estimate (``kl_per_token``); ignored where masked.
        mask: ``[B, T]`` completion mask. A row with no unmasked token gets no terminal reward.
        beta: KL coefficient.
        clip_range: if set, ``A_i`` is clamped first (OpenRLHF: ``(-10, 10)``), see ``clip_rewards``.

    Returns:
        ``[B, T]`` token rewards, 0 at masked positions.
    """
    if advantages_seq.dim() != 1 or token_kl.shape != mask.shape or token_kl.shape[0] != advantages_seq.shape[0]:
        raise ValueError(
            f"expected advantages_seq [B] and token_kl, mask [B, T]; got {tuple(advantages_seq.shape)}, "
            f"{tuple(token_kl.shape)}, {tuple(mask.shape)}"
        )
    adv = advantages_seq if clip_range is None else clip_rewards(advantages_seq, clip_range)
    kl_reward = torch.where(mask.bool(), -beta * token_kl, torch.zeros_like(token_kl))
    terminal = torch.where(_last_token_onehot(mask), adv[:, None].to(kl_reward.dtype), torch.zeros_like(kl_reward))
    return kl_reward + terminal


def reward_to_go(token_rewards: Tensor, mask: Tensor) -> Tensor:
    """Undiscounted return ``G_t = sum_{t' >= t} m_t' R_t'`` (OpenRLHF's ``rloo`` forces gamma = 1).

    Args:
        token_rewards: ``[B, T]``; mask: ``[B, T]`` completion mask.

    Returns:
        ``[B, T]`` token-level advantages, 0 at masked positions.
    """
    m = mask.bool()
    r = torch.where(m, token_rewards, torch.zeros_like(token_rewards))
    returns = torch.flip(torch.cumsum(torch.flip(r, dims=[-1]), dim=-1), dims=[-1])
    return torch.where(m, returns, torch.zeros_like(returns))


# -- loss aggregation ------------------------------------------------------------------------------
def aggregate_token_loss(
    per_token_loss: Tensor,
    mask: Tensor,
    mode: AggregationMode = "seq_sum",
    num_sequences: int | float | Tensor | None = None,
    num_tokens: int | float | Tensor | None = None,
    norm_constant: int | float | None = None,
) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar; verl's ``loss_agg_mode`` names in brackets.

    - ``seq_sum`` (default; verl ``seq-mean-token-sum``, the paper, TRL): ``sum_{i,t} m l / S``:
      each sequence is one action, no length normalisation.
    - ``token_mean`` (verl default ``token-mean``, OpenRLHF): ``sum_{i,t} m l / N_tok``: long
      answers weigh more; biased w.r.t. the sequence-level objective when lengths vary.
    - ``seq_mean_token_mean`` (verl ``seq-mean-token-mean``, OpenRLHF option, original GRPO):
      ``sum_i (sum_t m l / n_i) / S``, with ``n_i`` row i's token count (an empty row adds 0).
    - ``seq_mean_token_sum_norm`` (verl ``seq-mean-token-sum-norm``, Dr.GRPO):
      ``sum_{i,t} m l / (S * C)``, a constant ``C`` (verl: the max response length, ``T``).

    Denominators default to this batch (``S = B`` rows, ``N_tok = mask.sum()``). Under data
    parallelism pass them explicitly so every rank divides by the same global count; a strategy
    that *averages* gradients over ``W`` ranks (DDP) needs ``global_count / W`` to get the global
    mean. Denominators a mode does not use are ignored.

    Args:
        per_token_loss: ``[B, T]``, e.g. ``-A * logp`` or a clipped surrogate; NaN where masked is fine.
        mask: ``[B, T]`` completion mask.
        mode: one of ``AGGREGATION_MODES``.
        num_sequences: ``S``; defaults to ``B`` (rows with an empty mask count, as in ``policy_loss``).
        num_tokens: ``N_tok`` for ``token_mean``; defaults to ``mask.sum()`` (at least 1).
        norm_constant: ``C`` for ``seq_mean_token_sum_norm``; defaults to ``T``.

    Returns:
        scalar.
    """
    _check_choice("mode", mode, AGGREGATION_MODES)
    if per_token_loss.shape != mask.shape or per_token_loss.dim() != 2:
        raise ValueError(f"per_token_loss and mask must both be [B, T], got {tuple(per_token_loss.shape)} "
                         f"and {tuple(mask.shape)}")
    seqs = per_token_loss.shape[0] if num_sequences is None else num_sequences
    per_seq = masked_sum(per_token_loss, mask)  # [B]
    if mode == "seq_sum":
        return per_seq.sum() / seqs
    if mode == "token_mean":
        tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
        return per_seq.sum() / tokens
    if mode == "seq_mean_token_mean":
        return (per_seq / mask.sum(-1).clamp(min=1)).sum() / seqs
    const = per_token_loss.shape[-1] if norm_constant is None else norm_constant
    if const <= 0:
        raise ValueError(f"norm_constant must be > 0, got {const}")
    return per_seq.sum() / (seqs * const)


# -- clipped surrogates for rollout reuse -----------------------------------------------------------
def _fraction(flags: Tensor, weight: Tensor | None = None) -> Tensor:
    flags = flags.float()
    if weight is None:
        return flags.mean() if flags.numel() else flags.sum()
    return (flags * weight).sum() / weight.sum().clamp(min=1)


def sequence_clipped_surrogate(
    advantages: Tensor,
    logp: Tensor,
    old_logp: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    log_ratio_clamp: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """TRL's ``RLOOTrainer`` (>= 0.22) loss: PPO-clip on the *sequence* importance ratio.

    ``rho_i = exp(sum_t m_t (logp_t - old_logp_t))``,
    ``loss_i = -min(rho_i A_i, clip(rho_i, 1 - eps_low, 1 + eps_high) A_i)``; average it with
    ``.mean()`` (TRL) or divide by a global count. At ``rho = 1`` (one update per rollout) the
    gradient is the paper's REINFORCE gradient ``-A_i grad sum_t m_t logp_t``.

    Args:
        advantages: ``[B]``, treated as constants (detached).
        logp: ``[B, T]`` policy log-probs with grad; old_logp: ``[B, T]`` at sampling time (detached).
        mask: ``[B, T]`` completion mask.
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]``, both ``>= 0``.
        log_ratio_clamp: if set, the sequence log-ratio is clamped to ``[-c, c]`` before ``exp``
            (TRL does not; a long sequence can overflow ``exp`` to ``inf``).

    Returns:
        ``([B] per-sequence loss, stats)``; stats (detached, fractions of the ``B`` sequences):
        ``clip_low`` (``rho < 1 - eps_low`` and ``A < 0``), ``clip_high`` (``rho > 1 + eps_high`` and
        ``A > 0``), ``clip_region`` (either: the clip is active, the gradient is 0), ``ratio_mean``.
    """
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"eps_low and eps_high must be >= 0, got {eps_low}, {eps_high}")
    adv = advantages.detach()
    log_ratio = masked_sum(logp - old_logp.detach(), mask)
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(min=-log_ratio_clamp, max=log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(min=1.0 - eps_low, max=1.0 + eps_high)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    with torch.no_grad():
        low = (ratio < 1.0 - eps_low) & (adv < 0)
        high = (ratio > 1.0 + eps_high) & (adv > 0)
        stats = {
            "clip_low": _fraction(low),
            "clip_high": _fraction(high),
            "clip_region": _fraction(low | high),
            "ratio_mean": ratio.mean() if ratio.numel() else ratio.sum(),
        }
    return loss, stats


def token_clipped_surrogate(
    advantages: Tensor,
    logp: Tensor,
    old_logp: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip_c: float | None = None,
    log_ratio_clamp: float | None = 20.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """verl / OpenRLHF loss: PPO-clip on each *token's* ratio, with optional dual clip.

    ``rho_t = exp(logp_t - old_logp_t)``; ``l_t = max(-rho_t A_t, -clip(rho_t, 1-eps_low, 1+eps_high) A_t)``
    and, with dual clip (Ye et al. 2020, verl ``clip_ratio_c`` = 3), for ``A_t < 0`` the loss is
    also capped: ``l_t = min(l_t, -c A_t)``, so a huge ratio on a bad token cannot blow up. Reduce
    with ``aggregate_token_loss``. At ``rho = 1`` the gradient of ``l_t`` is ``-A_t grad logp_t``.

    Args:
        advantages: ``[B]`` (broadcast to every token) or ``[B, T]`` (e.g. ``reward_to_go``); detached.
        logp: ``[B, T]`` with grad; old_logp: ``[B, T]`` (detached); mask: ``[B, T]``.
        eps_low, eps_high: ``>= 0``.
        dual_clip_c: ``c > 1`` or ``None`` (off).
        log_ratio_clamp: the log-ratio is clamped to ``[-c, c]`` before ``exp`` (verl: 20); ``None``: off.

    Returns:
        ``([B, T] per-token loss, 0 where masked, stats)``; stats are detached fractions of the
        unmasked tokens: ``clip_low``, ``clip_high``, ``clip_region`` (as in
        ``sequence_clipped_surrogate``), ``dual_clip`` (``A < 0`` and the ``-c A`` cap active), and
        ``num_tokens`` (the count they are fractions of, to reduce across ranks by weight).
    """
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"eps_low and eps_high must be >= 0, got {eps_low}, {eps_high}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (or None to disable), got {dual_clip_c}")
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(f"logp, old_logp and mask must share [B, T], got {tuple(logp.shape)}, "
                         f"{tuple(old_logp.shape)}, {tuple(mask.shape)}")
    adv = advantages.detach()
    if adv.dim() == 1:
        adv = adv[:, None]
    adv = adv.expand_as(logp)
    m = mask.bool()
    # Zero the log-ratio at padding *before* exp: a NaN there would otherwise reach the gradient
    # (exp's backward multiplies by its output, and where's zero gradient times NaN is NaN).
    log_ratio = torch.where(m, logp - old_logp.detach(), torch.zeros_like(logp))
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(min=-log_ratio_clamp, max=log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(min=1.0 - eps_low, max=1.0 + eps_high)
    loss = torch.maximum(-ratio * adv, -clipped * adv)
    dual = torch.zeros_like(mask, dtype=torch.bool)
    if dual_clip_c is not None:
        cap = -dual_clip_c * adv
        dual = (adv < 0) & (loss > cap)
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    loss = torch.where(m, loss, torch.zeros_like(loss))
    with torch.no_grad():
        weight = m.float()
        low = (ratio < 1.0 - eps_low) & (adv < 0)
        high = (ratio > 1.0 + eps_high) & (adv > 0)
        stats = {
            "clip_low": _fraction(low, weight),
            "clip_high": _fraction(high, weight),
            "clip_region": _fraction(low | high, weight),
            "dual_clip": _fraction(dual, weight),
            "num_tokens": weight.sum(),
        }
    return loss, stats


# -- whitening and normalisation ---------------------------------------------------------------------
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


def normalize_rewards(rewards: Tensor, eps: float = 1e-4) -> Tensor:
    """Batch-normalise scalar rewards before the baseline: ``(r - mean) / (std + eps)`` over valid rewards.

    ``NaN`` (missing) stays ``NaN``, so the baseline still leaves it out. The leave-one-out
    advantage is shift-invariant, so only the scale matters: it divides ``A`` by the batch std.

    Args:
        rewards: ``[B]``. Returns ``[B]``.
    """
    return whiten(rewards, eps=eps)


# -- baselines (issue 11) ------------------------------------------------------------------------------
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


def baseline_advantages(
    rewards: Tensor,
    k: int,
    baseline: BaselineName = "leave_one_out",
    *,
    eps: float = 1e-4,
    moving_average: MovingAverageBaseline | None = None,
    batch_mean: float | Tensor | None = None,
) -> Tensor:
    """Advantages under the chosen baseline; ``NaN`` rewards (missing) get advantage 0 in every one.

    - ``leave_one_out`` (default; paper Eq. 4): ``objectives.leave_one_out_advantages``;
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
    _check_choice("baseline", baseline, BASELINES)
    if baseline == "leave_one_out":
        return leave_one_out_advantages(rewards, k)
    if baseline == "group_mean_std":
        return group_mean_std_advantages(rewards, k, eps)
    if baseline == "group_mean":
        return group_mean_advantages(rewards, k)
    _grouped(rewards, k, f"baseline {baseline!r}")
    if baseline == "none":
        return torch.where(torch.isnan(rewards), torch.zeros_like(rewards), rewards)
    if moving_average is None:
        raise ValueError("baseline 'moving_average' needs a MovingAverageBaseline passed as moving_average=")
    return moving_average.advantages(rewards, batch_mean)


# -- reference sync and dynamic sampling ---------------------------------------------------------------
@torch.no_grad()
def mix_into_reference(ref_params: Iterable[Tensor], policy_params: Iterable[Tensor], alpha: float = 0.6) -> None:
    """TR-DPO (Gorbatovski et al. 2024) / TRL ``sync_ref_model``: ``ref = alpha * policy + (1 - alpha) * ref``.

    In place, without grad. TRL's defaults: ``ref_model_mixup_alpha`` = 0.6 every
    ``ref_model_sync_steps`` = 512 steps; ``alpha = 1`` is a hard copy. The reference then moves,
    so the KL penalty regularises toward a trailing policy, not the initial one.

    Args:
        ref_params, policy_params: matching sequences of tensors (e.g. ``module.parameters()`` of
            two copies of the same architecture), same shapes; dtypes and devices may differ.
        alpha: ``0 <= alpha <= 1``.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    refs, pols = list(ref_params), list(policy_params)
    if len(refs) != len(pols):
        raise ValueError(f"ref_params has {len(refs)} tensors, policy_params has {len(pols)}")
    for i, (ref, pol) in enumerate(zip(refs, pols)):
        if ref.shape != pol.shape:
            raise ValueError(f"parameter {i}: reference shape {tuple(ref.shape)} != policy shape {tuple(pol.shape)}")
    for ref, pol in zip(refs, pols):
        ref.mul_(1.0 - alpha).add_(pol.to(device=ref.device, dtype=ref.dtype), alpha=alpha)


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
