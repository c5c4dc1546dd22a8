"""The longer enumerable toy (completions of up to 8 tokens) of ``rloo_lightning.verify.exactness_long``, and the
study that measures every correction of ``model.correction`` on it (``experiments/offpolicy_family``).

The toy's enumeration is the whole distribution and its lengths are long enough to matter; on the module's own
step with a sampler that is not pi_theta, uncapped sequence weights are unbiased, no correction is detected as biased
(the test of the test), and so are the geometric weight (an estimator that is not an importance weight) and TOPR; the
study's script runs at 2 draws and writes the record its table reads; the truncation study's top-p / top-k mask is
the one hand-worked, its truncated target equals the full one when nothing is dropped, and its script runs.
"""

from __future__ import annotations

import json

import pytest
import torch
from study_helpers import load_script

from rloo_lightning.verify.exactness import completion_probabilities, enumerate_completions, perturbed_table
from rloo_lightning.verify.exactness_long import bias_and_variance, make_long_toy, mean_lengths, off_policy_draws

pytestmark = [pytest.mark.slow,  # statistical checks of a few hundred training steps each (5-10 s)
              pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")]

DRAWS = 300  # x 3 prompts x 16 repeats x k = 4 completions of up to 6 tokens (about 20 ms a draw)
MAX_LEN = 6  # the tests' toy: 127 completions, the exact gradient in 0.4 s (the study's is 8: 511, 2.5 s)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """The tensors are tiny (conftest's ``one_thread``)."""


@pytest.fixture(scope="module")
def toy():
    return make_long_toy(max_len=MAX_LEN)


def test_the_long_toy_enumerates_every_completion_and_they_are_long(toy):
    completions = enumerate_completions(toy)
    assert len(completions) == 2 ** (MAX_LEN + 1) - 1 and len({tuple(y) for y in completions}) == len(completions)
    torch.testing.assert_close(completion_probabilities(toy).sum(1), torch.ones(3, dtype=torch.float64))
    lengths = mean_lengths(toy)
    assert (lengths > 3.0).all() and (lengths < MAX_LEN).all(), lengths  # the EOS bias: long, not all cut
    assert (mean_lengths(make_long_toy(max_len=MAX_LEN, eos_bias=0.0)) < lengths).all()


@pytest.mark.parametrize("correction, unbiased", [
    ({"level": "sequence", "cap": None}, True),
    ({"level": "none"}, False),
    ({"level": "geometric", "cap": None}, False),  # the geometric mean is not pi_theta / pi_s
    ({"level": "topr"}, False),  # the positive samples keep pi_s's distribution
], ids=["sequence-IS", "none", "geometric", "topr"])
def test_corrections_against_a_sampler_that_is_not_pi_theta(toy, correction, unbiased):
    draws, exact = off_policy_draws(toy, perturbed_table(toy, 0.3), 0, DRAWS, {"correction": correction})
    result = bias_and_variance(draws, exact)
    assert result["unbiased"] is unbiased, result
    assert 0 <= result["relative_bias_debiased"] <= result["relative_bias"] + 1e-12


def test_the_study_runs_at_two_draws(tmp_path):
    study = load_script("experiments/offpolicy_family/measure.py")
    study.main(["--draws", "2", "--lags", "0", "1", "--scales", "0.3", "--max-len", "4", "--corrections", "none",
                "TOPR", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "lag1_scale0.3.json").read_text())
    assert record["lag"] == 1 and record["max_len"] == 4 and set(record["corrections"]) == {"none", "TOPR"}
    assert {"unbiased", "relative_bias_debiased", "relative_variance"} <= set(record["corrections"]["TOPR"])
    assert "sampler_mass_geometric_ratio_outside_0.9_1.1" in record
    # a correction measured later joins the cell's record; --distances rewrites the exact distances only
    study.main(["--draws", "2", "--lags", "1", "--scales", "0.3", "--max-len", "4", "--corrections", "Seq-TIS, cap 2",
                "--out", str(tmp_path)])
    record = json.loads((tmp_path / "lag1_scale0.3.json").read_text())
    assert list(record["corrections"]) == ["none", "Seq-TIS, cap 2", "TOPR"]
    study.main(["--draws", "2", "--lags", "0", "--sampler-temperatures", "0.8", "--max-len", "4", "--corrections",
                "none", "--out", str(tmp_path)])  # a sampler at another temperature than the policy's log-probs
    assert json.loads((tmp_path / "lag0_temperature0.8.json").read_text())["sequence_kl_sampler_to_policy"] > 0
    study.main(["--distances", "--out", str(tmp_path)])
    assert len(study.main(["--table", "--out", str(tmp_path)])) == 3


def test_truncation_keeps_the_tokens_top_p_and_top_k_keep():
    """Hand-worked: probabilities (0.5, 0.3, 0.2) in order, and permuted; top-p keeps a token while the mass ranked
    above it is below p (0.75 keeps two, 0.85 all three), top-k the k most likely."""
    from types import SimpleNamespace

    study = load_script("experiments/offpolicy_family/truncation.py")
    table = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.5, 0.3]], dtype=torch.float64).log()
    toy = SimpleNamespace(policy_table=table, temperature=1.0)
    kept = lambda **kw: (study.truncation_mask(toy, **kw) == 0).tolist()  # noqa: E731
    assert kept(top_p=0.75) == [[True, True, False], [False, True, True]]
    assert kept(top_p=0.85) == [[True, True, True], [True, True, True]]
    assert kept(top_k=1) == [[True, False, False], [False, True, False]]
    assert kept(top_p=0.85, top_k=2) == [[True, True, False], [False, True, True]]


def test_the_truncated_target_is_the_full_one_when_nothing_is_dropped_and_the_script_runs(toy, tmp_path):
    study = load_script("experiments/offpolicy_family/truncation.py")
    from rloo_lightning.verify.exactness import exact_gradient

    nothing = study.truncation_mask(toy, top_p=1.0)
    assert (nothing == 0).all()
    assert torch.allclose(study.truncated_gradient(toy, nothing, 0.1), exact_gradient(toy, 0.1))
    some = study.truncation_mask(toy, top_k=2)
    assert not torch.allclose(study.truncated_gradient(toy, some, 0.1), exact_gradient(toy, 0.1))
    study.main(["--draws", "2", "--top-p", "0.9", "--top-k", "--max-len", "4", "--corrections", "none",
                "--out", str(tmp_path)])
    record = json.loads((tmp_path / "truncation_top_p0.9.json").read_text())
    assert 0 < record["policy_mass_never_drawn"] < 1 and set(record["corrections"]["none"]) >= {"full", "truncated"}
    assert len(study.main(["--table", "--out", str(tmp_path)])) == 1
