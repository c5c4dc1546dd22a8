"""``rloo_lightning.algo.correction`` by hand: importance weights, mismatch sums and weighted advantages for a sampler
that is not exactly pi_theta.
"""

from __future__ import annotations

import math

import pytest
import torch

from rloo_lightning.algo.correction import importance_weights, mismatch_sums, weighted_advantages

# two sequences of 3 tokens; the second has 2 (its last position is padding)
LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -9.0]])
SAMPLER = torch.tensor([[-1.0, -1.0, -1.5], [-0.2, -2.0, -1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
# log r = logp - sampler on the mask: [0, -1, 1] and [0.1, -1]


def test_sequence_and_token_weights_by_hand():
    seq = importance_weights(LOGP, SAMPLER, MASK, "sequence", cap=None)
    torch.testing.assert_close(seq, torch.tensor([math.exp(0.0), math.exp(-0.9)]))
    torch.testing.assert_close(importance_weights(LOGP, SAMPLER, MASK, "sequence", cap=0.5),
                               torch.tensor([0.5, math.exp(-0.9)]))
    tok = importance_weights(LOGP, SAMPLER, MASK, "token", cap=2.0)
    torch.testing.assert_close(tok, torch.tensor([[1.0, math.exp(-1), 2.0], [math.exp(0.1), math.exp(-1), 0.0]]))
    # mask mode: a weight outside [1/cap, cap] is 0, one inside is kept as it is
    masked = importance_weights(LOGP, SAMPLER, MASK, "token", mode="mask", cap=2.0)
    torch.testing.assert_close(masked, torch.tensor([[1.0, 0.0, 0.0], [math.exp(0.1), 0.0, 0.0]]))
    lower = importance_weights(LOGP, SAMPLER, MASK, "sequence", mode="mask", cap=2.0, lower=0.1)
    torch.testing.assert_close(lower, torch.tensor([1.0, math.exp(-0.9)]))
    assert not importance_weights(LOGP.requires_grad_(), SAMPLER, MASK, "token").requires_grad  # detached
    LOGP.requires_grad_(False)


def test_mismatch_sums_by_hand():
    sums = {name: (float(s), float(n)) for name, (s, n) in mismatch_sums(LOGP, SAMPLER, MASK).items()}
    deltas = [0.0, -1.0, 1.0, 0.1, -1.0]
    assert sums["mismatch/kl_k1"] == pytest.approx((-sum(deltas), 5.0))
    assert sums["mismatch/kl_k3"] == pytest.approx((sum(math.exp(d) - 1 - d for d in deltas), 5.0))
    # ratios e^-1 = 0.37 and e^1 = 2.72 are outside [0.5, 2]; those and e^0.1 = 1.105 outside [0.9, 1.1]
    assert sums["mismatch/ratio_outside_0.5_2.0"] == pytest.approx((3.0, 5.0))
    assert sums["mismatch/ratio_outside_0.9_1.1"] == pytest.approx((4.0, 5.0))
    assert sums["mismatch/seq_log_ratio"] == pytest.approx((0.0 - 0.9, 2.0))
    assert sums["mismatch/seq_log_ratio_sq"] == pytest.approx((0.81, 2.0))


def test_weighted_advantages_shapes():
    adv = torch.tensor([1.0, -2.0])
    torch.testing.assert_close(weighted_advantages(adv, torch.tensor([0.5, 2.0])), torch.tensor([0.5, -4.0]))
    token = weighted_advantages(adv, torch.tensor([[1.0, 2.0], [0.5, 0.0]]))
    torch.testing.assert_close(token, torch.tensor([[1.0, 2.0], [-1.0, 0.0]]))
    torch.testing.assert_close(weighted_advantages(torch.ones(2, 2), torch.tensor([3.0, 0.5])),
                               torch.tensor([[3.0, 3.0], [0.5, 0.5]]))
