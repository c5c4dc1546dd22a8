"""``rloo_lightning.algo.advantages`` against small hand-computed tensors: leave-one-out advantages and missing
rewards, the other baselines (issue 11), whitening and reward normalisation, informative groups.

Every expected value is a literal worked out by hand in the comments next to it.
"""

from __future__ import annotations

import pytest
import torch

from algo_helpers import f64, nan, t
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


# ---------------------------------------------------------------------------------------------
# leave_one_out_advantages
# ---------------------------------------------------------------------------------------------
def test_loo_advantages_hand_computed_three_prompts_k4():
    rewards = torch.tensor(
        [1.0, 2.0, 3.0, 4.0,  # group 0
         0.0, 0.0, 0.0, 1.0,  # group 1
         -1.0, 1.0, 0.0, 2.0]  # group 2
    )
    # group 0: sum 10, b_i = (10 - r_i)/3 = [3, 8/3, 7/3, 2]  -> A = [-2, -2/3, 2/3, 2]
    # group 1: sum 1,  b_i = (1 - r_i)/3  = [1/3, 1/3, 1/3, 0] -> A = [-1/3, -1/3, -1/3, 1]
    # group 2: sum 2,  b_i = (2 - r_i)/3  = [1, 1/3, 2/3, 0]   -> A = [-2, 2/3, -2/3, 2]
    expected = torch.tensor(
        [-2.0, -2.0 / 3, 2.0 / 3, 2.0,
         -1.0 / 3, -1.0 / 3, -1.0 / 3, 1.0,
         -2.0, 2.0 / 3, -2.0 / 3, 2.0]
    )
    adv = leave_one_out_advantages(rewards, k=4)
    assert adv.shape == (12,)
    torch.testing.assert_close(adv, expected)


def test_loo_advantages_k2_and_constant_group():
    # k=2: A_0 = 3 - 1 = 2, A_1 = 1 - 3 = -2; constant group -> 0.
    adv = leave_one_out_advantages(torch.tensor([3.0, 1.0, 5.0, 5.0]), k=2)
    torch.testing.assert_close(adv, torch.tensor([2.0, -2.0, 0.0, 0.0]))


def test_loo_advantages_identity_k_over_k_minus_1():
    g = torch.Generator().manual_seed(3)
    for k in (2, 3, 4, 7):
        r = torch.randn(5 * k, generator=g, dtype=torch.float64)
        grouped = r.view(-1, k)
        expected = (k / (k - 1) * (grouped - grouped.mean(1, keepdim=True))).view(-1)
        torch.testing.assert_close(leave_one_out_advantages(r, k), expected)


def test_loo_advantages_keep_dtype():
    r = torch.tensor([1.0, 2.0], dtype=torch.float64)
    adv = leave_one_out_advantages(r, 2)
    assert adv.dtype == torch.float64
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0], dtype=torch.float64))


def test_loo_advantages_nan_handling():
    rewards = torch.tensor(
        [1.0, nan, 3.0, 5.0,  # valid {1,3,5}: b_i = (9 - r_i)/2 = [4, -, 3, 2] -> A = [-3, 0, 0, 3]
         nan, 2.0, nan, nan,  # one valid reward: no baseline -> all 0
         nan, nan, nan, nan,  # none valid -> all 0
         2.0, nan, nan, 4.0]  # two valid: A = [2-4, 0, 0, 4-2] = [-2, 0, 0, 2]
    )
    adv = leave_one_out_advantages(rewards, k=4)
    assert not torch.isnan(adv).any()
    torch.testing.assert_close(
        adv,
        torch.tensor([-3.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -2.0, 0.0, 0.0, 2.0]),
    )


def test_loo_advantages_nan_does_not_leak_across_groups():
    # group 0 has a NaN; group 1 must be exactly as without it: [0, 1] sum 1 -> A = [-1, 1]
    adv = leave_one_out_advantages(torch.tensor([nan, 7.0, 0.0, 1.0]), k=2)
    torch.testing.assert_close(adv, torch.tensor([0.0, 0.0, -1.0, 1.0]))


@pytest.mark.parametrize("k", [1, 0, -2])
def test_loo_advantages_k_below_2_raises(k):
    with pytest.raises(ValueError, match="k"):
        leave_one_out_advantages(torch.zeros(4), k)


@pytest.mark.parametrize("shape", [(5,), (3, 4), (7,)])
def test_loo_advantages_wrong_length_raises(shape):
    with pytest.raises(ValueError, match="divisible|1-D"):
        leave_one_out_advantages(torch.zeros(shape), 4)


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


def test_informative_groups():
    rewards = t([1.0, 1.0, 1.0,  # all equal -> False
                 0.0, 1.0, 0.0,  # spread 1 -> True
                 2.0, nan, 2.0,  # valid ones equal -> False
                 nan, nan, 5.0,  # one valid -> False
                 0.0, 0.05, nan])  # spread 0.05 -> True at atol 0, False at atol 0.1
    assert informative_groups(rewards, 3).tolist() == [False, True, False, False, True]
    assert informative_groups(rewards, 3, atol=0.1).tolist() == [False, True, False, False, False]
