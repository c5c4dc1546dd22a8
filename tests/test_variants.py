"""Parity variants (issue 10) and baselines (issue 11) against small hand-computed tensors.

Every expected value is a literal worked out by hand in the comments next to it. The functions are
those of the training path: ``rloo_lightning.algo.kl``, ``losses``, ``advantages`` and ``shaping``.
"""

from __future__ import annotations

import math

import pytest
import torch

from rloo_lightning.algo.advantages import (
    AdvantageEstimator,
    MovingAverageBaseline,
    baseline_advantages,
    group_mean_advantages,
    group_mean_std_advantages,
    informative_groups,
    leave_one_out_advantages,
    whiten,
)
from rloo_lightning.algo.kl import kl_per_token, mix_into_reference, reward_to_go, token_rewards_after_baseline
from rloo_lightning.algo.losses import (
    PolicyLoss,
    aggregate_token_loss,
    sequence_clipped_surrogate,
    token_clipped_surrogate,
)
from rloo_lightning.algo.shaping import clip_rewards

nan = float("nan")
f64 = torch.float64


def t(values, dtype=f64):
    return torch.tensor(values, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# KL estimators (Schulman 2020)
# ---------------------------------------------------------------------------------------------
def test_kl_estimators_hand_computed():
    logp = t([[-1.0, -2.0]])
    ref = t([[-1.5, -1.0]])
    # x = logp - ref = [0.5, -1.0]
    torch.testing.assert_close(kl_per_token(logp, ref, "k1"), t([[0.5, -1.0]]))
    # k2 = x^2 / 2 = [0.125, 0.5]
    torch.testing.assert_close(kl_per_token(logp, ref, "k2"), t([[0.125, 0.5]]))
    # k3 = exp(-x) + x - 1: exp(-0.5) - 0.5 = 0.6065306597 - 0.5 = 0.1065306597;
    #                       exp(1) - 1 - 1 = 2.7182818285 - 2 = 0.7182818285
    torch.testing.assert_close(kl_per_token(logp, ref, "k3"), t([[0.1065306597, 0.7182818285]]), atol=1e-9, rtol=0)


def test_kl_clamp_like_openrlhf():
    logp = t([[0.0, 0.0]])
    ref = t([[-12.0, 12.0]])  # x = [12, -12]
    # k1 = [12, -12] -> clamped to [10, -10]
    torch.testing.assert_close(kl_per_token(logp, ref, "k1", clamp=10.0), t([[10.0, -10.0]]))
    # k2 = [72, 72] -> [10, 10]
    torch.testing.assert_close(kl_per_token(logp, ref, "k2", clamp=10.0), t([[10.0, 10.0]]))
    # k3 at x = 12: exp(-12) + 11 = 11.0000061 -> 10; at x = -12: exp(12) - 13 = 162741.8 -> 10
    torch.testing.assert_close(kl_per_token(logp, ref, "k3", clamp=10.0), t([[10.0, 10.0]]))
    # without the clamp k3(-12) = exp(12) - 13
    torch.testing.assert_close(kl_per_token(logp, ref, "k3")[0, 1], t(math.exp(12) - 13))


def test_kl_bad_estimator_names_the_argument():
    with pytest.raises(ValueError, match=r"estimator must be one of 'k1', 'k2', 'k3'; got 'k4'"):
        kl_per_token(t([[0.0]]), t([[0.0]]), "k4")


# ---------------------------------------------------------------------------------------------
# OpenRLHF placement: per-token KL after the baseline, reward-to-go
# ---------------------------------------------------------------------------------------------
def test_token_rewards_after_baseline_and_reward_to_go_hand_computed():
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    kl = t([[0.1, 0.2, -0.1, nan], [0.3, 0.0, 9.0, 9.0]])  # masked entries must not matter, even NaN
    adv = t([2.0, -1.0])
    rewards = token_rewards_after_baseline(adv, kl, mask, beta=0.5)
    # row 0: -0.5*kl = [-0.05, -0.1, 0.05]; A = 2 at the last token (t=2) -> [-0.05, -0.1, 2.05, 0]
    # row 1: -0.5*kl = [-0.15, 0.0]; A = -1 at t=1                          -> [-0.15, -1.0, 0, 0]
    torch.testing.assert_close(rewards, t([[-0.05, -0.1, 2.05, 0.0], [-0.15, -1.0, 0.0, 0.0]]))
    # reward-to-go (gamma 1): row 0: [-0.05-0.1+2.05, -0.1+2.05, 2.05, 0] = [1.9, 1.95, 2.05, 0]
    #                         row 1: [-0.15-1.0, -1.0, 0, 0]               = [-1.15, -1.0, 0, 0]
    torch.testing.assert_close(reward_to_go(rewards, mask), t([[1.9, 1.95, 2.05, 0.0], [-1.15, -1.0, 0.0, 0.0]]))


def test_token_rewards_clip_after_baseline_and_empty_row():
    mask = t([[1, 1], [1, 0], [0, 0]])
    kl = torch.zeros(3, 2, dtype=f64)
    # OpenRLHF clips r_i - b_i to [-10, 10]: 15 -> 10, -12 -> -10; the empty row gets nothing.
    rewards = token_rewards_after_baseline(t([15.0, -12.0, 7.0]), kl, mask, beta=0.1, clip_range=10.0)
    torch.testing.assert_close(rewards, t([[0.0, 10.0], [-10.0, 0.0], [0.0, 0.0]]))


def test_reward_to_go_is_advantage_minus_future_kl():
    """G_t = A_i - beta * sum_{t' >= t} kl_t' on unmasked positions (what OpenRLHF's rloo trains on)."""
    g = torch.Generator().manual_seed(0)
    kl = torch.randn(3, 5, generator=g, dtype=f64)
    mask = t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    adv = t([0.5, -2.0, 1.0])
    returns = reward_to_go(token_rewards_after_baseline(adv, kl, mask, beta=0.2), mask)
    future_kl = torch.flip(torch.cumsum(torch.flip(kl * mask, [1]), 1), [1])
    torch.testing.assert_close(returns, (adv[:, None] - 0.2 * future_kl) * mask)


def test_clip_rewards_keeps_nan_and_checks_range():
    # shaping.reward_clip's clip (the one reward clip of the training path): (-10, 10): -15 -> -10, 12 -> 10;
    # (low, high) = (-1, 2): -15 -> -1, 3 -> 2, 12 -> 2
    torch.testing.assert_close(clip_rewards(t([-15.0, 3.0, nan, 12.0]), -10.0, 10.0), t([-10.0, 3.0, nan, 10.0]),
                               equal_nan=True)
    torch.testing.assert_close(clip_rewards(t([-15.0, 3.0, nan, 12.0]), -1.0, 2.0), t([-1.0, 2.0, nan, 2.0]),
                               equal_nan=True)
    with pytest.raises(ValueError, match="low <= high"):
        clip_rewards(t([1.0]), 2.0, 1.0)


# ---------------------------------------------------------------------------------------------
# loss aggregation (verl's loss_agg_mode)
# ---------------------------------------------------------------------------------------------
LOSS = t([[1.0, 2.0, 3.0, nan], [4.0, 6.0, 100.0, 100.0]])  # masked entries: NaN and junk
MASK = t([[1, 1, 1, 0], [1, 1, 0, 0]])
# row sums: 1+2+3 = 6, 4+6 = 10; total 16; tokens 3+2 = 5; B = 2; T = 4


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("seq_sum", 8.0),  # 16 / B = 16/2
        ("token_mean", 3.2),  # 16 / tokens = 16/5
        ("seq_mean_token_mean", 3.5),  # (6/3 + 10/2) / 2 = (2 + 5)/2
        ("seq_mean_token_sum_norm", 2.0),  # 16 / (B * T) = 16/8
    ],
)
def test_aggregation_modes_hand_computed(mode, expected):
    torch.testing.assert_close(aggregate_token_loss(LOSS, MASK, mode), t(expected))


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        ("seq_sum", {"num_sequences": 4}, 4.0),  # 16/4
        ("token_mean", {"num_tokens": torch.tensor(10.0, dtype=f64)}, 1.6),  # 16/10
        ("seq_mean_token_mean", {"num_sequences": 4}, 1.75),  # (2 + 5)/4
        ("seq_mean_token_sum_norm", {"num_sequences": 4, "norm_constant": 8}, 0.5),  # 16/(4*8)
        ("seq_sum", {"num_tokens": 99, "norm_constant": 99}, 8.0),  # unused denominators are ignored
    ],
)
def test_aggregation_with_global_denominators(mode, kwargs, expected):
    torch.testing.assert_close(aggregate_token_loss(LOSS, MASK, mode, **kwargs), t(expected))


def test_aggregation_empty_row_and_empty_batch():
    mask = t([[1, 1, 1, 0], [0, 0, 0, 0]])
    # row 1 has no tokens: adds 0; seq_mean_token_mean = (6/3 + 0)/2 = 1; token_mean = 6/3 = 2
    torch.testing.assert_close(aggregate_token_loss(LOSS, mask, "seq_mean_token_mean"), t(1.0))
    torch.testing.assert_close(aggregate_token_loss(LOSS, mask, "token_mean"), t(2.0))
    # no token at all: 0, not NaN
    torch.testing.assert_close(aggregate_token_loss(LOSS, torch.zeros_like(mask), "token_mean"), t(0.0))


def policy_loss(adv, logp, mask):
    """The paper's loss written out: ``-1/B sum_i A_i sum_t m_t logp_t``."""
    return -(adv[:, None] * torch.where(mask.bool(), logp, torch.zeros_like(logp))).sum() / adv.shape[0]


def test_seq_sum_aggregation_is_the_papers_policy_loss():
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(4, 5, generator=g, dtype=f64)
    mask = (torch.rand(4, 5, generator=g) > 0.3).to(f64)
    adv = torch.randn(4, generator=g, dtype=f64)
    per_token = -adv[:, None] * logp
    torch.testing.assert_close(aggregate_token_loss(per_token, mask, "seq_sum"), policy_loss(adv, logp, mask))
    # and the update's default PolicyLoss is that aggregation
    torch.testing.assert_close(PolicyLoss()(logp, mask, adv, {})[0], policy_loss(adv, logp, mask))


def test_aggregation_bad_mode_and_constant():
    with pytest.raises(ValueError, match=r"mode must be one of 'seq_sum', 'token_mean', 'seq_mean_token_mean', "
                                         r"'seq_mean_token_sum_norm'; got 'token-mean'"):
        aggregate_token_loss(LOSS, MASK, "token-mean")
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate_token_loss(LOSS, MASK, "seq_mean_token_sum_norm", norm_constant=0)


# ---------------------------------------------------------------------------------------------
# clipped surrogates (rollout reuse)
# ---------------------------------------------------------------------------------------------
def test_sequence_clipped_surrogate_hand_computed():
    old = torch.zeros(4, 2, dtype=f64)
    logp = t([[0.1, 0.1], [-0.2, -0.3], [0.05, 7.0], [0.2, 0.2]]).requires_grad_(True)
    mask = t([[1, 1], [1, 1], [1, 0], [1, 1]])
    adv = t([1.0, -2.0, 0.5, -1.0])
    loss, stats = sequence_clipped_surrogate(adv, logp, old, mask, eps_low=0.2, eps_high=0.2)
    # row 0: log rho = 0.2, rho = e^0.2 = 1.2214028; A = 1: min(1.2214, clip 1.2) * 1 = 1.2 -> loss -1.2 (high clip)
    # row 1: log rho = -0.5, rho = e^-0.5 = 0.6065307; A = -2: min(-1.2130613, 0.8 * -2 = -1.6) = -1.6
    #        -> loss 1.6 (low clip)
    # row 2: log rho = 0.05 (the masked 7.0 is ignored), rho = 1.0512711 inside [0.8, 1.2]
    #        -> loss -0.5 * 1.0512711 = -0.5256355
    # row 3: log rho = 0.4, rho = 1.4918247 > 1.2 but A = -1 < 0, so the unclipped term is the min:
    #        min(-1.4918247, -1.2) = -1.4918247 -> loss 1.4918247 (not clipped: pessimistic bound)
    torch.testing.assert_close(loss, t([-1.2, 1.6, -0.5256355, 1.4918247]), atol=1e-6, rtol=0)
    torch.testing.assert_close(stats["clip_low"], torch.tensor(0.25))  # row 1
    torch.testing.assert_close(stats["clip_high"], torch.tensor(0.25))  # row 0
    torch.testing.assert_close(stats["clip_region"], torch.tensor(0.5))
    # gradients: clipped rows 0 and 1 have none; row 2: d(-A rho)/d logp_t = -0.5 * 1.0512711 on its unmasked
    # token, 0 on the masked one; row 3: -A rho = 1.4918247 on both tokens.
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    expected = t([[0.0, 0.0], [0.0, 0.0], [-0.5256355, 0.0], [1.4918247, 1.4918247]])
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)


def test_token_clipped_surrogate_with_dual_clip_hand_computed():
    old = torch.zeros(1, 5, dtype=f64)
    logp = t([[math.log(1.5), math.log(0.5), math.log(4.0), math.log(1.1), nan]]).requires_grad_(True)
    mask = t([[1, 1, 1, 1, 0]])  # the 5th token is padding, with a NaN log-prob
    adv = t([[1.0, -1.0, -1.0, 2.0, 5.0]])
    loss, stats = token_clipped_surrogate(adv, logp, old, mask, eps_low=0.2, eps_high=0.2, dual_clip_c=3.0)
    # t0: A=1,  rho=1.5: max(-1.5, -1.2) = -1.2                      (high clip)
    # t1: A=-1, rho=0.5: max(0.5, 0.8) = 0.8                         (low clip)
    # t2: A=-1, rho=4:   max(4, 1.2) = 4, dual cap -c*A = 3: min(4, 3) = 3   (dual clip)
    # t3: A=2,  rho=1.1: max(-2.2, -2.2) = -2.2                      (inside the range)
    # t4: masked -> 0
    torch.testing.assert_close(loss, t([[-1.2, 0.8, 3.0, -2.2, 0.0]]))
    # fractions over the 4 unmasked tokens
    torch.testing.assert_close(stats["clip_low"], torch.tensor(0.25))
    torch.testing.assert_close(stats["clip_high"], torch.tensor(0.25))
    torch.testing.assert_close(stats["clip_region"], torch.tensor(0.5))
    torch.testing.assert_close(stats["dual_clip"], torch.tensor(0.25))
    torch.testing.assert_close(stats["num_tokens"], torch.tensor(4.0))
    # gradient: only t3 is unclipped: d(-A rho)/d logp = -A rho = -2.2; the NaN padding leaks nothing.
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad, t([[0.0, 0.0, 0.0, -2.2, 0.0]]))

    # without the dual clip t2 keeps the pessimistic max 4, with gradient -A rho = 4
    loss, stats = token_clipped_surrogate(adv, logp, old, mask, eps_low=0.2, eps_high=0.2)
    torch.testing.assert_close(loss, t([[-1.2, 0.8, 4.0, -2.2, 0.0]]))
    assert stats["dual_clip"].item() == 0.0
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad, t([[0.0, 0.0, 4.0, -2.2, 0.0]]))


def test_token_clipped_surrogate_asymmetric_eps_and_sequence_advantages():
    # eps_low = 0.1, eps_high = 0.3 (DAPO's clip-higher): rho = 1.25 with A = 1 is inside [0.9, 1.3] -> -1.25;
    # rho = 0.85 with A = -1 is below 0.9 -> max(0.85, 0.9) = 0.9. A is [B] and broadcast over T.
    logp = t([[math.log(1.25), math.log(0.85)]])
    loss, stats = token_clipped_surrogate(t([1.0]), logp, torch.zeros_like(logp), torch.ones_like(logp),
                                          eps_low=0.1, eps_high=0.3)
    torch.testing.assert_close(loss, t([[-1.25, -0.85]]))  # A = +1 on both tokens: t1 is -0.85, not clipped
    loss, stats = token_clipped_surrogate(t([-1.0]), logp, torch.zeros_like(logp), torch.ones_like(logp),
                                          eps_low=0.1, eps_high=0.3)
    torch.testing.assert_close(loss, t([[1.25, 0.9]]))  # A = -1: t0 max(1.25, 1.25); t1 max(0.85, 0.9)
    torch.testing.assert_close(stats["clip_low"], torch.tensor(0.5))


def test_surrogate_argument_errors():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        token_clipped_surrogate(torch.ones(1), x, x, torch.ones(1, 2), dual_clip_c=1.0)
    with pytest.raises(ValueError, match="eps_low and eps_high must be >= 0"):
        sequence_clipped_surrogate(torch.ones(1), x, x, torch.ones(1, 2), eps_low=-0.1)


def _reinforce_setup():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 5, 7, generator=g, dtype=f64, requires_grad=True)
    tokens = torch.randint(0, 7, (6, 5), generator=g)
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    mask = t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    adv = t([1.5, -0.5, -2.0, 0.0, 0.7, -1.1])
    (expected,) = torch.autograd.grad(policy_loss(adv, logp, mask), logits, retain_graph=True)
    return logits, logp, mask, adv, expected


def test_sequence_surrogate_at_ratio_one_is_reinforce():
    logits, logp, mask, adv, expected = _reinforce_setup()
    loss, stats = sequence_clipped_surrogate(adv, logp, logp.detach(), mask, eps_low=0.2, eps_high=0.28)
    assert stats["clip_region"].item() == 0.0
    (grad,) = torch.autograd.grad(loss.mean(), logits)  # TRL: per_sequence_loss.mean()
    torch.testing.assert_close(grad, expected)
    assert expected.abs().max() > 1e-3


@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
def test_token_surrogate_at_ratio_one_is_reinforce(dual_clip_c):
    logits, logp, mask, adv, expected = _reinforce_setup()
    loss, stats = token_clipped_surrogate(adv, logp, logp.detach(), mask, dual_clip_c=dual_clip_c)
    assert stats["clip_region"].item() == 0.0 and stats["dual_clip"].item() == 0.0
    (grad,) = torch.autograd.grad(aggregate_token_loss(loss, mask, "seq_sum"), logits)
    torch.testing.assert_close(grad, expected)


def test_openrlhf_pipeline_with_beta_zero_reduces_to_reinforce():
    """beta = 0: reward-to-go is A_i on every unmasked token, and the token surrogate at ratio 1
    with seq_sum aggregation is the paper's REINFORCE gradient."""
    logits, logp, mask, adv, expected = _reinforce_setup()
    kl = kl_per_token(logp.detach(), torch.zeros_like(logp), "k3", clamp=10.0)
    token_adv = reward_to_go(token_rewards_after_baseline(adv, kl, mask, beta=0.0), mask)
    torch.testing.assert_close(token_adv, adv[:, None] * mask)
    loss, _ = token_clipped_surrogate(token_adv, logp, logp.detach(), mask)
    (grad,) = torch.autograd.grad(aggregate_token_loss(loss, mask, "seq_sum"), logits)
    torch.testing.assert_close(grad, expected)


# ---------------------------------------------------------------------------------------------
# whitening and reward normalisation
# ---------------------------------------------------------------------------------------------
def test_whiten_hand_computed():
    # mean 2.5; unbiased var = (2.25 + 0.25 + 0.25 + 2.25)/3 = 5/3; std = 1.2909944
    # -> [-1.5, -0.5, 0.5, 1.5] / 1.2909944 = [-1.1618950, -0.3872983, 0.3872983, 1.1618950]
    torch.testing.assert_close(whiten(t([1.0, 2.0, 3.0, 4.0]), eps=0.0),
                               t([-1.1618950, -0.3872983, 0.3872983, 1.1618950]), atol=1e-6, rtol=0)
    # TRL's eps 1e-4 by default: 1.5 / (1.2909944 + 1e-4) = 1.1618050
    torch.testing.assert_close(whiten(t([1.0, 2.0, 3.0, 4.0]))[3], t(1.1618050), atol=1e-6, rtol=0)


def test_whiten_mask_nan_and_shift_mean():
    values = t([1.0, nan, 3.0, 5.0, 100.0])
    mask = t([1, 1, 1, 1, 0])
    # selected {1, 3, 5}: mean 3; var = (4 + 0 + 4)/2 = 4; std 2 -> [-1, ., 0, 1]; NaN and masked entries untouched
    torch.testing.assert_close(whiten(values, mask, eps=0.0), t([-1.0, nan, 0.0, 1.0, 100.0]), equal_nan=True)
    # shift_mean=False adds the mean 3 back: [2, ., 3, 4]
    torch.testing.assert_close(whiten(values, mask, shift_mean=False, eps=0.0), t([2.0, nan, 3.0, 4.0, 100.0]),
                               equal_nan=True)
    # a single selected entry: std taken as 0, the centred value 0 stays 0
    torch.testing.assert_close(whiten(t([7.0, nan])), t([0.0, nan]), equal_nan=True)


def test_whiten_token_level_values():
    values = t([[1.0, 3.0, 9.0], [5.0, 9.0, 9.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    # selected {1, 3, 5}: mean 3, std 2 -> [[-1, 0, 9], [1, 9, 9]]
    torch.testing.assert_close(whiten(values, mask, eps=0.0), t([[-1.0, 0.0, 9.0], [1.0, 9.0, 9.0]]))


def test_normalize_rewards_keeps_missing_missing():
    # advantage.normalize_rewards: valid {0, 2, 4}: mean 2; var = (4 + 0 + 4)/2 = 4; std 2 -> [-1, 0, ., 1]
    # (with the eps 1e-4 of the training path: +-2 / (2 + 1e-4) = +-0.99995)
    rewards = t([0.0, 2.0, nan, 4.0])
    normalized = AdvantageEstimator(2, normalize_rewards=True).normalize(rewards)
    torch.testing.assert_close(normalized, t([-2 / 2.0001, 0.0, nan, 2 / 2.0001]), equal_nan=True)
    torch.testing.assert_close(whiten(rewards, eps=0.0), t([-1.0, 0.0, nan, 1.0]), equal_nan=True)
    assert AdvantageEstimator(2).normalize(rewards) is rewards  # off by default


# ---------------------------------------------------------------------------------------------
# baselines (issue 11)
# ---------------------------------------------------------------------------------------------
REWARDS = t([1.0, 2.0, 3.0, 6.0,  # full group
             2.0, nan, 4.0, nan,  # two valid
             nan, 5.0, nan, nan,  # one valid
             3.0, 3.0, 3.0, 3.0])  # constant


def test_group_mean_hand_computed():
    # group 0: mean 12/4 = 3 -> [-2, -1, 0, 3]; group 1: valid {2, 4}, mean 3 -> [-1, 0, 1, 0];
    # group 2: one valid -> 0; group 3: constant -> 0
    expected = t([-2.0, -1.0, 0.0, 3.0, -1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_mean_advantages(REWARDS, 4), expected)
    torch.testing.assert_close(baseline_advantages(REWARDS, 4, "group_mean"), expected)


def test_group_mean_std_hand_computed():
    # group 0: deviations [-2, -1, 0, 3], SS = 4 + 1 + 0 + 9 = 14, Bessel var = 14/3, std = 2.1602469
    #          -> [-0.9258201, -0.4629100, 0, 1.3887301]
    # group 1: valid {2, 4}: deviations [-1, 1], SS = 2, var = 2/1, std = 1.4142136 -> [-0.7071068, 0, 0.7071068, 0]
    # group 2: one valid -> 0; group 3: std 0 -> 0 / (0 + eps) = 0
    expected = t([-0.9258201, -0.4629100, 0.0, 1.3887301, -0.7071068, 0.0, 0.7071068, 0.0,
                  0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_mean_std_advantages(REWARDS, 4, eps=0.0), expected, atol=1e-6, rtol=0)
    # TRL's eps = 1e-4: 3 / (2.1602469 + 1e-4) = 1.3886658
    torch.testing.assert_close(baseline_advantages(REWARDS, 4, "group_mean_std")[3], t(1.3886658), atol=1e-6, rtol=0)


def test_group_mean_std_matches_torch_std_without_missing():
    g = torch.Generator().manual_seed(4)
    r = torch.randn(5 * 4, generator=g, dtype=f64)
    grouped = r.view(-1, 4)
    expected = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
    torch.testing.assert_close(group_mean_std_advantages(r, 4), expected.view(-1))


def test_group_mean_is_k_minus_1_over_k_times_leave_one_out():
    """A^LOO = n/(n-1) (r - mean) with n the group's valid count, so A^mean = (n-1)/n A^LOO: with
    nothing missing n = k; with missing rewards n is the number of valid ones (0 where n < 2)."""
    # hand-computed: group 0 of REWARDS: LOO = 4/3 * [-2, -1, 0, 3] = [-8/3, -4/3, 0, 4]
    #   (e.g. r=1: b = (12 - 1)/3 = 11/3, A = 1 - 11/3 = -8/3); group 1: LOO = [2-4, 0, 4-2, 0] = [-2, 0, 2, 0]
    loo = leave_one_out_advantages(REWARDS.float(), 4).double()
    torch.testing.assert_close(loo[:8], t([-8 / 3, -4 / 3, 0.0, 4.0, -2.0, 0.0, 2.0, 0.0]))
    g = torch.Generator().manual_seed(5)
    for k in (2, 3, 4, 6):
        r = torch.randn(8 * k, generator=g, dtype=f64)
        r[torch.rand(8 * k, generator=g) < 0.3] = nan
        n = (~torch.isnan(r.view(-1, k))).sum(1, keepdim=True).to(f64)
        scale = ((n - 1) / n.clamp(min=1)).expand(-1, k).reshape(-1)
        torch.testing.assert_close(group_mean_advantages(r, k), scale * leave_one_out_advantages(r, k))
        full = torch.randn(8 * k, generator=g, dtype=f64)
        torch.testing.assert_close(group_mean_advantages(full, k), (k - 1) / k * leave_one_out_advantages(full, k))


def test_none_baseline_and_leave_one_out_dispatch():
    # vanilla REINFORCE: A = R, a missing reward gives 0
    torch.testing.assert_close(baseline_advantages(t([1.0, nan, -2.0, 3.0]), 2, "none"), t([1.0, 0.0, -2.0, 3.0]))
    torch.testing.assert_close(baseline_advantages(REWARDS, 4), leave_one_out_advantages(REWARDS, 4))


def test_moving_average_baseline_hand_computed():
    ma = MovingAverageBaseline(decay=0.5)
    # batch 1: no history -> b = 0, A = R = [1, 3]; batch mean 2: ema = 0.5*0 + 0.5*2 = 1, m = 1
    torch.testing.assert_close(ma.advantages(t([1.0, 3.0])), t([1.0, 3.0]))
    # bias-corrected: 1 / (1 - 0.5^1) = 2
    assert ma.value == pytest.approx(2.0)
    # batch 2: b = 2 -> A = [4-2, 0 (missing), 6-2]; mean of valid = 5: ema = 0.5*1 + 0.5*5 = 3, m = 2
    torch.testing.assert_close(ma.advantages(t([4.0, nan, 6.0])), t([2.0, 0.0, 4.0]))
    # 3 / (1 - 0.25) = 4 (= (0.25*2 + 0.5*5) / 0.75, the normalised weights of the two means)
    assert ma.value == pytest.approx(4.0)
    # an all-missing batch is no update
    torch.testing.assert_close(ma.advantages(t([nan, nan])), t([0.0, 0.0]))
    assert ma.num_updates == 2 and ma.value == pytest.approx(4.0)

    # checkpoint round trip
    state = ma.state_dict()
    assert state == {"decay": 0.5, "ema": 3.0, "num_updates": 2}
    restored = MovingAverageBaseline(decay=0.5)
    restored.load_state_dict(state)
    # batch 3 with an explicit (e.g. all-reduced) mean 10: A = 8 - 4 = 4; ema = 0.5*3 + 0.5*10 = 6.5, m = 3
    torch.testing.assert_close(restored.advantages(t([8.0]), batch_mean=10.0), t([4.0]))
    # 6.5 / (1 - 0.125) = 7.4285714
    assert restored.value == pytest.approx(7.4285714)
    with pytest.raises(ValueError, match="decay=0.5"):
        MovingAverageBaseline(decay=0.9).load_state_dict(state)


def test_moving_average_through_the_dispatcher():
    ma = MovingAverageBaseline(decay=0.0)  # decay 0: b = last batch's mean
    torch.testing.assert_close(baseline_advantages(t([1.0, 3.0]), 2, "moving_average", moving_average=ma),
                               t([1.0, 3.0]))
    # b = 2 (last mean) -> [5-2, 7-2]
    torch.testing.assert_close(baseline_advantages(t([5.0, 7.0]), 2, "moving_average", moving_average=ma),
                               t([3.0, 5.0]))
    with pytest.raises(ValueError, match="moving_average="):
        baseline_advantages(t([1.0, 2.0]), 2, "moving_average")
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\)"):
        MovingAverageBaseline(decay=1.0)


def test_baseline_argument_errors():
    with pytest.raises(ValueError, match=r"baseline must be one of 'leave_one_out', 'none', 'moving_average', "
                                         r"'group_mean_std', 'group_mean'; got 'grpo'"):
        baseline_advantages(REWARDS, 4, "grpo")
    with pytest.raises(ValueError, match="needs k >= 2"):
        baseline_advantages(t([1.0, 2.0]), 1, "group_mean_std")
    with pytest.raises(ValueError, match="divisible by k=3"):
        baseline_advantages(t([1.0, 2.0]), 3, "none")


# ---------------------------------------------------------------------------------------------
# reference mixing (TR-DPO) and informative groups (dynamic sampling)
# ---------------------------------------------------------------------------------------------
def test_mix_into_reference_hand_computed():
    ref = [t([1.0, 2.0]), t([[0.0]])]
    pol = [t([3.0, 6.0]), t([[10.0]])]
    mix_into_reference(ref, pol, alpha=0.6)
    # 0.6*3 + 0.4*1 = 2.2; 0.6*6 + 0.4*2 = 4.4; 0.6*10 + 0.4*0 = 6
    torch.testing.assert_close(ref[0], t([2.2, 4.4]))
    torch.testing.assert_close(ref[1], t([[6.0]]))
    torch.testing.assert_close(pol[0], t([3.0, 6.0]))  # the policy is untouched


def test_mix_into_reference_modules_dtypes_and_errors():
    ref_net, pol_net = torch.nn.Linear(2, 1).double(), torch.nn.Linear(2, 1)
    with torch.no_grad():
        ref_net.weight.fill_(1.0), ref_net.bias.fill_(0.0)
        pol_net.weight.fill_(2.0), pol_net.bias.fill_(4.0)
    mix_into_reference(ref_net.parameters(), pol_net.parameters(), alpha=0.5)
    # 0.5*2 + 0.5*1 = 1.5; 0.5*4 + 0.5*0 = 2 (float32 policy into a float64 reference)
    torch.testing.assert_close(ref_net.weight, t([[1.5, 1.5]]))
    torch.testing.assert_close(ref_net.bias, t([2.0]))
    mix_into_reference(ref_net.parameters(), pol_net.parameters(), alpha=1.0)  # hard copy
    torch.testing.assert_close(ref_net.weight, t([[2.0, 2.0]]))
    with pytest.raises(ValueError, match="alpha"):
        mix_into_reference([t([1.0])], [t([1.0])], alpha=1.5)
    with pytest.raises(ValueError, match="2 tensors"):
        mix_into_reference([t([1.0]), t([1.0])], [t([1.0])])
    with pytest.raises(ValueError, match="shape"):
        mix_into_reference([t([1.0])], [t([1.0, 2.0])])


def test_informative_groups():
    rewards = t([1.0, 1.0, 1.0,  # all equal -> False
                 0.0, 1.0, 0.0,  # spread 1 -> True
                 2.0, nan, 2.0,  # valid ones equal -> False
                 nan, nan, 5.0,  # one valid -> False
                 0.0, 0.05, nan])  # spread 0.05 -> True at atol 0, False at atol 0.1
    assert informative_groups(rewards, 3).tolist() == [False, True, False, False, True]
    assert informative_groups(rewards, 3, atol=0.1).tolist() == [False, True, False, False, False]
