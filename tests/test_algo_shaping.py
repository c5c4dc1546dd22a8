"""``rloo_lightning.algo.shaping`` against hand-computed tensors: the reward clip, the missing-EOS penalty and DAPO's
overlong penalty.
"""

from __future__ import annotations

import pytest
import torch

from algo_helpers import nan, t
from reward_helpers import assert_close
from rloo_lightning.algo.shaping import clip_rewards, missing_eos_penalty, overlong_penalty

NAN = nan  # the spelling of the tests that came from the reward tests


def test_clip_rewards_keeps_nan_and_checks_range():
    # shaping.reward_clip's clip (the one reward clip of the training path): (-10, 10): -15 -> -10, 12 -> 10;
    # (low, high) = (-1, 2): -15 -> -1, 3 -> 2, 12 -> 2
    torch.testing.assert_close(clip_rewards(t([-15.0, 3.0, nan, 12.0]), -10.0, 10.0), t([-10.0, 3.0, nan, 10.0]),
                               equal_nan=True)
    torch.testing.assert_close(clip_rewards(t([-15.0, 3.0, nan, 12.0]), -1.0, 2.0), t([-1.0, 2.0, nan, 2.0]),
                               equal_nan=True)
    with pytest.raises(ValueError, match="low <= high"):
        clip_rewards(t([1.0]), 2.0, 1.0)


# -- shaping -----------------------------------------------------------------------------------
def test_missing_eos_penalty():
    rewards = torch.tensor([1.0, 0.5, NAN, -1.0])
    truncated = torch.tensor([False, True, True, True])
    assert_close(missing_eos_penalty(rewards, truncated, 1.0), [1.0, -0.5, NAN, -2.0])
    with pytest.raises(ValueError, match="shape"):
        missing_eos_penalty(rewards, truncated[:2], 1.0)


def test_overlong_penalty_dapo():
    # L_max = 10, L_cache = 4: free up to 6, then (6 - L) / 4, -1 beyond 10.
    lengths = torch.tensor([3, 6, 7, 8, 10, 12])
    assert_close(overlong_penalty(lengths, max_len=10, buffer=4), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert_close(overlong_penalty(lengths.float(), 10, 4, factor=0.5), [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, max_len=10, buffer=11)


def test_clip_rewards():
    assert_close(clip_rewards(torch.tensor([-20.0, 0.5, NAN, 20.0]), -10, 10), [-10.0, 0.5, NAN, 10.0])
    with pytest.raises(ValueError, match="low <= high"):
        clip_rewards(torch.zeros(2), 1, -1)
