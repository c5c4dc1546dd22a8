"""Policy losses: the paper's sequence-level REINFORCE, the anchors' aggregations, clipped surrogates.

The default is ``aggregate_token_loss(-A * logp, mask, "seq_sum")`` = ``-1/S sum_i A_i sum_t m_t logp_t``
(Ahmadian et al. 2024, Sec. 3.1: each completion is one action, no length normalisation, no ratio).
Pure: tensors in, tensors out. Shapes: ``B`` sequences, ``T`` completion length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from rloo_lightning.algo.kl import KLTerm, kl_per_token
from rloo_lightning.algo.logprobs import masked_sum

__all__ = [
    "AGGREGATION_MODES",
    "aggregate_token_loss",
    "sequence_clipped_surrogate",
    "token_clipped_surrogate",
    "PolicyLoss",
]


def _seq_sum(per_seq: Tensor, mask: Tensor, seqs, tokens, const) -> Tensor:
    return per_seq.sum() / seqs


def _token_mean(per_seq: Tensor, mask: Tensor, seqs, tokens, const) -> Tensor:
    return per_seq.sum() / (mask.sum().clamp(min=1) if tokens is None else tokens)


def _seq_mean_token_mean(per_seq: Tensor, mask: Tensor, seqs, tokens, const) -> Tensor:
    return (per_seq / mask.sum(-1).clamp(min=1)).sum() / seqs


def _seq_mean_token_sum_norm(per_seq: Tensor, mask: Tensor, seqs, tokens, const) -> Tensor:
    const = mask.shape[-1] if const is None else const
    if const <= 0:
        raise ValueError(f"norm_constant must be > 0, got {const}")
    return per_seq.sum() / (seqs * const)


# The loss aggregations by option name (``update.loss_aggregation``; see :func:`aggregate_token_loss`):
# ``(per-sequence sums [B], mask [B, T], S, N_tok or None, C or None)`` -> scalar.
AGGREGATION_MODES: dict[str, Callable[..., Tensor]] = {
    "seq_sum": _seq_sum,
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}


AggregationMode = Literal[tuple(AGGREGATION_MODES)]  # type: ignore[valid-type]  # the option's type, from the table


# ``update.clip_mode``: one importance ratio per completion (TRL) or per token (verl, OpenRLHF).
ClipMode = Literal["sequence", "token"]


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
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, AGGREGATION_MODES))}; got {mode!r}")
    if per_token_loss.shape != mask.shape or per_token_loss.dim() != 2:
        raise ValueError(f"per_token_loss and mask must both be [B, T], got {tuple(per_token_loss.shape)} "
                         f"and {tuple(mask.shape)}")
    seqs = per_token_loss.shape[0] if num_sequences is None else num_sequences
    per_seq = masked_sum(per_token_loss, mask)  # [B]
    return AGGREGATION_MODES[mode](per_seq, mask, seqs, num_tokens, norm_constant)


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


class PolicyLoss:
    """Step 7 as one object: the loss of some rows of a rollout, given their log-probs with grad.

    Default (the paper, Sec. 3.1): ``-sum_i A_i sum_t m_t logp_t / S``, advantages detached, no ratio.
    On a stored rollout's later updates (``old_logp`` given, ``updates_per_rollout > 1``) a clipped
    importance-weighted surrogate replaces it (TRL: per sequence; verl / OpenRLHF: per token); with
    ``kl_in_loss`` (GRPO, verl ``use_kl_loss``) ``beta * KL`` is added with its gradient.

    Args: as ``UpdateArgs`` (aggregation, clip mode and range, dual clip) and ``KLArgs`` (estimator, clamp).
    """

    def __init__(self, aggregation: AggregationMode = "seq_sum", clip_mode: ClipMode = "sequence",
                 eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None,
                 kl_in_loss: bool = False, kl_estimator: str = "k1", kl_clamp: float | None = None) -> None:
        self.aggregation, self.clip_mode = aggregation, clip_mode
        self.eps_low, self.eps_high, self.dual_clip = eps_low, eps_high, dual_clip
        self.kl_in_loss, self.kl_estimator, self.kl_clamp = kl_in_loss, kl_estimator, kl_clamp

    @classmethod
    def from_args(cls, update, kl) -> PolicyLoss:
        """From the :class:`~rloo_lightning.config.UpdateArgs` and :class:`~rloo_lightning.config.KLArgs` groups."""
        return cls(update.loss_aggregation, update.clip_mode, update.clip_eps_low, update.clip_eps_high,
                   update.dual_clip, kl_in_loss=KLTerm.from_args(kl).in_loss, kl_estimator=kl.estimator,
                   kl_clamp=kl.clamp)

    def __call__(self, logp: Tensor, mask: Tensor, advantages: Tensor, denominators: dict,
                 old_logp: Tensor | None = None, ref_logp: Tensor | None = None,
                 beta: float | Tensor = 0.0) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]]]:
        """The loss of ``b`` rows and their clip statistics.

        Args:
            logp: ``[b, T]`` policy log-probs with grad.
            mask: ``[b, T]`` completion mask times the rows' ``keep``.
            advantages: ``[b]`` sequence advantages, or ``[b, T]`` token advantages (``kl.placement: token_reward``).
            denominators: ``num_sequences``, ``num_tokens``, ``norm_constant`` of :func:`aggregate_token_loss`
                (global over ranks, fixed before any micro-batch, so that micro-batch losses add up).
            old_logp: ``[b, T]`` the sampling policy's log-probs on a reused rollout, else None.
            ref_logp: ``[b, T]`` reference log-probs (for ``kl_in_loss``).

        Returns:
            ``(scalar loss, {stat name: (weighted sum, weight)})``; stats only for the clipped surrogates.
        """
        stats: dict[str, tuple[Tensor, Tensor]] = {}
        if old_logp is None:
            per_token = -advantages.detach() * logp if advantages.dim() == 2 else -advantages.detach()[:, None] * logp
            loss = aggregate_token_loss(per_token, mask, self.aggregation, **denominators)
        elif self.clip_mode == "sequence":  # TRL: one ratio per completion
            # [b] advantages: token advantages with sequence ratios are refused by config.check_options.
            per_sequence, clip = sequence_clipped_surrogate(advantages, logp, old_logp, mask, self.eps_low,
                                                            self.eps_high)
            loss = per_sequence.sum() / denominators["num_sequences"]
            weight = torch.tensor(float(mask.shape[0]))
            stats = {n: (clip[n].detach() * weight, weight) for n in ("clip_low", "clip_high", "clip_region",
                                                                       "ratio_mean")}
        else:  # verl / OpenRLHF: one ratio per token, optional dual clip
            per_token, clip = token_clipped_surrogate(advantages, logp, old_logp, mask, self.eps_low, self.eps_high,
                                                      self.dual_clip)
            loss = aggregate_token_loss(per_token, mask, self.aggregation, **denominators)
            weight = mask.sum()
            stats = {n: (clip[n].detach() * weight, weight) for n in ("clip_low", "clip_high", "clip_region")}
        if self.kl_in_loss and ref_logp is not None:
            # GRPO / verl use_kl_loss: beta * KL estimate with its gradient, aggregated like the loss.
            # Off the mask both log-probs are selected to 0 first: a masked position's extreme log-ratio would
            # otherwise give exp's backward 0 * inf = NaN in the gradient (k3), though the sum selects it out.
            on = mask.bool()
            kl = kl_per_token(torch.where(on, logp, torch.zeros_like(logp)),
                              torch.where(on, ref_logp, torch.zeros_like(ref_logp)), self.kl_estimator, self.kl_clamp)
            loss = loss + beta * aggregate_token_loss(kl, mask, self.aggregation, **denominators)
        return loss, stats
