"""Reward shaping on the rollout's tensors: missing-EOS penalty, DAPO overlong penalty, clipping.

Pure tensor functions (no Lightning, no tokenizer): ``[B]`` in, ``[B]`` out, where ``B = N*k``
completions. A ``NaN`` reward (missing) stays ``NaN`` through all of them, so a completion
without a reward stays out of its group's baseline.

These need what the reward functions do not see: whether a completion ended with EOS
(``rollout.truncated``) and its length in tokens (``rollout.completion_mask.sum(1)``, EOS
included). A sensible order on the weighted task reward ``r`` before the KL term is folded in::

    r = r + overlong_penalty(lengths, max_len, buffer, factor)
    r = missing_eos_penalty(r, truncated, penalty)
    r = clip_rewards(r, low, high)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["missing_eos_penalty", "overlong_penalty", "clip_rewards", "shape_rewards"]


def missing_eos_penalty(rewards: Tensor, truncated: Tensor, penalty: float) -> Tensor:
    """Subtract ``penalty`` from the reward of every completion that has no EOS.

    Source: TRL <= 0.21 (``RLOOConfig.missing_eos_penalty``: ``scores[~contain_eos_token] -=
    missing_eos_penalty``), removed from TRL's later RLOO. It pushes the policy to finish within
    ``max_new_tokens``. (OpenRLHF's ``stop_properly_penalty_coef`` differs: it *scales* the reward
    of a truncated sample by a coefficient in [0, 1].)

    Args:
        rewards: ``[B]`` float rewards (NaN = missing, stays NaN).
        truncated: ``[B]`` bool, True where the completion has no EOS within the budget.
        penalty: the amount subtracted (>= 0, e.g. 1.0).

    Returns:
        ``[B]`` ``rewards - penalty * truncated``, same dtype as ``rewards``.
    """
    if rewards.shape != truncated.shape:
        raise ValueError(f"missing_eos_penalty: rewards {tuple(rewards.shape)} and truncated "
                         f"{tuple(truncated.shape)} must have the same shape [B]")
    if not (math.isfinite(penalty) and penalty >= 0):
        raise ValueError(f"missing_eos_penalty must be a finite number >= 0, got {penalty}")
    return rewards - penalty * truncated.to(rewards.dtype)


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, Eq. 13), to be *added* to the reward.

    With ``L = lengths``, ``L_max = max_len`` and ``L_cache = buffer``::

        R_length(L) = 0                                  if L <= L_max - L_cache
                    = ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
                    = -1                                 if L > L_max

    times ``factor`` (verl's ``overlong_buffer.penalty_factor``). The penalty grows linearly
    through the last ``buffer`` tokens before ``max_len`` and reaches ``-factor`` at
    ``max_len``, so a completion truncated at ``max_new_tokens == max_len`` gets ``-factor``.

    Args:
        lengths: ``[B]`` completion lengths in tokens (int or float; EOS included, as
            ``completion_mask.sum(1)``).
        max_len: ``L_max``, usually ``max_new_tokens``.
        buffer: ``L_cache``, with ``0 < buffer <= max_len``.
        factor: scale of the penalty (>= 0).

    Returns:
        ``[B]`` float32 penalties in ``[-factor, 0]``.
    """
    if max_len < 1:
        raise ValueError(f"overlong_penalty: max_len must be >= 1, got {max_len}")
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong_penalty: the buffer must satisfy 0 < buffer <= max_len={max_len}, got {buffer}")
    if not (math.isfinite(factor) and factor >= 0):
        raise ValueError(f"overlong_penalty: factor must be a finite number >= 0, got {factor}")
    lengths = lengths.to(torch.float32)
    soft = ((max_len - buffer) - lengths) / buffer
    penalty = torch.where(lengths <= max_len - buffer, torch.zeros_like(lengths), soft)
    penalty = torch.where(lengths > max_len, torch.full_like(lengths, -1.0), penalty)
    return factor * penalty


def clip_rewards(rewards: Tensor, low: float, high: float) -> Tensor:
    """Clip rewards to ``[low, high]`` (NaN stays NaN).

    Source: TRL's ``reward_clip_range`` (on the weighted sum of the reward functions, before the
    KL term; OpenRLHF clips to ``[-10, 10]``, after its baseline); a guard against a reward
    model's outliers dominating the leave-one-out baseline.

    Args:
        rewards: ``[B]`` float rewards.
        low, high: bounds, ``low <= high``.

    Returns:
        ``[B]`` clipped rewards, same dtype.
    """
    if not low <= high:
        raise ValueError(f"reward clip range must have low <= high, got ({low}, {high})")
    return rewards.clamp(min=low, max=high)


def shape_rewards(rewards: Tensor, completion_mask: Tensor, truncated: Tensor, args, max_new_tokens: int) -> Tensor:
    """The configured shaping of the task reward, in order: DAPO overlong penalty, missing-EOS penalty, clip.

    Args:
        rewards: ``[B]`` weighted task rewards (NaN = missing, stays NaN).
        completion_mask: ``[B, T]``; its row sums are the lengths (EOS included).
        truncated: ``[B]`` bool, no EOS.
        args: a :class:`~rloo_lightning.config.ShapingArgs`; all of it off leaves ``rewards`` as they are.
        max_new_tokens: the completion budget (the overlong penalty's ``max_len``).

    Returns:
        ``[B]``.
    """
    r = rewards
    if args.overlong_buffer > 0:
        r = r + overlong_penalty(completion_mask.sum(1), max_new_tokens, args.overlong_buffer, args.overlong_factor)
    if args.missing_eos_penalty:
        r = missing_eos_penalty(r, truncated, args.missing_eos_penalty)
    if args.reward_clip is not None:
        r = clip_rewards(r, *args.reward_clip)
    return r
