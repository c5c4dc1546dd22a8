"""``experiments/rollout_stats/rollout_stats.py``'s batch statistics and their comparison (the script itself needs
TRL and SmolLM2)."""

from __future__ import annotations

import pytest
from study_helpers import load_script

rs = load_script("experiments/rollout_stats/rollout_stats.py")


def test_batch_stats_count_flat_groups_prompt_major():
    # two prompts, k = 3: the first group all 0 (flat), the second mixed
    cut = [False, False, True, True, False, False]
    s = rs.batch_stats([0.0, 0.0, 0.0, 1.0, 0.0, 1.0], [5, 7, 48, 48, 10, 2], cut, 3)
    assert s == {"reward": pytest.approx(1 / 3), "flat_groups": 0.5, "length": 20.0, "truncated": pytest.approx(1 / 3)}
    assert rs.batch_stats([1.0, 1.0, 0.0, 0.0], [1] * 4, [False] * 4, 2)["flat_groups"] == 1.0
    assert rs.batch_stats([1.0, 0.0, 0.0, 0.0], [1] * 4, [False] * 4, 2)["flat_groups"] == 0.5


def test_compare_gives_the_difference_and_its_standard_error():
    ours = [{"reward": r} for r in (0.1, 0.3, 0.2)]
    trl = [{"reward": r} for r in (0.0, 0.2)]
    c = rs.compare(ours, trl)["reward"]
    se = (0.01 / 3 + 0.02 / 2) ** 0.5  # sample variances 0.01 and 0.02
    assert (c["ours"], c["trl"], c["difference"]) == (0.2, 0.1, 0.1)
    assert c["se"] == pytest.approx(se, abs=1e-4) and c["z"] == pytest.approx(0.1 / se, abs=0.01)


def test_policy_weights_reads_a_lightning_checkpoint_or_a_state_dict(tmp_path):
    import torch

    w = torch.arange(4.0)
    ckpt = tmp_path / "last.ckpt"  # a fit checkpoint: the module's state dict, the policy under "policy."
    torch.save({"state_dict": {"policy.model.embed.weight": w, "reference.x": torch.zeros(1)}, "epoch": 0}, ckpt)
    assert list(rs.policy_weights(str(ckpt))) == ["model.embed.weight"]
    assert torch.equal(rs.policy_weights(str(ckpt))["model.embed.weight"], w)
    plain = tmp_path / "policy.pt"
    torch.save({"lm_head.weight": w}, plain)
    assert list(rs.policy_weights(str(plain))) == ["lm_head.weight"]
    empty = tmp_path / "empty.ckpt"
    torch.save({"state_dict": {"reference.x": w}}, empty)
    with pytest.raises(SystemExit, match="--weights .*no policy weights"):
        rs.policy_weights(str(empty))
