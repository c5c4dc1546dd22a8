"""The RLOO estimator, run through the project's objectives, is unbiased for grad J; broken ones are caught.

Fast version of ``scripts/exactness.py``: an enumerable tabular toy gives the exact gradient of
``J = E[r] - beta * KL(pi || pi_ref)``; many sampled minibatches give the estimator's mean; a
Bonferroni-corrected z-test (family-wise false-alarm rate 1e-3) compares them. Seeds are fixed.
"""

from __future__ import annotations

import pytest
import torch

import rloo_lightning.exactness as exactness
from rloo_lightning.exactness import (
    completion_code,
    completion_probabilities,
    enumerate_completions,
    exact_gradient,
    exact_objective,
    kl_placement_target,
    make_toy,
    minibatch_gradients,
    row_logits,
    sample_completions,
    z_test,
    check_estimator,
)
from rloo_lightning.objectives import (
    completion_mask,
    leave_one_out_advantages,
    policy_loss,
    sequence_kl,
    token_logprobs,
)

ALPHA = 1e-3
BETA = 0.1


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The tensors are tiny: one thread is as fast and does not fight other jobs for cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def toy():
    return make_toy(num_prompts=3, max_len=3, vocab=3, temperature=0.7, seed=0)


# -- the exact side --------------------------------------------------------------------------------
def test_enumeration_is_the_whole_distribution(toy):
    tokens, mask = enumerate_completions(3, 3, eos_id=2, pad_id=0)
    # 1 (EOS) + 2 (x EOS) + 4 (xy EOS) + 8 truncated (xyz) completions.
    assert tokens.shape == (15, 3)
    assert len(set(completion_code(tokens, mask, 3).tolist())) == 15
    # The project's mask agrees with the enumeration's own (padding 0 is not EOS, so it is real).
    assert torch.equal(completion_mask(tokens, [2]), mask.float())
    probs = completion_probabilities(toy)
    torch.testing.assert_close(probs.sum(1), torch.ones(3, dtype=torch.float64))


def test_sampler_draws_from_the_enumerated_distribution(toy):
    """Otherwise the exact comparison would test the wrong distribution."""
    n = 40_000
    prompts = torch.arange(3).repeat_interleave(n)
    tokens = sample_completions(toy, prompts, torch.Generator().manual_seed(7))
    codes = completion_code(tokens, completion_mask(tokens, [toy.eos_id]), toy.vocab)
    enum_tokens, enum_mask = enumerate_completions(3, 3, toy.eos_id, toy.pad_id)
    enum_codes = completion_code(enum_tokens, enum_mask, 3)
    freq = (codes.view(3, n, 1) == enum_codes.view(1, 1, -1)).double().mean(1)
    p = completion_probabilities(toy)
    assert torch.allclose(freq.sum(1), torch.ones(3, dtype=torch.float64))  # every sample is enumerated
    z = (freq - p) / (p * (1 - p) / n).sqrt()
    assert z.abs().max() < 4.5  # Bonferroni over 45 cells at ~1e-3 family-wise


def test_exact_gradient_matches_finite_differences(toy):
    grad = exact_gradient(toy, BETA)
    theta = toy.policy_logits.clone().reshape(-1)
    eps = 1e-6
    fd = torch.empty_like(theta)
    for i in range(theta.numel()):
        up, down = theta.clone(), theta.clone()
        up[i] += eps
        down[i] -= eps
        fd[i] = (exact_objective(toy, BETA, up.view_as(toy.policy_logits))
                 - exact_objective(toy, BETA, down.view_as(toy.policy_logits))) / (2 * eps)
    torch.testing.assert_close(grad, fd, atol=1e-8, rtol=1e-6)
    assert grad.abs().max() > 1e-2  # not a vacuous comparison


def test_exact_gradient_is_the_score_function_identity(toy):
    """grad J = mean_p E[(r - beta*log pi/pi_ref) grad log pi]: the identity RLOO estimates."""
    tokens, mask = enumerate_completions(3, 3, toy.eos_id, toy.pad_id)
    theta = toy.policy_logits.clone().requires_grad_(True)
    surrogate = 0.0
    for p in range(3):
        prompts = torch.full((tokens.shape[0],), p)
        lp_tok = torch.log_softmax(row_logits(theta, prompts, tokens, toy.eos_id) / toy.temperature, -1)
        ref_tok = torch.log_softmax(row_logits(toy.ref_logits, prompts, tokens, toy.eos_id) / toy.temperature, -1)
        logp = (lp_tok.gather(-1, tokens[..., None]).squeeze(-1) * mask).sum(1)
        ref = (ref_tok.gather(-1, tokens[..., None]).squeeze(-1) * mask).sum(1)
        reward = toy.rewards[p, completion_code(tokens, mask, 3)]
        weight = logp.exp().detach() * (reward - BETA * (logp.detach() - ref))
        surrogate = surrogate + (weight * logp).sum() / 3
    (grad,) = torch.autograd.grad(surrogate, theta)
    torch.testing.assert_close(grad.reshape(-1), exact_gradient(toy, BETA))


# -- the harness computes the project's estimator, one minibatch at a time ---------------------------
def test_vectorised_draws_equal_per_minibatch_project_gradients(toy):
    k, n, seed = 3, 4, 11
    draws = minibatch_gradients(toy, k, BETA, n, seed)
    prompts_all = torch.arange(3).repeat_interleave(k).repeat(n)
    tokens_all = sample_completions(toy, prompts_all, torch.Generator().manual_seed(seed))
    batch = 3 * k
    for m in range(n):
        prompts, tokens = prompts_all[m * batch:(m + 1) * batch], tokens_all[m * batch:(m + 1) * batch]
        theta = toy.policy_logits.clone().requires_grad_(True)
        logp = token_logprobs(row_logits(theta, prompts, tokens, toy.eos_id), tokens, toy.temperature)
        ref_logp = token_logprobs(row_logits(toy.ref_logits, prompts, tokens, toy.eos_id), tokens, toy.temperature)
        mask = completion_mask(tokens, [toy.eos_id])
        r = toy.rewards[prompts, completion_code(tokens, mask, 3)].float()
        adv = leave_one_out_advantages(r - BETA * sequence_kl(logp.detach(), ref_logp, mask), k)
        (grad,) = torch.autograd.grad(-policy_loss(adv, logp, mask), theta)
        torch.testing.assert_close(draws[m], grad.reshape(-1), atol=1e-6, rtol=1e-5)


def test_policy_loss_makes_an_undetached_kl_harmless(toy):
    """policy_loss detaches A itself, so a KL left attached in R cannot leak a gradient through it;
    the harness's ``reward_k1_not_detached`` variant therefore forms the loss without that detach."""
    tokens = sample_completions(toy, torch.arange(3).repeat_interleave(4), torch.Generator().manual_seed(3))
    prompts = torch.arange(3).repeat_interleave(4)
    logits = row_logits(toy.policy_logits, prompts, tokens, toy.eos_id).detach().requires_grad_(True)
    logp = token_logprobs(logits, tokens, toy.temperature)
    ref_logp = token_logprobs(row_logits(toy.ref_logits, prompts, tokens, toy.eos_id), tokens, toy.temperature)
    mask = completion_mask(tokens, [toy.eos_id])
    grads = []
    for kl in (sequence_kl(logp.detach(), ref_logp, mask), sequence_kl(logp, ref_logp, mask)):
        adv = leave_one_out_advantages(torch.ones(12) - kl, 4)
        grads.append(torch.autograd.grad(policy_loss(adv, logp, mask), logits, retain_graph=True)[0])
    torch.testing.assert_close(grads[0], grads[1])


# -- the z-test --------------------------------------------------------------------------------------
def test_z_test_false_alarm_rate_and_power():
    g = torch.Generator().manual_seed(0)
    exact = torch.linspace(-1, 1, 20, dtype=torch.float64)
    rejections = sum(
        not z_test(exact + torch.randn(500, 20, generator=g, dtype=torch.float64), exact, alpha=0.05).unbiased
        for _ in range(200)
    )
    assert rejections <= 20  # Bonferroni keeps the family-wise rate <= 5% (10 expected at most)
    shifted = exact + 0.5 + torch.randn(500, 20, generator=g, dtype=torch.float64)
    assert not z_test(shifted, exact, alpha=0.05).unbiased


# -- unbiasedness of the project's default, and the harness's power ----------------------------------
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("beta", [0.0, BETA])
def test_default_estimator_is_unbiased(toy, k, beta):
    result = check_estimator(toy, k, beta, num_minibatches=20_000, seed=100 + k, alpha=ALPHA)
    assert result.num_coords == 45  # every reachable table entry is tested (3 prompts x 15)
    assert result.unbiased, result
    assert result.max_abs_z < result.z_crit


@pytest.mark.parametrize(
    ("k", "beta", "variant"),
    [
        # A self-inclusive max baseline depends on y_i non-linearly: E[b_i grad log pi(y_i)] != 0.
        pytest.param(4, 0.0, {"baseline": "group_max"}, id="baseline_includes_self_max"),
        # A self-inclusive mean without the k/(k-1) rescale estimates (k-1)/k grad J, not grad J.
        pytest.param(2, 0.0, {"baseline": "group_mean"}, id="baseline_includes_self_mean"),
        pytest.param(4, BETA, {"mask_leak": True}, id="mask_leaks_one_pad_token"),
        pytest.param(4, 0.0, {"mask_leak": True}, id="mask_leaks_one_pad_token_beta0"),
        pytest.param(4, BETA, {"kl_mode": "reward_k1_not_detached"}, id="kl_not_detached"),
        pytest.param(4, BETA, {"kl_mode": "loss_k1"}, id="k1_as_loss_term"),
        pytest.param(4, 0.0, {"baseline": "group_mean_std"}, id="grpo_std_scaling"),
        pytest.param(4, 0.0, {"aggregation": "token_mean"}, id="token_mean"),
    ],
)
def test_harness_detects_bias(toy, k, beta, variant):
    result = check_estimator(toy, k, beta, num_minibatches=5_000, seed=200 + k, alpha=ALPHA, **variant)
    assert not result.unbiased, result
    assert result.max_abs_z > 2 * result.z_crit  # by a wide margin, not by luck


def test_same_seeds_without_the_bug_pass(toy):
    """The detection above is the bug's doing: the same seeds and size pass with the default."""
    for k, beta in ((2, 0.0), (4, 0.0), (4, BETA)):
        assert check_estimator(toy, k, beta, num_minibatches=5_000, seed=200 + k, alpha=ALPHA).unbiased


@pytest.mark.parametrize("kl_mode", ["loss_k1", "loss_k3", "reward_k1_not_detached"])
def test_other_kl_placements_estimate_their_derived_targets(toy, kl_mode):
    """The biased placements are biased *because* they estimate another gradient, derived in
    ``kl_placement_target`` (e.g. the k1 loss term has zero expected gradient), and the harness
    confirms each derivation; the same draws are far from grad J."""
    draws = minibatch_gradients(toy, 4, BETA, 20_000, seed=300, kl_mode=kl_mode)
    assert z_test(draws, kl_placement_target(toy, BETA, kl_mode), ALPHA).unbiased
    assert not z_test(draws, exact_gradient(toy, BETA), ALPHA).unbiased


def test_openrlhf_token_reward_placement_is_unbiased_with_k1(toy):
    """kl_placement=token_reward (OpenRLHF): the KL's reward-to-go keeps causality, and k1's pathwise
    term E[grad k1] = E[grad log pi] = 0, so it estimates grad J too (with no baseline on the KL part)."""
    for k in (2, 4):
        result = check_estimator(toy, k, BETA, num_minibatches=20_000, seed=500 + k, alpha=ALPHA,
                                 kl_mode="token_reward_k1")
        assert result.unbiased, result


@pytest.mark.parametrize("kl_mode", ["reward_k2_detached", "reward_k3_detached"])
def test_k2_or_k3_in_the_reward_is_biased(toy, kl_mode):
    """kl_estimator=k2/k3 with placement reward: the detached sum as a reward drops the estimator's
    pathwise gradient, which (unlike k1's, E[grad log pi] = 0) is not zero in expectation."""
    result = check_estimator(toy, 4, BETA, num_minibatches=20_000, seed=600, alpha=ALPHA, kl_mode=kl_mode)
    assert not result.unbiased, result


@pytest.mark.parametrize("signal", ["score", "shaped"])
def test_dropping_zero_variance_groups_and_averaging_over_kept_rows_is_biased(signal):
    """The module divides the loss by the number of kept rows when ZeroVarianceFilter drops groups.
    With binary rewards (many all-equal groups) that random divisor biases the estimator of grad J."""
    binary = make_toy(rewards="binary")
    result = check_estimator(binary, 4, 0.0, 5_000, seed=400, alpha=ALPHA, zero_variance_filter=signal)
    assert not result.unbiased, result
    assert check_estimator(binary, 4, 0.0, 5_000, seed=400, alpha=ALPHA).unbiased


def _mask_without_eos(ids, eos_ids):
    return (torch.cumsum(torch.isin(ids, torch.as_tensor(eos_ids)).int(), dim=1) == 0).float()


@pytest.mark.parametrize(
    ("name", "replacement", "beta"),
    [
        ("token_logprobs", lambda logits, tokens, temperature=1.0: token_logprobs(logits, tokens, 1.0), 0.0),
        ("completion_mask", _mask_without_eos, 0.0),
        ("sequence_kl", lambda logp, ref, mask: sequence_kl(ref, logp, mask), BETA),
    ],
    ids=["temperature_ignored", "mask_drops_eos", "kl_sign_flipped"],
)
def test_broken_project_functions_are_caught(toy, monkeypatch, name, replacement, beta):
    """Mutants of the objectives the harness calls: the default-path check must fail on each."""
    monkeypatch.setattr(exactness, name, replacement)
    assert not check_estimator(toy, 4, beta, num_minibatches=5_000, seed=500, alpha=ALPHA).unbiased
