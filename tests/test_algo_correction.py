"""``rloo_lightning.algo.correction`` by hand: importance weights, mismatch sums and weighted advantages for a sampler
that is not exactly pi_theta.
"""

from __future__ import annotations

import math

import pytest
import torch

from rloo_lightning.algo.correction import (
    bounded, importance_weights, mismatch_sums, sequence_log_ratios, topr_advantages, weighted_advantages,
    with_rejection,
)

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


# -- the 2026 family: geometric ratios, rejection, TOPR ----------------------------------------------------------
# Sequence log-ratios on the mask: product [0, -0.9]; geometric (mean over each row's own tokens) [0 / 3, -0.9 / 2].
GEO = torch.tensor([1.0, math.exp(-0.45)])


def _check_geometric(log_ratios):
    """The literals a geometric sequence ratio must give on LOGP/SAMPLER/MASK, and on an episode whose middle token is
    the environment's (off the mask, with a log-ratio of -49 there that must not count)."""
    torch.testing.assert_close(log_ratios(LOGP, SAMPLER, MASK, "geometric"), torch.tensor([0.0, -0.45]))
    episode = log_ratios(torch.tensor([[-1.0, -50.0, -1.0]]), torch.tensor([[-1.5, -1.0, -1.5]]),
                         torch.tensor([[1.0, 0.0, 1.0]]), "geometric")
    torch.testing.assert_close(episode, torch.tensor([0.5]))  # (0.5 + 0.5) / 2 policy tokens


def test_sequence_log_ratios_by_hand():
    torch.testing.assert_close(sequence_log_ratios(LOGP, SAMPLER, MASK), torch.tensor([0.0, -0.9]))
    _check_geometric(sequence_log_ratios)
    empty = sequence_log_ratios(LOGP, SAMPLER, torch.zeros_like(MASK), "geometric")
    torch.testing.assert_close(empty, torch.zeros(2))  # no token on the mask: ratio 1, no 0 / 0


def test_planted_bug_geometric_mean_over_the_padded_length_is_caught():
    """A geometric mean that divides by the padded width T (or counts an environment's tokens) gives other numbers."""
    def over_width(logp, sampler_logp, mask, kind):
        return sequence_log_ratios(logp, sampler_logp, mask) / mask.shape[1]

    with pytest.raises(AssertionError):
        _check_geometric(over_width)


def test_geometric_weights_masks_and_geo_mask_by_hand():
    torch.testing.assert_close(importance_weights(LOGP, SAMPLER, MASK, "geometric", cap=None), GEO)
    torch.testing.assert_close(importance_weights(LOGP, SAMPLER, MASK, "geometric", cap=0.8),
                               torch.tensor([0.8, math.exp(-0.45)]))
    # mask (MIS on the geometric ratio): e^-0.45 = 0.638 is below lower 0.7 -> 0; 1 is kept as it is
    torch.testing.assert_close(importance_weights(LOGP, SAMPLER, MASK, "geometric", "mask", cap=2.0, lower=0.7),
                               torch.tensor([1.0, 0.0]))
    # reject (Geo-Mask: a filter, no weight): inside [0.5, 2] both rows are kept with weight 1
    torch.testing.assert_close(importance_weights(LOGP, SAMPLER, MASK, "geometric", "reject", cap=2.0),
                               torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(importance_weights(LOGP, SAMPLER, MASK, "geometric", "reject", cap=1.5, lower=0.7),
                               torch.tensor([1.0, 0.0]))
    # reject at token level: [r in [0.5, 2]] per token: e^-1 and e^1 are out
    torch.testing.assert_close(importance_weights(LOGP, SAMPLER, MASK, "token", "reject", cap=2.0),
                               torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    torch.testing.assert_close(bounded(torch.tensor([0.1, 5.0]), "mask", None, None), torch.tensor([0.1, 5.0]))
    with pytest.raises(ValueError, match="level must be"):
        importance_weights(LOGP, SAMPLER, MASK, "geo")
    with pytest.raises(ValueError, match="mode must be"):
        importance_weights(LOGP, SAMPLER, MASK, "sequence", "clip")


def test_token_weights_with_a_sequence_rejection_by_hand():
    """Token TIS with the sequence dropped: by the product ratio, row 1 (e^-0.9 = 0.41 < 0.5) is dropped; by the
    geometric ratio (e^-0.45 = 0.64) it is kept: the geometric mean does not grow with the length."""
    tok = importance_weights(LOGP, SAMPLER, MASK, "token", cap=2.0)
    by_product = with_rejection(tok, LOGP, SAMPLER, MASK, "sequence", None, 2.0)
    torch.testing.assert_close(by_product, torch.tensor([[1.0, math.exp(-1), 2.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(with_rejection(tok, LOGP, SAMPLER, MASK, "geometric", None, 2.0), tok)
    # on sequence weights ([B]) and with an explicit lower bound
    seq = importance_weights(LOGP, SAMPLER, MASK, "sequence", cap=None)
    torch.testing.assert_close(with_rejection(seq, LOGP, SAMPLER, MASK, "geometric", 0.9, 1.1),
                               torch.tensor([1.0, 0.0]))


def test_topr_weights_and_advantages_by_hand():
    """TOPR: min(prod r, 1) for a negative advantage, 1 for a non-negative one (per token with token advantages)."""
    torch.testing.assert_close(importance_weights(LOGP, SAMPLER, MASK, "topr"), torch.tensor([1.0, math.exp(-0.9)]))
    up = importance_weights(torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), torch.ones(1, 1), "topr")
    torch.testing.assert_close(up, torch.tensor([1.0]))  # e^0.5 truncated at 1
    weights = torch.tensor([0.5, 0.25])
    torch.testing.assert_close(topr_advantages(torch.tensor([1.0, -2.0]), weights), torch.tensor([1.0, -0.5]))
    torch.testing.assert_close(topr_advantages(torch.tensor([-1.0, 0.0]), weights), torch.tensor([-0.5, 0.0]))
    token = topr_advantages(torch.tensor([[1.0, -1.0], [-2.0, 3.0]]), weights)
    torch.testing.assert_close(token, torch.tensor([[1.0, -0.5], [-0.5, 3.0]]))


def test_planted_bug_topr_weighting_the_positive_advantages_is_caught():
    """TOPR weighted on both signs is plain truncated IS: the literal of the positive advantage catches it."""
    adv, weights = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.25])
    assert not torch.allclose(weighted_advantages(adv, weights), topr_advantages(adv, weights))
    torch.testing.assert_close(topr_advantages(adv, weights)[0], torch.tensor(1.0))
