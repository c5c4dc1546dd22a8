"""What ``RLOOModule`` reads in place of a trainer when it is driven by hand: the exactness harness calls
``training_step`` without one, tests call its pieces. One object instead of a branch at each place the module reads
its trainer."""

from __future__ import annotations

import torch

__all__ = ["NO_TRAINER", "NoTrainer"]


class _NoStrategy:
    """No strategy: the policy's own device is the CPU's; the sharding helpers see no strategy they know (they then
    look at the model itself, as for ``None``)."""

    root_device = torch.device("cpu")


class NoTrainer:
    """One process, no callbacks, no data module, no loss scaler, no strategy; every batch ends an optimizer step."""

    world_size = 1
    is_global_zero = True
    accumulate_grad_batches = 1
    callbacks: tuple = ()
    datamodule = None
    precision_plugin = None
    strategy = _NoStrategy()


NO_TRAINER = NoTrainer()
