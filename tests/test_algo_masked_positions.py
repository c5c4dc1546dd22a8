"""Masks by selection, not multiplication: nothing at a masked position reaches a KL, a reward or a weight.

A mask that multiplies (``x * mask``) turns a masked ``inf`` into ``inf * 0 = NaN``, and one NaN token poisons
the sum of its row (the sequence KL, the shaped reward, a sequence importance weight). Padding does hold such
values: the policy's or reference's log-prob of a pad token can be -1e4 or -inf, and with k3
(``exp(-x) + x - 1``) a log-ratio of -1e4 already overflows to inf. Every estimator, placement and correction
level/mode below gets extreme values at masked positions only, and must give finite outputs exactly equal to
those of ordinary inputs.
"""

from __future__ import annotations

import math
import typing

import pytest
import torch

from rloo_lightning.config import CorrectionArgs, KLArgs
from rloo_lightning.algo.correction import importance_weights, mismatch_sums, weighted_advantages
from rloo_lightning.algo.kl import KL_ESTIMATORS, fold_kl, kl_per_token, reward_to_go, token_rewards_after_baseline
from rloo_lightning.algo.losses import AGGREGATION_MODES, aggregate_token_loss

PLACEMENTS = ("reward", "token_reward", "loss")
LEVELS = ("sequence", "token", "geometric", "topr")
MODES = ("truncate", "mask", "reject")
# (mode, cap, lower): untruncated, TIS-capped; mask mode with no bound, its default lower bound 1/cap, an explicit one
WEIGHTINGS = (("truncate", None, None), ("truncate", 2.0, None), ("mask", None, None), ("mask", 2.0, None),
              ("mask", 2.0, 0.1), ("reject", 2.0, 0.5))

INF, NAN = math.inf, math.nan
# (value for logp, value for ref_logp / sampler_logp) written at every masked position
EXTREMES = [
    (1e4, 0.0), (-1e4, 0.0), (0.0, 1e4), (0.0, -1e4), (1e4, -1e4), (-1e4, 1e4),
    (INF, 0.0), (-INF, 0.0), (0.0, INF), (0.0, -INF), (INF, INF), (-INF, -INF), (INF, -INF), (-INF, INF),
    (NAN, 0.0), (0.0, NAN), (NAN, NAN), (NAN, -INF),
]

# a prefix with padding after it, a multi-turn row with a hole, an empty row, a full row
MASK = torch.tensor([
    [1.0, 1.0, 1.0, 0.0, 0.0],
    [1.0, 0.0, 1.0, 1.0, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0],
    [1.0, 1.0, 1.0, 1.0, 1.0],
])
_gen = torch.Generator().manual_seed(0)
LOGP = -3.0 * torch.rand(MASK.shape, generator=_gen)  # ordinary log-probs everywhere, padding included
OTHER = LOGP + 0.3 * torch.randn(MASK.shape, generator=_gen)  # ref_logp / sampler_logp: close to LOGP
REWARDS = torch.tensor([1.0, 0.0, 0.5, -0.25])
ADVANTAGES = torch.tensor([0.7, -0.3, 0.1, -0.5])


def _poison(x: torch.Tensor, value: float) -> torch.Tensor:
    """``x`` with ``value`` at every masked position (and only there)."""
    return torch.where(MASK.bool(), x, torch.full_like(x, value))


def _mixed(x: torch.Tensor, values: list[float], start: int) -> torch.Tensor:
    """``x`` with a different extreme at each masked position: ``values[start], values[start + 1], ...``."""
    out = x.clone()
    for k, (i, j) in enumerate((~MASK.bool()).nonzero().tolist()):
        out[i, j] = values[(start + k) % len(values)]
    return out


def _cases():
    """``(name, logp, other)``: each extreme pair at every masked position, then the extremes mixed in a row."""
    for a, b in EXTREMES:
        yield f"logp={a}, other={b}", _poison(LOGP, a), _poison(OTHER, b)
    firsts, seconds = [a for a, _ in EXTREMES], [b for _, b in EXTREMES]
    for start in range(0, len(EXTREMES), 3):  # a different extreme at each masked position, shifted per case
        yield f"mixed from {start}", _mixed(LOGP, firsts, start), _mixed(OTHER, seconds, start + 7)


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert torch.isfinite(want).all(), f"{what}: the ordinary-input result is not finite: {want}"
    assert torch.isfinite(got).all(), f"{what}: not finite: {got}"
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{tuple(got.shape)}"
    assert torch.equal(got, want), f"{what}: {got} != {want}"


def test_the_grid_covers_every_option():
    """The grid below is every estimator, placement, level and mode the config accepts."""
    assert set(KL_ESTIMATORS) == set(typing.get_args(typing.get_type_hints(KLArgs)["estimator"]))
    assert set(PLACEMENTS) == set(typing.get_args(typing.get_type_hints(KLArgs)["placement"]))
    assert set(PLACEMENTS) == set(typing.get_args(typing.get_type_hints(fold_kl)["placement"]))
    assert {"auto", "none", *LEVELS} == set(typing.get_args(typing.get_type_hints(CorrectionArgs)["level"]))
    assert set(MODES) == set(typing.get_args(typing.get_type_hints(CorrectionArgs)["mode"]))


# ------------------------------------------------------------------------------------------------ KL


def _kl_outputs(logp, ref_logp, estimator, placement, clamp, mask=MASK):
    """Every tensor the KL path produces for ``placement``, by name."""
    beta = 0.1
    token_kl, kl, shaped = fold_kl(REWARDS, logp, ref_logp, mask, beta, estimator, clamp, placement)
    out = {"token_kl": token_kl, "kl": kl, "shaped_rewards": shaped}
    if placement == "token_reward":  # OpenRLHF: -beta*kl_t per token after the baseline, summed to go
        token_rewards = token_rewards_after_baseline(ADVANTAGES, token_kl, mask, beta, clip_range=10.0)
        out["token_rewards"] = token_rewards
        out["token_advantages"] = reward_to_go(token_rewards, mask)
    elif placement == "loss":  # GRPO / verl: beta * KL aggregated as the loss is (the forward value)
        per_token = kl_per_token(logp, ref_logp, estimator, clamp)
        for mode in AGGREGATION_MODES:
            out[f"loss_kl[{mode}]"] = beta * aggregate_token_loss(per_token, mask, mode)
    return out


@pytest.mark.parametrize("clamp", [None, 10.0])
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_ignores_extremes_at_masked_positions(estimator, placement, clamp):
    want = _kl_outputs(LOGP, OTHER, estimator, placement, clamp)
    zeros = _kl_outputs(_poison(LOGP, 0.0), _poison(OTHER, 0.0), estimator, placement, clamp)
    for name in want:
        _same(zeros[name], want[name], f"{name} (zeros at masked positions)")
    for case, logp, ref_logp in _cases():
        got = _kl_outputs(logp, ref_logp, estimator, placement, clamp)
        assert got.keys() == want.keys()
        for name in want:
            _same(got[name], want[name], f"{estimator}/{placement}/clamp={clamp}, {case}: {name}")


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool, torch.long, torch.float64])
def test_fold_kl_is_unchanged_on_ordinary_inputs(mask_dtype):
    """Selection changes nothing where inputs are finite: same values, bit for bit, and the dtype ``* mask`` gave."""
    mask = MASK.to(mask_dtype)
    for estimator in KL_ESTIMATORS:
        for clamp in (None, 0.5):
            product = kl_per_token(LOGP, OTHER, estimator, clamp) * mask  # the old masking, fine when finite
            token_kl, kl, shaped = fold_kl(REWARDS, LOGP, OTHER, mask, 0.1, estimator, clamp)
            assert token_kl.dtype == product.dtype
            assert torch.equal(token_kl, product)
            assert torch.equal(kl, product.sum(1))
            assert torch.equal(shaped, REWARDS - 0.1 * product.sum(1))


def test_fold_kl_keeps_a_low_precision_estimate_promoted_as_before():
    logp, ref = LOGP.bfloat16(), OTHER.bfloat16()
    token_kl, kl, _ = fold_kl(REWARDS, logp, ref, MASK, 0.1, "k3")
    product = kl_per_token(logp, ref, "k3") * MASK
    assert token_kl.dtype == torch.float32 and torch.equal(token_kl, product) and torch.equal(kl, product.sum(1))


def test_k3_overflow_at_padding_does_not_poison_the_reward():
    """The issue: k3 at a padded position with a large log-ratio overflows, and ``* mask`` made it NaN."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    logp = torch.tensor([[-0.5, -1.0, -1e4], [-0.2, -0.3, -0.4]])  # the pad token is very unlikely under pi
    ref = torch.tensor([[-0.6, -0.9, 0.0], [-0.25, -0.3, -0.5]])
    rewards = torch.tensor([1.0, 0.0])
    # what the multiplication did: exp(1e4) = inf at the pad, inf * 0 = NaN, the row's sum and reward NaN
    product = kl_per_token(logp, ref, "k3") * mask
    assert torch.isnan(product[0, 2]) and torch.isnan(rewards - 0.05 * product.sum(1))[0]
    token_kl, kl, shaped = fold_kl(rewards, logp, ref, mask, 0.05, "k3")
    assert torch.isfinite(token_kl).all() and torch.isfinite(shaped).all() and token_kl[0, 2] == 0
    clean = fold_kl(rewards, torch.where(mask.bool(), logp, 0.0), ref, mask, 0.05, "k3")
    for got, want in zip((token_kl, kl, shaped), clean):
        _same(got, want, "k3 with a pad log-ratio of -1e4")
    x = (logp - ref)[0, :2]
    torch.testing.assert_close(kl[0], (torch.exp(-x) + x - 1).sum())


# --------------------------------------------------------------------------------------------- correction


def _correction_outputs(logp, sampler_logp, level, mode, cap, lower, mask=MASK):
    weights = importance_weights(logp, sampler_logp, mask, level, mode, cap, lower)
    return {
        "weights": weights,
        "weighted_advantages[seq]": weighted_advantages(ADVANTAGES, weights),
        "weighted_advantages[token]": weighted_advantages(reward_to_go(ADVANTAGES[:, None] * torch.ones_like(mask),
                                                                       mask), weights),
    }


@pytest.mark.parametrize("mode, cap, lower", WEIGHTINGS)
@pytest.mark.parametrize("level", LEVELS)
def test_importance_weights_ignore_extremes_at_masked_positions(level, mode, cap, lower):
    want = _correction_outputs(LOGP, OTHER, level, mode, cap, lower)
    if level == "token":
        assert (want["weights"][~MASK.bool()] == 0).all()
    for case, logp, sampler_logp in _cases():
        got = _correction_outputs(logp, sampler_logp, level, mode, cap, lower)
        for name in want:
            _same(got[name], want[name], f"{level}/{mode}/cap={cap}/lower={lower}, {case}: {name}")


def test_mismatch_sums_ignore_extremes_at_masked_positions():
    want = mismatch_sums(LOGP, OTHER, MASK)
    for case, logp, sampler_logp in _cases():
        got = mismatch_sums(logp, sampler_logp, MASK)
        assert got.keys() == want.keys()
        for name, (total, count) in want.items():
            _same(got[name][0], total, f"{case}: {name} sum")
            _same(got[name][1], count, f"{case}: {name} count")


def test_correction_is_unchanged_on_ordinary_inputs():
    """On finite inputs the selection gives, bit for bit, what the multiplication gave."""
    log_ratio = (LOGP - OTHER) * MASK  # the old masking, fine when finite
    for level in ("sequence", "token"):  # the levels and modes that were written with the multiplication
        for mode, cap, lower in [w for w in WEIGHTINGS if w[0] != "reject"]:
            w = torch.exp(log_ratio.sum(1) if level == "sequence" else log_ratio)
            if mode == "truncate":
                w = w if cap is None else w.clamp(max=cap)
            else:
                high = math.inf if cap is None else cap
                low = lower if lower is not None else (0.0 if cap is None else 1.0 / cap)
                w = torch.where((w >= low) & (w <= high), w, torch.zeros_like(w))
            w = w * MASK if level == "token" else w
            assert torch.equal(importance_weights(LOGP, OTHER, MASK, level, mode, cap, lower), w), (level, mode, cap)
    sums = mismatch_sums(LOGP, OTHER, MASK)
    ratio = torch.exp(log_ratio)
    assert torch.equal(sums["mismatch/kl_k1"][0], (-log_ratio).sum())
    assert torch.equal(sums["mismatch/kl_k3"][0], ((ratio - 1 - log_ratio) * MASK).sum())
    assert torch.equal(sums["mismatch/seq_log_ratio"][0], log_ratio.sum(1).sum())
    outside = ((ratio < 0.5) | (ratio > 2.0)).float() * MASK
    assert torch.equal(sums["mismatch/ratio_outside_0.5_2.0"][0], outside.sum())


def test_inf_sampler_logp_at_padding_does_not_poison_the_weights():
    """An engine that reports -inf (or NaN) for padding: ``* mask`` made the sequence weight NaN."""
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    logp = torch.tensor([[-0.5, -1.0, -2.0]])
    sampler = torch.tensor([[-0.6, -1.0, -INF]])
    assert torch.isnan((logp - sampler) * mask).any()  # what the multiplication did
    for level in ("sequence", "token"):
        w = importance_weights(logp, sampler, mask, level, "truncate", cap=None)
        assert torch.isfinite(w).all()
        assert level == "sequence" or w[0, 2] == 0
        torch.testing.assert_close(w[0, :2].prod() if level == "token" else w[0], torch.tensor(math.exp(0.1)))
    sums = mismatch_sums(logp, sampler, mask)
    assert all(torch.isfinite(s) for s, _ in sums.values())
    torch.testing.assert_close(sums["mismatch/seq_log_ratio"][0], torch.tensor(0.1))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_kl_loss_gradient_ignores_extremes_at_masked_positions(estimator):
    """KL in the loss (GRPO / verl use_kl_loss): the value and the gradient stay finite and equal to clean inputs."""
    from rloo_lightning.config import KLArgs, UpdateArgs
    from rloo_lightning.algo.losses import PolicyLoss

    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss_fn = PolicyLoss.from_args(UpdateArgs(), KLArgs(beta=0.1, placement="loss", estimator=estimator))
    grads = []
    for masked in (0.0, -1e4):
        logp = torch.tensor([[-1.0, -2.0, masked]], requires_grad=True)  # a padding position's log-prob
        ref = torch.tensor([[-1.5, -1.0, 0.0]])
        loss, _ = loss_fn(logp, mask, torch.tensor([1.0]), {"num_sequences": 1, "num_tokens": 2.0,
                                                              "norm_constant": 3.0}, None, ref, torch.tensor(0.1))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
        grads.append((loss.detach(), logp.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
