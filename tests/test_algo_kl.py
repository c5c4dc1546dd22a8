"""``rloo_lightning.algo.kl`` against small hand-computed tensors: the KL estimators (Schulman 2020), the KL folded
into the reward, OpenRLHF's per-token KL after the baseline and its reward-to-go, and mixing the policy into the
reference (TR-DPO).

Every expected value is a literal worked out by hand in the comments next to it.
"""

from __future__ import annotations

import math

import pytest
import torch

from algo_helpers import f64, nan, t
from rloo_lightning.algo.kl import fold_kl, kl_per_token, mix_into_reference, reward_to_go, token_rewards_after_baseline


def test_sequence_kl_hand_example():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.1, -0.2, -0.3]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.4, -0.2, -0.2]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # row 0: (-1 + 1.5) + (-2 + 1) = 0.5 - 1 = -0.5   (position 2 masked)
    # row 1: 0.3 + 0.0 + (-0.1) = 0.2
    token_kl, kl, shaped = fold_kl(torch.tensor([1.0, 2.0]), logp, ref, mask, beta=0.1)  # the training path's k1
    torch.testing.assert_close(kl, torch.tensor([-0.5, 0.2]))
    torch.testing.assert_close(token_kl, torch.tensor([[0.5, -1.0, 0.0], [0.3, 0.0, -0.1]]))
    torch.testing.assert_close(shaped, torch.tensor([1.0 + 0.05, 2.0 - 0.02]))  # R = r - beta * KL


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
