"""Literals for the hand-computed tests of ``rloo_lightning.algo``: ``t([...])`` is a float64 tensor, ``nan`` a
missing value."""

from __future__ import annotations

import torch

nan = float("nan")
f64 = torch.float64


def t(values, dtype=f64):
    return torch.tensor(values, dtype=dtype)
