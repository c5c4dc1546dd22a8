"""A full disk: found before training, and when a save still meets one, one line and the previous checkpoint whole.

* A write that fails for lack of space (``ENOSPC`` from the file's ``write`` or from ``fsync``; torch's zip writer
  turns the first into ``RuntimeError: ... unexpected pos ...``) raises :class:`NoSpaceError`, one line naming the
  folder, the checkpoint's size and the free space; the previous ``last.ckpt`` is left whole and loadable and no
  temporary file remains. Simulated by a file whose ``write`` fails past a byte budget (no small filesystem can be
  mounted without root), and for real on a 3 MB tmpfs where one can be mounted.
* Before the first step, :meth:`FinalCheckpoint.check_space` refuses a fit whose checkpoint folder's filesystem
  cannot take its checkpoints at once (free space read through ``shutil.disk_usage``, patched): through a CLI fit,
  at exactly one byte short, and the same fit with exactly the room it needs trains; the estimate is a lower bound
  of the checkpoint written.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import traceback
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import NO_VALIDATION, _ckpt, _load, _same, _trainer
from checkpoint_helpers import write_mode  # noqa: F401 (the fixture "mode": both ways of writing a file)

from rloo_lightning.callbacks import FinalCheckpoint
from rloo_lightning.callbacks import checkpoint as final
from rloo_lightning.runtime import atomic_checkpoint
from rloo_lightning.runtime.atomic_checkpoint import MB, AtomicCheckpointIO, NoSpaceError, storage_bytes
from rloo_lightning.runtime.checkpoint_check import check_checkpoint_path, optimizer_state_ratio

HERE = Path(__file__).resolve()
HINT = "free some space or write checkpoints elsewhere (trainer.default_root_dir)"
Usage = namedtuple("Usage", "total used free")


def _free(monkeypatch, free: int) -> None:
    """``shutil.disk_usage`` reports ``free`` bytes free, wherever it is asked."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 ** 12, 10 ** 12 - free, free))


class _FullFile:
    """A file that takes ``budget`` bytes, then fails as a full filesystem does (``ENOSPC``)."""

    def __init__(self, f, budget: int) -> None:
        self.f, self.budget = f, budget

    def write(self, data) -> int:
        if len(data) > self.budget:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.budget -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def _disk_full_after(monkeypatch, budget: int, where: str) -> None:
    """The next checkpoint file written fails for lack of space: in ``write`` past ``budget`` bytes, or in ``fsync``
    (where a filesystem with delayed allocation reports it)."""
    if where == "write":
        real = os.fdopen
        monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: _FullFile(real(fd, *a, **k), budget))
    else:
        def fsync(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "fsync", fsync)


# -- a save that meets a full disk --------------------------------------------------------------------------------
@pytest.mark.usefixtures("mode")
@pytest.mark.parametrize("where", ["write", "fsync"])
def test_enospc_mid_save_keeps_the_previous_checkpoint_whole(tmp_path, monkeypatch, where):
    dest = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(_ckpt(0), dest)
    before = dest.read_bytes()
    new = _ckpt(1, tensors=8)
    _free(monkeypatch, 1_234_567)
    _disk_full_after(monkeypatch, len(before), where)
    with pytest.raises(NoSpaceError) as raised:
        AtomicCheckpointIO().save_checkpoint(new, dest)
    assert str(raised.value) == (f"no space left on {tmp_path} (checkpoint last.ckpt of ~{storage_bytes(new) / MB:.1f}"
                                 f" MB, 1.2 MB free): the previous last.ckpt is whole (not replaced); {HINT}")
    assert raised.value.errno == errno.ENOSPC and "\n" not in str(raised.value)
    monkeypatch.undo()
    assert dest.read_bytes() == before and os.listdir(tmp_path) == ["last.ckpt"]  # no temporary file left
    check_checkpoint_path(dest)
    assert _same(_load(dest), _ckpt(0))


def test_torchs_unexpected_pos_is_called_a_full_disk_only_when_the_disk_is_full(tmp_path, monkeypatch):
    """torch's zip writer may report a failed write as ``unexpected pos`` with no errno: the free space tells."""
    unexpected = "[enforce fail at inline_container.cc:672] . unexpected pos 1281280 vs 1281168"
    new = _ckpt(1, tensors=8)

    def save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04partial")
        raise RuntimeError(unexpected)

    monkeypatch.setattr(torch, "save", save)
    _free(monkeypatch, storage_bytes(new) // 2)  # less than the checkpoint: the write cannot have succeeded
    with pytest.raises(NoSpaceError, match=rf"^no space left on {re.escape(str(tmp_path))} \(checkpoint last.ckpt "
                                           r"of ~0.0 MB, 0.0 MB free\): no last.ckpt was written; ") as raised:
        AtomicCheckpointIO().save_checkpoint(new, tmp_path / "last.ckpt")
    assert str(raised.value.__cause__) == unexpected  # kept as the cause (RLOO_TRACEBACK=1 shows it)
    _free(monkeypatch, 10 ** 9)  # room enough: another failure, passed on as it is
    with pytest.raises(RuntimeError, match=re.escape(unexpected)):
        AtomicCheckpointIO().save_checkpoint(new, tmp_path / "last.ckpt")
    assert os.listdir(tmp_path) == []


def test_a_sharded_save_that_meets_a_full_disk_leaves_no_staged_folder(tmp_path, monkeypatch):
    """A folder written by the strategy (torch.distributed.checkpoint gathers the ranks' errors into a
    ``CheckpointException``, no ``Exception``): the staged folder goes, the previous last.ckpt folder is whole."""
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from checkpoint_helpers import Boring
    from torch.distributed.checkpoint.api import CheckpointException

    class FolderStrategy(SingleDeviceStrategy):
        def save_checkpoint(self, checkpoint, filepath, storage_options=None):
            path = Path(filepath)
            path.mkdir(parents=True)
            torch.save(checkpoint.pop("state_dict"), path / "__0_0.distcp")
            if checkpoint["global_step"] == 2:  # the second save: a shard cut short by a full disk
                failure = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                raise CheckpointException("save failed", {0: (failure, traceback.StackSummary())})
            (path / ".metadata").write_bytes(b"dcp")
            torch.save(checkpoint, path / "meta.pt")

    monkeypatch.setattr(final, "saves_a_folder", lambda strategy: isinstance(strategy, FolderStrategy))
    trainer = _trainer(strategy=FolderStrategy(device=torch.device("cpu")), max_steps=3, callbacks=[
        FinalCheckpoint(every_n_steps=1)], default_root_dir=tmp_path, **NO_VALIDATION)
    with pytest.raises(NoSpaceError, match=r"^no space left on .*checkpoints \(checkpoint last.ckpt of ~0.0 MB, "
                                           r"[0-9.]+ MB free\): the previous last.ckpt is whole \(not replaced\); "):
        trainer.fit(Boring())
    folder = tmp_path / "checkpoints"
    assert os.listdir(folder) == ["last.ckpt"]  # no staged .last.ckpt.tmp-... folder
    check_checkpoint_path(folder / "last.ckpt")
    assert torch.load(folder / "last.ckpt" / "meta.pt")["global_step"] == 1


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 3 MB tmpfs (root only: skipped where it cannot be mounted)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("tmpfile", [True, False])
def test_a_real_full_filesystem(small_tmpfs, monkeypatch, tmpfile):
    """No simulation: a 1.6 MB last.ckpt, then a 2 MB one on a 3 MB filesystem (torch's own error underneath)."""
    monkeypatch.setattr(atomic_checkpoint, "_USE_TMPFILE", tmpfile and atomic_checkpoint._USE_TMPFILE)
    dest = small_tmpfs / "checkpoints" / "last.ckpt"
    old, new = _ckpt(0, tensors=4, numel=100_000), _ckpt(1, tensors=5, numel=100_000)
    AtomicCheckpointIO().save_checkpoint(old, dest)
    with pytest.raises(NoSpaceError, match=rf"^no space left on {re.escape(str(dest.parent))} \(checkpoint last.ckpt "
                                           r"of ~2.0 MB, 1.[0-9] MB free\): the previous last.ckpt is whole"):
        AtomicCheckpointIO().save_checkpoint(new, dest)
    assert os.listdir(dest.parent) == ["last.ckpt"]
    assert _same(_load(dest), old)
    assert shutil.disk_usage(small_tmpfs).free > 1.2 * MB  # the failed write's space is given back


# -- before training -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("optimizer", "ratio"), [
    (lambda p: torch.optim.AdamW(p), 2.0),  # two moments per parameter
    (lambda p: torch.optim.Adam(p, amsgrad=True), 3.0),
    (lambda p: torch.optim.SGD(p, lr=0.1), 0.0),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1.0),
    (lambda p: torch.optim.Adafactor(p), 0.0),  # factored: a row and a column per matrix, nothing per element
])
def test_optimizer_state_ratio(optimizer, ratio):
    assert optimizer_state_ratio(optimizer([torch.nn.Parameter(torch.zeros(3))])) == ratio


class _Picky(torch.optim.SGD):
    def __init__(self, params, scale):  # a constructor that does not take its defaults back: counted as no state
        super().__init__(params, lr=0.1 * scale, momentum=0.9)


def test_an_optimizer_that_cannot_be_probed_counts_as_no_state():
    assert optimizer_state_ratio(_Picky([torch.nn.Parameter(torch.zeros(3))], scale=1.0)) == 0.0


def _fit_boring(tmp_path, callbacks, **kwargs):
    from checkpoint_helpers import Boring

    trainer = _trainer(callbacks=callbacks, default_root_dir=tmp_path, **{"max_steps": 2, **NO_VALIDATION, **kwargs})
    trainer.fit(Boring())
    return trainer


@pytest.mark.parametrize(("model_checkpoint", "at_once"), [
    (None, 2),  # last.ckpt and the next one written beside it
    ({"save_top_k": 2, "monitor": "step", "mode": "max", "every_n_train_steps": 1}, 4),  # and the 2 files it keeps
    ({"save_top_k": 1, "every_n_train_steps": 1, "save_last": True}, 3),  # its last.ckpt is FinalCheckpoint's
    ({"save_top_k": 1}, 2),  # saves at an epoch's end only, with validation off: not counted
])
def test_the_check_counts_the_checkpoints_kept_at_once(tmp_path, monkeypatch, model_checkpoint, at_once):
    """A Boring module (a 4x2 layer, SGD with momentum: 10 parameters x 4 bytes x 2 = 80 bytes a checkpoint): one
    byte short of ``at_once`` checkpoints refuses before any step, exactly enough trains."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def callbacks():
        cbs = [FinalCheckpoint()]
        return cbs + [ModelCheckpoint(dirpath=tmp_path / "checkpoints", **model_checkpoint)] if model_checkpoint \
            else cbs

    _free(monkeypatch, 80 * at_once - 1)
    with pytest.raises(NoSpaceError) as raised:
        _fit_boring(tmp_path, callbacks())
    assert str(raised.value).startswith(f"not enough space in {tmp_path / 'checkpoints'} for this fit's checkpoints: "
                                        f"0.0 MB free, ~0.0 MB needed (a checkpoint of ~0.0 MB, {at_once} at once: ")
    assert not (tmp_path / "checkpoints").exists()  # nothing was trained or saved
    _free(monkeypatch, 80 * at_once)
    assert _fit_boring(tmp_path, callbacks()).global_step == 2


def test_checkpoints_already_in_the_folder_count_as_free(tmp_path, monkeypatch):
    """Resumed into the folder of its last.ckpt: the old file is replaced, so the new one needs only its own size."""
    _fit_boring(tmp_path, [FinalCheckpoint()])
    old = (tmp_path / "checkpoints" / "last.ckpt").stat().st_size
    _free(monkeypatch, max(80, 2 * 80 - old))
    assert _fit_boring(tmp_path, [FinalCheckpoint()], max_steps=4).global_step == 4
    _free(monkeypatch, 79)  # less than one checkpoint: refused whatever is there
    with pytest.raises(NoSpaceError, match=r"~0.0 MB needed \(a checkpoint of ~0.0 MB, 2 at once: last.ckpt and the "
                                           r"next one written beside them, less 0.0 MB of checkpoints already there"):
        _fit_boring(tmp_path, [FinalCheckpoint()], max_steps=6)


@pytest.mark.slow  # two in-process CLI fits of the tiny model
def test_a_cli_fit_is_refused_before_its_first_step_and_trains_with_room(tmp_path, tiny_model_dir, monkeypatch,
                                                                         capsys):
    from rloo_lightning.cli import TRACEBACK_ENV, _run_reporting_errors

    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    sizes, real = [], final.checkpoint_bytes
    monkeypatch.setattr(final, "checkpoint_bytes", lambda *a: sizes.append(real(*a)) or sizes[-1])
    args = ["fit", "--config", str(HERE.parents[1] / "configs" / "quickstart.yaml"), "--model.model_name_or_path",
            tiny_model_dir, "--trainer.max_steps", "2", "--data.num_val_rows", "8", "--trainer.default_root_dir"]
    free = {"bytes": 0}
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 ** 12, 10 ** 12, free["bytes"]))
    with pytest.raises(SystemExit) as exit_:
        _run_reporting_errors([*args, str(tmp_path / "refused")])
    assert exit_.value.code == 1
    out, err = capsys.readouterr()
    folder = tmp_path / "refused" / "lightning_logs" / "version_0" / "checkpoints"
    size = sizes[-1]
    # quickstart: last.ckpt, Lightning's default ModelCheckpoint (save_top_k=1) and one being written
    expected = (f"error: not enough space in {folder} for this fit's checkpoints: 0.0 MB free, ~{3 * size / MB:.1f} "
                f"MB needed (a checkpoint of ~{size / MB:.1f} MB, 3 at once: last.ckpt, 1 kept by ModelCheckpoint and "
                f"the next one written beside them); {HINT}")
    assert [line for line in err.splitlines() if line.startswith("error:")] == [expected], err
    assert "train step" not in out + err and "validation (" not in out + err  # nothing generated
    assert not folder.exists()

    free["bytes"] = 3 * size  # exactly the room it needs
    _run_reporting_errors([*args, str(tmp_path / "room")])
    last = tmp_path / "room" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    written = last.stat().st_size
    assert size <= written <= size + 64_000  # a lower bound, and a close one: the pickled structure is ~32 KB
    print(f"\nestimate {sizes[-1]:,} bytes, checkpoint {written:,} bytes")
