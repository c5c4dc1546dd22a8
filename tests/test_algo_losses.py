"""``rloo_lightning.algo.losses`` against small hand-computed tensors: loss aggregation (verl's ``loss_agg_mode``),
the clipped surrogates of rollout reuse, and both reduced to the paper's REINFORCE at ratio 1.

Every expected value is a literal worked out by hand in the comments next to it.
"""

from __future__ import annotations

import math

import pytest
import torch

from algo_helpers import f64, nan, t
from rloo_lightning.algo.kl import kl_per_token, reward_to_go, token_rewards_after_baseline
from rloo_lightning.algo.losses import (
    PolicyLoss,
    aggregate_token_loss,
    sequence_clipped_surrogate,
    token_clipped_surrogate,
)


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
