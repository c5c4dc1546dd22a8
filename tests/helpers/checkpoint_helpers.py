"""Checkpoints for the tests of writing, checking and resuming them: small checkpoint dicts, a Boring module
(a linear layer, SGD with momentum) and its trainer, whole-checkpoint comparison, a sharded (DCP) checkpoint read
as one dict, and the ``mode`` fixture (both ways the atomic IO writes a file: import ``write_mode``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, Dataset

from rloo_lightning.runtime import atomic_checkpoint


def _ckpt(seed: int, tensors: int = 4, numel: int = 1000) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"state_dict": {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(tensors)},
            "pytorch-lightning_version": "2.6.6", "global_step": seed, "epoch": 0, "hyper_parameters": {"seed": seed}}


def _same(a: dict, b: dict) -> bool:
    return (a["global_step"] == b["global_step"] and a["state_dict"].keys() == b["state_dict"].keys()
            and all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"]))


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(params=["tmpfile", "named"], name="mode")  # imported by its function's name, used as "mode"
def write_mode(request, monkeypatch):
    """Both ways of writing: an anonymous O_TMPFILE file of the destination's folder (where the filesystem has
    one), and a hidden named temporary file beside the destination."""
    if request.param == "named":
        monkeypatch.setattr(atomic_checkpoint, "_USE_TMPFILE", False)
    elif not atomic_checkpoint._USE_TMPFILE:
        pytest.skip("no O_TMPFILE on this platform")
    return request.param


# as test_callbacks_final_checkpoint: validation off, and no epoch-end save of Lightning's default ModelCheckpoint
NO_VALIDATION = {"limit_val_batches": 0, "check_val_every_n_epoch": None, "val_check_interval": 100}


def _trainer(**kwargs):
    from lightning.pytorch import Trainer

    return Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


class _Fixed(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.ones(4)


class Boring(LightningModule):
    """A linear layer trained on one fixed input (every batch alike, so a resume that restarts the epoch's
    data is still exact), SGD with momentum (optimizer state that a resume must carry on)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(_Fixed(), batch_size=2)


def _assert_same_checkpoint(got: Path, ref: Path) -> None:
    e, r = (torch.load(p, map_location="cpu", weights_only=False) for p in (got, ref))
    assert e["state_dict"].keys() == r["state_dict"].keys()
    for k in r["state_dict"]:
        assert torch.equal(e["state_dict"][k], r["state_dict"][k]), k
    eo, ro = e["optimizer_states"][0]["state"], r["optimizer_states"][0]["state"]
    assert eo.keys() == ro.keys()
    for i in ro:
        for name, value in ro[i].items():
            assert torch.equal(torch.as_tensor(eo[i][name]), torch.as_tensor(value)), (i, name)
    assert e["lr_schedulers"] == r["lr_schedulers"]


def _dcp_to_dict(folder: Path, tmp: Path) -> dict:
    """A sharded (DCP) checkpoint folder as one in-memory dict, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / (folder.name + ".pt")
    dcp_to_torch_save(str(folder), str(out))
    return torch.load(out, map_location="cpu", weights_only=False)
