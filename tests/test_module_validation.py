"""Validation metrics: unbiased pass@k (``rloo_lightning.metrics.pass_at_k``) and ``RLOOModule.evaluate_batch``
(per-prompt reward, pass@k, greedy accuracy, missing rewards), and the validation options.
"""

from __future__ import annotations

import math

import pytest
import torch

from rloo_lightning.module import RLOOModule
from rloo_lightning.metrics import pass_at_k
from module_helpers import REWARD, answer_batch as _batch, loaded_module as _module


# ---------------------------------------------------------------------------------------------
# pass@k
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 2, 0.5),
        (4, 0, 2, 0.0),
        (4, 4, 2, 1.0),
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3)
        (4, 3, 1, 0.75),  # k=1: c/n
        (4, 1, 4, 1.0),  # any success among all n
        (4, 0, 4, 0.0),
        (10, 3, 2, 1 - 21 / 45),  # 1 - C(7,2)/C(10,2)
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    out = pass_at_k(torch.tensor([c]), n, k)
    assert out.shape == (1,) and out.dtype == torch.float32
    assert out.item() == pytest.approx(expected, abs=1e-6)


def test_pass_at_k_matches_binomials_vectorised():
    for n in range(1, 9):
        c = torch.arange(n + 1)
        for k in range(1, n + 1):
            expected = [1 - math.comb(n - ci, k) / math.comb(n, k) for ci in range(n + 1)]
            torch.testing.assert_close(pass_at_k(c, n, k), torch.tensor(expected, dtype=torch.float32))
    # large n: still the exact value (no overflowing factorials)
    n, c, k = 200, 10, 50
    assert pass_at_k(torch.tensor([c]), n, k).item() == pytest.approx(1 - math.comb(190, 50) / math.comb(200, 50))


@pytest.mark.parametrize(("n", "k"), [(4, 5), (4, 0), (1, 2)])
def test_pass_at_k_rejects_k_outside_1_to_n(n, k):
    with pytest.raises(ValueError, match=f"k={k}"):
        pass_at_k(torch.tensor([0]), n, k)


# ---------------------------------------------------------------------------------------------
# evaluate_batch
# ---------------------------------------------------------------------------------------------
def letters_reward(prompts, completions, completion_ids, **columns):
    """Controllable: the fraction of the completion's letters that occur in its prompt (0 if empty)."""
    return [sum(ch in p for ch in c) / len(c) if c else 0.0 for p, c in zip(prompts, completions)]


def test_evaluate_batch_metrics_per_prompt(tiny_model_dir):
    module = _module(tiny_model_dir, rewards={"funcs": [letters_reward]}, sampling={"max_new_tokens": 6},
                     validation={"num_samples": 4, "pass_k": [1, 4], "success_threshold": 0.5})
    prompts = ["abc=", "hgfe=", "abcdefgh=", "d=", "aceg=", "bdfh="]
    batch = _batch(module.tokenizer, prompts)
    out = module.evaluate_batch(batch, 0)
    assert set(out) == {"reward", "pass@1", "pass@4", "reward_greedy", "accuracy_greedy"}
    assert set(out) == set(module.val_metrics)  # validation_step logs each through its metric
    assert all(v.shape == (len(prompts),) for v in out.values())

    # recompute from a second rollout with the same seed
    again = module.sample(batch, 4, module.sampling_seed("val", 0))
    again.scores, again.rewards = module.score(again, shape=False)
    rewards = again.rewards.view(len(prompts), 4)
    success = (rewards >= 0.5).float()
    torch.testing.assert_close(out["reward"], rewards.mean(1))
    torch.testing.assert_close(out["pass@1"], success.mean(1))
    torch.testing.assert_close(out["pass@4"], success.amax(1))
    assert set(out["pass@4"].tolist()) <= {0.0, 1.0}
    assert (out["pass@4"] >= out["pass@1"]).all()
    assert ((out["pass@1"] > 0) == (out["pass@4"] == 1)).all()
    # not degenerate: some prompts pass and the samples disagree somewhere
    assert 0 < out["pass@4"].sum() and ((out["pass@1"] > 0) & (out["pass@1"] < 1)).any(), out

    greedy = module.sample(batch, 1, 0, greedy=True)
    greedy.scores, greedy.rewards = module.score(greedy, shape=False)
    torch.testing.assert_close(out["reward_greedy"], greedy.rewards)
    torch.testing.assert_close(out["accuracy_greedy"], (greedy.rewards >= 0.5).float())

    # another batch index samples another stream; the same index the same one
    torch.testing.assert_close(module.evaluate_batch(batch, 0)["reward"], out["reward"])
    assert not torch.equal(module.evaluate_batch(batch, 1)["reward"], out["reward"])


def test_success_threshold_moves_pass_at_k(tiny_model_dir):
    batch = None
    outs = {}
    for threshold in (0.0, 1.01):
        module = _module(tiny_model_dir, rewards={"funcs": [letters_reward]}, sampling={"max_new_tokens": 6},
                         validation={"num_samples": 4, "pass_k": [2], "greedy": False, "success_threshold": threshold})
        batch = batch or _batch(module.tokenizer, ["abc=", "hgfe="])
        outs[threshold] = module.evaluate_batch(batch, 0)
    assert set(outs[0.0]) == {"reward", "pass@2"}  # no greedy keys when validation.greedy=False
    assert outs[0.0]["pass@2"].tolist() == [1.0, 1.0]  # every reward >= 0
    assert outs[1.01]["pass@2"].tolist() == [0.0, 0.0]  # no reward reaches 1.01
    torch.testing.assert_close(outs[0.0]["reward"], outs[1.01]["reward"])


def half_missing_reward(prompts, completions, completion_ids, **columns):
    """1.0 for even completions, None (no reward) for odd ones."""
    return [1.0 if i % 2 == 0 else None for i in range(len(completions))]


def test_evaluate_batch_missing_rewards_are_ignored_in_mean_and_fail(tiny_model_dir):
    module = _module(tiny_model_dir, rewards={"funcs": [half_missing_reward]}, sampling={"max_new_tokens": 4},
                     validation={"num_samples": 4, "pass_k": [1, 4], "success_threshold": 0.5, "greedy": False})
    out = module.evaluate_batch(_batch(module.tokenizer, ["abc=", "hg="]), 0)
    assert out["reward"].tolist() == [1.0, 1.0]  # mean over the scored samples only
    assert out["pass@1"].tolist() == [0.5, 0.5]  # a missing reward is not a success
    assert out["pass@4"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("bad", [[5], [0], [1, 5]])
def test_invalid_val_pass_k_raises(bad):
    with pytest.raises(ValueError, match=r"validation\.pass_k=.*validation\.num_samples=4"):
        RLOOModule(model_name_or_path="unused", rewards={"funcs": [REWARD]},
                   validation={"num_samples": 4, "pass_k": bad})


def test_val_num_samples_below_1_raises():
    with pytest.raises(ValueError, match=r"validation\.num_samples must be >= 1"):
        RLOOModule(model_name_or_path="unused", rewards={"funcs": [REWARD]}, validation={"num_samples": 0})
