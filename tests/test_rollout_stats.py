"""``scripts/rollout_stats.py``'s batch statistics and their comparison (the script itself needs TRL and SmolLM2)."""

from __future__ import annotations

import sys

import pytest
from cli_harness import REPO

sys.path.insert(0, str(REPO / "scripts"))
import rollout_stats as rs  # noqa: E402


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
