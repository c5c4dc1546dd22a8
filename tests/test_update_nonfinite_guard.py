"""``rloo_lightning.update.NonFiniteGuard``: one non-finite element among many tensors is found, large finite
values and empty shards are not mistaken for one.
"""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_guard_finds_one_bad_element_among_many_tensors(bad):
    from rloo_lightning.update import NonFiniteGuard

    def reduce(t, op):
        return t

    tensors = [torch.randn(5, 3), torch.empty(0), torch.full((4,), 3e38), torch.randn(7, dtype=torch.float64)]
    assert NonFiniteGuard.finite(reduce, *tensors)  # large but finite values do not overflow the check
    for i in (0, 2, 3):
        broken = [t.clone() for t in tensors]
        broken[i].view(-1)[-1] = bad
        assert not NonFiniteGuard.finite(reduce, *broken), i
    assert NonFiniteGuard.finite(reduce, torch.empty(0))  # an empty shard (FSDP2) is finite
