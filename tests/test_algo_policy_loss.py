"""The update's default loss, ``rloo_lightning.algo.losses.PolicyLoss`` (the paper's sequence-level REINFORCE),
against small hand-computed tensors (expected values are literals worked out by hand).
"""

from __future__ import annotations

import pytest
import torch

from rloo_lightning.algo.losses import PolicyLoss, aggregate_token_loss


def policy_loss(advantages, logp, mask, **denominators):
    """The update's default loss (the paper's sequence-level REINFORCE), as the training step computes it."""
    loss, stats = PolicyLoss()(logp, mask, advantages, denominators)
    assert stats == {}  # on-policy: no ratio, no clip statistics
    return loss


def test_policy_loss_hand_example_and_divisor():
    adv = torch.tensor([2.0, -1.0], requires_grad=True)
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -4.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # sequence log-probs: [-3, -0.5]; sum_i A_i lp_i = 2*(-3) + (-1)*(-0.5) = -5.5
    loss = policy_loss(adv, logp, mask)
    assert loss.item() == pytest.approx(5.5 / 2)  # -(-5.5)/B, B = 2
    assert policy_loss(adv, logp, mask, num_sequences=1).item() == pytest.approx(5.5)
    assert policy_loss(adv, logp, mask, num_sequences=torch.tensor(4)).item() == pytest.approx(5.5 / 4)
    # the same as the seq_sum aggregation of -A * logp
    torch.testing.assert_close(loss, aggregate_token_loss(-adv.detach()[:, None] * logp, mask, "seq_sum"))
    loss.backward()
    # d loss / d logp_it = -A_i m_it / B
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -1.0, 0.0], [0.5, 0.0, 0.0]]))
    assert adv.grad is None  # advantages are constants


def test_policy_loss_ignores_nonfinite_logp_at_masked_positions():
    adv = torch.tensor([1.0])
    logp = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    loss = policy_loss(adv, logp, torch.tensor([[1.0, 0.0]]))
    assert loss.item() == pytest.approx(1.0)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, 0.0]]))
