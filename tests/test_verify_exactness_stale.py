"""Stale rollouts (``rollout.lag`` K = 1) through the module's own pipeline, against the exact gradient.

``rloo_lightning.verify.exactness_stale.check_stale_training_step`` runs the pipeline from fit start on the real
``training_step``: step 0, with the policy at ``theta_0`` (the toy's table), submits positions 0 and 1 through the
engine's ``submit`` (a :class:`LiveTableSampler`: it samples from the weights it is given, and reports its
log-probs); the policy then holds ``theta_1`` (``perturbed_table``) and step 1 trains on position 1's rollout,
sampled from ``theta_0``. Its target is ``grad J`` at ``theta_1``. Only uncapped sequence-level importance weights
make the stale samples unbiased; without correction the bias is detected (the test of the test); the default
(``auto``: token-level, truncated at 2) is measured. An engine that samples at ``collect`` instead of ``submit``
makes the uncorrected step unbiased: the bias measured is the stale samples'. ``experiments/async_exactness``
measures the same over several perturbation scales.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rloo_lightning.engines.base import Submitted
from rloo_lightning.verify.exactness import (
    LiveTableSampler, exact_gradient, make_toy, perturbed_table, toy_module, z_test,
)
from rloo_lightning.verify.exactness_stale import ToyPrompts, check_stale_training_step, stale_step_draws

pytestmark = [pytest.mark.slow,  # statistical checks of a few hundred training steps each (5-10 s)
              pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")]

DRAWS = 300  # x 3 prompts x 16 repeats x k = 4 stale completions; each draw runs steps 0 and 1 (about 30 ms)
SCALE = 0.5  # theta_1 = theta_0 + 0.5 N(0, 1): per-token KL(pi_s || pi_theta) about 0.15 on the sampled tokens


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """The tensors are tiny (conftest's ``one_thread``)."""


@pytest.fixture(scope="module")
def toy():
    return make_toy()


@pytest.fixture(scope="module")
def theta_1(toy):
    return perturbed_table(toy, SCALE)


@pytest.fixture(scope="module")
def uncorrected(toy, theta_1):
    return check_stale_training_step(toy, theta_1, DRAWS, options={"correction": {"level": "none"}})


# -- the harness drives the pipeline: the rollout of step K comes from step 0's weights ------------------
@pytest.mark.parametrize("lag", [1, 2])
def test_step_k_trains_on_the_rollout_sampled_at_step_0(toy, theta_1, lag):
    """The module's own metrics say so: staleness K, and a sampler mismatch that is the perturbation's (zero when
    theta_1 is theta_0). The module is left as it was (no trainer, nothing in its pipeline)."""
    for table, mismatched in [(toy.policy_table, False), (theta_1, True)]:
        module = toy_module(toy, {"rollout": {"lag": lag}}, engine=LiveTableSampler(toy))
        draws = stale_step_draws(module, ToyPrompts(toy, 2), toy.policy_table, table, 2)
        stats = module._last_stats
        assert draws.shape == (2, toy.policy_table.numel()) and torch.isfinite(draws).all()
        assert stats["train/staleness"] == lag
        assert (stats["train/mismatch/kl_k3"] > 0.01) == mismatched, stats
        assert abs(stats["train/mismatch/seq_log_ratio"]) < (1.0 if mismatched else 1e-5), stats
        assert module._trainer is None and not module.pipeline.ahead
    assert module.cfg.correction.level == "token" and module.cfg.correction.cap == 2.0  # auto with K >= 1


# -- unbiased with the exact correction, biased without ---------------------------------------------------
def test_sequence_importance_weights_make_the_stale_step_unbiased(toy, theta_1):
    result = check_stale_training_step(toy, theta_1, DRAWS, options={"correction": {"level": "sequence", "cap": None}})
    assert result.unbiased, result


def test_uncorrected_stale_step_is_measured_as_biased(uncorrected):
    """The test of the test: the stale samples trained as if on-policy are biased, and the z-test sees it."""
    assert not uncorrected.unbiased, uncorrected
    assert uncorrected.relative_bias > 0.15, uncorrected  # measured 0.30 (noise floor about 0.03)


def test_default_correction_is_measured(toy, theta_1, uncorrected):
    """``auto`` with K >= 1 is token-level TIS (truncate at 2): biased (it reweights each token, not the prefix it
    follows). Measured at this scale (``experiments/async_exactness``, 1000 draws): relative bias 0.23 against 0.34
    uncorrected (noise floor 0.01), max |z| 66; at 300 draws over seeds 1-8, 0.23 against 0.34, max |z| 35-40.
    Asserted: less biased than no correction, and biased beyond the draws' noise (the z-test fails)."""
    default = check_stale_training_step(toy, theta_1, DRAWS)
    assert default.relative_bias < uncorrected.relative_bias, (default, uncorrected)
    assert not default.unbiased, default


class _SamplesAtCollect(LiveTableSampler):
    """An overlapping engine that breaks ``submit``'s contract: it samples when collected, from the weights then."""

    def submit(self, model, tokenizer, prompt_ids, prompt_mask, generation_config, seed):
        return Submitted(key=(model, tokenizer, prompt_ids, prompt_mask, generation_config, seed))

    def collect(self, handle):
        return self.generate(*handle.key)


def test_the_bias_comes_from_the_weights_at_submission(toy, theta_1):
    """The uncorrected step's bias is the stale samples': the same step on an engine that samples at ``collect``
    (from ``theta_1``: on-policy, against ``submit``'s contract) is unbiased, with no correction."""
    module = toy_module(toy, {"rollout": {"lag": 1}, "correction": {"level": "none"}},
                        engine=_SamplesAtCollect(toy))
    draws = stale_step_draws(module, ToyPrompts(toy, 16), toy.policy_table, theta_1, DRAWS)
    result = z_test(draws, exact_gradient(dataclasses.replace(toy, policy_table=theta_1), 0.1))
    assert result.unbiased, result
    assert module._last_stats["train/staleness"] == 1  # the pipeline's bookkeeping cannot tell
