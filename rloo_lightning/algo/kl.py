"""The KL term: per-token estimators, OpenRLHF's per-token placement, and the moving reference.

The paper's placement (Ahmadian et al. 2024, Sec. 2.3) folds ``beta * sum_t k1_t`` into the sequence
reward before the baseline; the anchors' placements (per-token rewards after the baseline, a loss
term) are options. Pure: tensors in, tensors out. Shapes: ``B`` sequences, ``T`` completion length.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

import torch
from torch import Tensor


__all__ = [
    "KL_ESTIMATORS",
    "KL_PLACEMENTS",
    "kl_per_token",
    "token_rewards_after_baseline",
    "reward_to_go",
    "mix_into_reference",
    "fold_kl",
    "KLTerm",
]


# Schulman, "Approximating KL divergence" (2020): each estimator of KL(pi || pi_ref) as a function of the
# sampled token's log-ratio ``x = logp - ref_logp`` (any shape, elementwise). The option ``kl.estimator`` takes
# these names (``KLEstimator``).
KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": lambda x: x,
    "k2": lambda x: 0.5 * x**2,
    # r = pi_ref/pi = exp(-x); k3 = (r - 1) - log r, the Bregman form: >= 0, and E_pi[r - 1] = 0.
    "k3": lambda x: torch.exp(-x) + x - 1.0,
}


KLEstimator = Literal[tuple(KL_ESTIMATORS)]  # type: ignore[valid-type]  # the option's type, from the table


# Where the KL enters (``kl.placement``): the paper's sequence reward before the baseline, OpenRLHF's per-token
# reward after it, or a loss term (GRPO). Each place reads its own name: ``fold_kl`` (reward), the module's
# step 6 (token_reward), ``PolicyLoss`` (loss).
KL_PLACEMENTS: tuple[str, ...] = ("reward", "token_reward", "loss")


KLPlacement = Literal[KL_PLACEMENTS]  # type: ignore[valid-type]


def kl_per_token(
    logp: Tensor, ref_logp: Tensor, estimator: KLEstimator = "k1", clamp: float | None = None
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token's log-probs.

    Schulman, "Approximating KL divergence" (2020), with ``x = logp - ref_logp`` and ``y ~ pi``:

    - ``k1 = x``: unbiased, can be negative (the paper's and TRL's estimator, summed over tokens);
    - ``k2 = x**2 / 2``: non-negative, biased, low variance (OpenRLHF ``k2``, verl ``mse``);
    - ``k3 = exp(-x) + x - 1``: non-negative and unbiased for KL(pi || pi_ref) (OpenRLHF ``k3``,
      verl ``low_var_kl``, GRPO's KL loss term).

    Masking is the caller's (``logprobs.masked_sum``): values at padding are whatever the inputs
    hold there.

    Args:
        logp, ref_logp: ``[B, T]`` log-probs of the sampled tokens under the policy and the reference.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        clamp: if set, the estimate is clamped to ``[-clamp, clamp]`` afterwards (OpenRLHF clamps
            every estimator's output to ``[-10, 10]``). The clamp zeroes the gradient outside it.

    Returns:
        ``[B, T]``, in the dtype of ``logp - ref_logp``.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {', '.join(map(repr, KL_ESTIMATORS))}; got {estimator!r}")
    kl = KL_ESTIMATORS[estimator](logp - ref_logp)
    if clamp is not None:
        kl = kl.clamp(min=-clamp, max=clamp)
    return kl


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
    not the paper's placement (KL in the sequence reward before the baseline, the default): the
    KL term here has no baseline, so it is a different, higher-variance estimator.

    Args:
        advantages_seq: ``[B]`` per-sequence advantages ``r_i - b_i``.
        token_kl: ``[B, T]`` per-token KL estimate (``kl_per_token``); ignored where masked.
        mask: ``[B, T]`` completion mask. A row with no unmasked token gets no terminal reward.
        beta: KL coefficient.
        clip_range: if set, ``A_i`` is clamped first (OpenRLHF: ``(-10, 10)``):
            ``c`` for ``[-c, c]`` or ``(low, high)``.

    Returns:
        ``[B, T]`` token rewards, 0 at masked positions.
    """
    if advantages_seq.dim() != 1 or token_kl.shape != mask.shape or token_kl.shape[0] != advantages_seq.shape[0]:
        raise ValueError(
            f"expected advantages_seq [B] and token_kl, mask [B, T]; got {tuple(advantages_seq.shape)}, "
            f"{tuple(token_kl.shape)}, {tuple(mask.shape)}"
        )
    if isinstance(clip_range, (int, float)):
        clip_range = (-clip_range, clip_range)
    adv = advantages_seq if clip_range is None else advantages_seq.clamp(*clip_range)
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


def fold_kl(
    rewards: Tensor,
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    beta: float | Tensor,
    estimator: KLEstimator = "k1",
    clamp: float | None = None,
    placement: KLPlacement = "reward",
) -> tuple[Tensor, Tensor, Tensor]:
    """The KL of each sampled completion, and the reward the baseline is taken of.

    With ``placement="reward"`` (the paper, Sec. 2.3; TRL) the sequence KL is subtracted from the
    task reward *before* the baseline: ``R = r - beta * sum_t m_t kl_t``. With k1 this makes the
    RLOO gradient unbiased for ``E[r] - beta * KL(pi || pi_ref)``. The other placements leave ``R = r``
    (the KL enters after the baseline, :func:`token_rewards_after_baseline`, or in the loss).

    Args:
        rewards: ``[B]`` task rewards r (NaN = missing).
        logp: ``[B, T]`` policy log-probs of the sampled tokens, detached (the KL is a reward, not a loss).
        ref_logp: ``[B, T]`` reference log-probs.
        mask: ``[B, T]`` completion mask.
        beta: KL coefficient.

    Masked positions are selected out before the sum, so whatever ``logp``/``ref_logp`` hold there
    (``inf``, ``NaN``, a log-ratio whose ``k3`` overflows) cannot reach ``kl`` or ``R``.

    Returns:
        ``(token_kl [B, T] (0 off the mask), kl [B], R [B])``; ``token_kl`` in the dtype of ``kl_t * mask``.
    """
    token_kl = kl_per_token(logp, ref_logp, estimator, clamp)
    token_kl = token_kl.to(torch.promote_types(token_kl.dtype, mask.dtype))  # the dtype ``* mask`` gave
    # Select, never multiply: a masked inf or NaN (k3's exp(-x) overflows) times 0 is NaN.
    token_kl = torch.where(mask.bool(), token_kl, torch.zeros_like(token_kl))
    kl = token_kl.sum(1)
    shaped = rewards - beta * kl if placement == "reward" else rewards
    return token_kl, kl, shaped


class KLTerm:
    """The KL term's one home: where ``beta * KL(pi || pi_ref)`` enters (``kl.placement``), with its estimator.

    - ``reward`` (the paper, Sec. 2.3; TRL): :meth:`fold` subtracts the sequence KL from the reward before the
      baseline;
    - ``token_reward`` (OpenRLHF): :meth:`token_advantages` adds ``-beta*kl_t`` per token after the baseline;
    - ``loss`` (GRPO, verl ``use_kl_loss``): :attr:`in_loss`; ``losses.PolicyLoss`` adds ``beta * KL`` with its
      gradient.

    Args: as ``KLArgs`` (``estimator``, ``clamp``, ``placement``).
    """

    def __init__(self, estimator: KLEstimator = "k1", clamp: float | None = None,
                 placement: KLPlacement = "reward") -> None:
        if placement not in KL_PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(map(repr, KL_PLACEMENTS))}; got {placement!r}")
        self.estimator, self.clamp, self.placement = estimator, clamp, placement

    @classmethod
    def from_args(cls, args) -> KLTerm:
        """From a :class:`~rloo_lightning.config.KLArgs`."""
        return cls(args.estimator, args.clamp, args.placement)

    @property
    def in_loss(self) -> bool:
        return self.placement == "loss"

    def fold(self, rewards: Tensor, logp: Tensor | None, ref_logp: Tensor | None, mask: Tensor,
             beta: float | Tensor) -> tuple[Tensor | None, Tensor | None, Tensor]:
        """``(token_kl [B, T], kl [B], R [B])`` of :func:`fold_kl`; without a reference (``ref_logp`` None,
        beta == 0) ``(None, None, rewards)``: the baseline sees the reward itself."""
        if ref_logp is None:
            return None, None, rewards
        return fold_kl(rewards, logp, ref_logp, mask, beta, self.estimator, self.clamp, self.placement)

    def token_advantages(self, advantages: Tensor, token_kl: Tensor | None, loss_mask: Tensor,
                         beta: float) -> Tensor | None:
        """``[B, T]`` token advantages for ``token_reward`` (OpenRLHF: ``-beta*kl_t`` at every token and the
        sequence advantage ``[B]`` at the last one, summed to go with gamma = 1); None for the other placements
        or without a reference."""
        if self.placement != "token_reward" or token_kl is None:
            return None
        return reward_to_go(token_rewards_after_baseline(advantages, token_kl, loss_mask, beta), loss_mask)
