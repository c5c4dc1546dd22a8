"""Reward shaping options of RLOOModule, checked against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from rloo_lightning import RLOOModule
from rloo_lightning.rollout import Rollout

REWARD = "rloo_lightning.tasks.reverse.reward"


def _rollout(rewards, lengths, truncated, T=6, k=2) -> Rollout:
    B = len(rewards)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).float()
    return Rollout(k=k, prompt_ids=torch.ones(B, 2, dtype=torch.long), prompt_mask=torch.ones(B, 2, dtype=torch.long),
                   completion_ids=torch.full((B, T), 4), completion_mask=mask,
                   truncated=torch.tensor(truncated), prompts=["a="] * B, completions=["a"] * B,
                   rewards=torch.tensor(rewards), columns={"given": list(rewards)})


def given(prompts, completions, completion_ids, given):
    """The reward written in the rollout's ``given`` column, so that ``module.score`` reproduces it."""
    return given


GIVEN = f"{__name__}.given"


def test_shaping_order_overlong_then_missing_eos_then_clip(tiny_model_dir):
    module = RLOOModule(tiny_model_dir, rewards={"funcs": [GIVEN]}, sampling={"max_new_tokens": 6},
                        shaping={"missing_eos_penalty": 0.5, "overlong_buffer": 2, "overlong_factor": 1.0,
                                 "reward_clip": (-0.2, 0.8)})
    rollout = _rollout([1.0, 1.0, 0.0, 0.5], lengths=[3, 5, 6, 4], truncated=[False, False, True, False])
    # the training step's scoring: the reward functions, then the shaping
    rollout.scores, rollout.rewards = module.score(rollout)
    # lengths 3, 4 <= 6-2: no overlong penalty; 5: (4-5)/2 = -0.5; 6 (truncated): (4-6)/2 = -1.0
    # then missing EOS: row 2 -0.5; then clip to [-0.2, 0.8]
    expected = [min(1.0, 0.8), 1.0 - 0.5, max(0.0 - 1.0 - 0.5, -0.2), 0.5]
    assert rollout.rewards.tolist() == pytest.approx(expected)
    assert rollout.scores["given"].tolist() == [1.0, 1.0, 0.0, 0.5]  # the per-function scores are unshaped
    rollout.scores, rollout.rewards = module.score(rollout, shape=False)  # validation's scoring: unshaped
    assert rollout.rewards.tolist() == [1.0, 1.0, 0.0, 0.5]


def test_shaping_off_by_default_leaves_rewards(tiny_model_dir):
    module = RLOOModule(tiny_model_dir, rewards={"funcs": [GIVEN]}, sampling={"max_new_tokens": 6})
    rollout = _rollout([1.0, 3.0, -2.0, 0.5], lengths=[3, 5, 6, 4], truncated=[False, False, True, False])
    rollout.scores, rollout.rewards = module.score(rollout)
    assert rollout.rewards.tolist() == [1.0, 3.0, -2.0, 0.5]


def test_mask_truncated_completions_leave_loss_and_baseline(tiny_model_dir):
    module = RLOOModule(tiny_model_dir, rewards={"funcs": [REWARD]}, sampling={"k": 3, "max_new_tokens": 6},
                        kl={"beta": 0.0}, shaping={"mask_truncated_completions": True})
    module.configure_model()
    module.log = lambda *a, **kw: None
    rollout = _rollout([0.0, 1.0, 0.4, 0.2, 0.6, 0.9], lengths=[3, 6, 2, 4, 6, 6],
                       truncated=[False, True, False, False, True, True], k=3)
    loss, _ = module.rollout_loss(rollout)
    assert rollout.keep.tolist() == [True, False, True, True, False, False]
    # group 0: valid rewards 0.0 and 0.4 -> A = -0.4, 0.4; group 1: one valid reward -> all 0
    assert rollout.advantages.tolist() == pytest.approx([-0.4, 0.0, 0.4, 0.0, 0.0, 0.0])
    assert torch.isfinite(loss)


@pytest.mark.parametrize("groups, match", [
    ({"shaping": {"overlong_buffer": 6}}, r"shaping\.overlong_buffer must be in \[0, sampling\.max_new_tokens=6\)"),
    ({"shaping": {"reward_clip": (1.0, 0.0)}}, r"shaping\.reward_clip must be \[low, high\]"),
    ({"update": {"on_nonfinite": "ignore"}}, r"update\.on_nonfinite must be one of"),
    ({"rewards": {"workers": -1}}, r"rewards\.workers .*must be >= 0"),
])
def test_bad_shaping_options_raise(groups, match):
    groups = {**groups, "rewards": {"funcs": [REWARD], **groups.get("rewards", {})}}
    with pytest.raises(ValueError, match=match):
        RLOOModule("unused", sampling={"max_new_tokens": 6}, **groups)
