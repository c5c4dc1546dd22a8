"""Checkpoints that cannot be half-written (``rloo_lightning.runtime.atomic_checkpoint``).

Fast, in process: :class:`AtomicCheckpointIO` writes beside the destination, never in ``$TMPDIR`` (Lightning's
own IO does: shown by the same patch), and a failed save leaves the old file and nothing else; stale temporary
files of dead processes go at the next save; folders are swapped in whole; the IO is installed on every trainer
the CLI makes (single device, ddp, ddp_spawn, inside ``AsyncCheckpointIO``) and not over a user's own plugin;
``FinalCheckpoint`` stages a sharded strategy's folder beside ``last.ckpt``.

Slow, subprocesses: a 200 MB save killed with SIGKILL while its temporary file grows (``$TMPDIR`` on another
filesystem, ``/dev/shm``, when there is one) leaves the old checkpoint, whole; the same kill of Lightning's own
save leaves a truncated file (the control: the kill does land mid-write).

This file is also the writer those kills interrupt:
``python tests/test_runtime_atomic_checkpoint.py writer <dest> <mode>`` (``tests/helpers/`` on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from rloo_lightning.runtime import atomic_checkpoint
from rloo_lightning.runtime.atomic_checkpoint import (
    AtomicCheckpointIO,
    atomic_copy,
    install_atomic_checkpoint_io,
    remove_stale_temps,
    replace_path,
    staging_path,
)
from rloo_lightning.runtime.checkpoint_check import check_checkpoint_path

from checkpoint_helpers import NO_VALIDATION, _ckpt, _load, _same, _trainer
from checkpoint_helpers import write_mode  # noqa: F401 (the fixture "mode": both ways of writing a file)


HERE = Path(__file__).resolve()
TENSORS, NUMEL = 50, 1_000_000  # 50 x 4 MB: the kill test's 200 MB checkpoint


def _visible(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if not p.name.startswith(".")}


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def other_tmpdir(tmp_path, monkeypatch):
    """``$TMPDIR`` on another filesystem (``/dev/shm`` where there is one), and any use of it an error."""
    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path / "tmpdir"
    base.mkdir(exist_ok=True)
    monkeypatch.setenv("TMPDIR", str(base))
    monkeypatch.setattr(tempfile, "tempdir", str(base))

    def refuse(*args, **kwargs):
        raise AssertionError("a temporary file in $TMPDIR")

    for name in ("mkstemp", "mkdtemp", "NamedTemporaryFile", "TemporaryFile"):
        monkeypatch.setattr(tempfile, name, refuse)
    yield base
    assert not list(base.iterdir()), "something was written to $TMPDIR"
    if str(base).startswith("/dev/shm/"):
        base.rmdir()


# -- writing -----------------------------------------------------------------------------------------------------
def test_save_goes_beside_the_destination_not_to_tmpdir(tmp_path, mode, other_tmpdir):
    dest = tmp_path / "ckpt" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(_ckpt(0), dest)  # makes the folder
    AtomicCheckpointIO().save_checkpoint(_ckpt(1), dest)  # over an existing one
    assert _same(_load(dest), _ckpt(1))
    assert os.listdir(dest.parent) == ["last.ckpt"]  # no temporary file left, hidden or not
    assert AtomicCheckpointIO().load_checkpoint(dest)["global_step"] == 1  # Lightning's loading, unchanged
    # Lightning's own IO, under the same $TMPDIR: its save goes through a temporary file there
    with pytest.raises(AssertionError, match=r"\$TMPDIR"):
        TorchCheckpointIO().save_checkpoint(_ckpt(2), dest)


def test_the_temporary_file_is_in_the_destinations_folder(tmp_path, mode, monkeypatch):
    renames = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renames.append((a, b)), real(a, b))[1])
    dest = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(_ckpt(0), dest)
    AtomicCheckpointIO().save_checkpoint(_ckpt(1), str(dest))
    assert len(renames) == 1  # the first save renames onto a free name (os.rename)
    tmp, target = renames[0]
    assert target == str(dest) and Path(tmp).parent == tmp_path
    assert re.fullmatch(rf"\.last\.ckpt\.tmp-{os.getpid()}@.+-[0-9a-f]{{8}}", Path(tmp).name), tmp


def test_a_failed_save_leaves_the_old_file_and_nothing_else(tmp_path, mode):
    dest = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(_ckpt(0), dest)
    before = dest.read_bytes()
    bad = {**_ckpt(1), "unpicklable": lambda: None}
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        AtomicCheckpointIO().save_checkpoint(bad, dest)
    assert dest.read_bytes() == before and os.listdir(tmp_path) == ["last.ckpt"]


def test_a_symlink_destination_is_replaced_not_followed(tmp_path, mode):
    AtomicCheckpointIO().save_checkpoint(_ckpt(0), tmp_path / "step0.ckpt")
    (tmp_path / "last.ckpt").symlink_to(tmp_path / "step0.ckpt")  # ModelCheckpoint(save_last="link")
    AtomicCheckpointIO().save_checkpoint(_ckpt(1), tmp_path / "last.ckpt")
    assert not (tmp_path / "last.ckpt").is_symlink()
    assert _load(tmp_path / "step0.ckpt")["global_step"] == 0 and _load(tmp_path / "last.ckpt")["global_step"] == 1


def test_storage_options_are_refused_and_a_remote_url_goes_to_lightning(tmp_path, monkeypatch):
    with pytest.raises(TypeError, match="storage_options"):
        AtomicCheckpointIO().save_checkpoint(_ckpt(0), tmp_path / "x.ckpt", storage_options={"a": 1})
    seen = []
    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", lambda self, c, p, storage_options=None: seen.append(p))
    AtomicCheckpointIO().save_checkpoint(_ckpt(0), "s3://bucket/last.ckpt")
    AtomicCheckpointIO().save_checkpoint(_ckpt(0), f"file://{tmp_path}/local.ckpt")
    assert seen == ["s3://bucket/last.ckpt"] and _load(tmp_path / "local.ckpt")["global_step"] == 0


def test_stale_temporary_files_of_dead_processes_go_at_the_next_save(tmp_path):
    dead, host = _dead_pid(), atomic_checkpoint._HOST
    stale_file = tmp_path / f".epoch=0-step=3.ckpt.tmp-{dead}@{host}-0123abcd"
    stale_dir = tmp_path / f".last.ckpt.tmp-{dead}@{host}-89abcdef"
    alive = tmp_path / f".last.ckpt.tmp-{os.getpid()}@{host}-00000000"  # a save in progress: kept
    other_host = tmp_path / f".last.ckpt.tmp-{dead}@{host}x-11111111"  # another machine's: kept
    stale_file.write_bytes(b"PK\x03\x04partial")
    stale_dir.mkdir()
    (stale_dir / "__0_0.distcp").write_bytes(b"partial")
    alive.write_bytes(b"")
    other_host.write_bytes(b"")
    AtomicCheckpointIO().save_checkpoint(_ckpt(0), tmp_path / "epoch=0-step=4.ckpt")
    assert sorted(os.listdir(tmp_path)) == sorted([alive.name, other_host.name, "epoch=0-step=4.ckpt"])


def test_a_swap_cut_between_its_two_renames_is_undone_by_the_next_save(tmp_path):
    """The fallback swap of folders (no renameat2): a kill between its renames leaves the old checkpoint under
    ``.last.ckpt.old-...`` and no last.ckpt; the check says so, and the next save into the folder renames it back
    before writing (here a step file: last.ckpt is back, as it was)."""
    old = tmp_path / f".last.ckpt.old-{_dead_pid()}@{atomic_checkpoint._HOST}-0123abcd"
    old.mkdir()
    (old / "meta.pt").write_bytes(b"old")
    with pytest.raises(FileNotFoundError, match=r"does not exist \(a save was cut off while swapping it in: the "
                                                r"previous one is .*\.last\.ckpt\.old-.*; rename it back\)"):
        check_checkpoint_path(tmp_path / "last.ckpt")
    assert remove_stale_temps(tmp_path) == [old.name]
    assert (tmp_path / "last.ckpt" / "meta.pt").read_bytes() == b"old"


def _folder(path: Path, tag: str) -> Path:
    path.mkdir()
    (path / "meta.pt").write_text(tag)
    (path / "__0_0.distcp").write_text(tag)
    return path


@pytest.mark.parametrize("exchange", [True, False])
def test_replace_path_swaps_folders_and_files_whole(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(atomic_checkpoint, "_exchange", lambda a, b: False)
    target = tmp_path / "last.ckpt"
    _folder(Path(staging_path(target)), "1")
    replace_path(next(tmp_path.glob(".last.ckpt.tmp-*")), target)  # onto nothing
    staged = _folder(Path(staging_path(target)), "2")
    replace_path(staged, target)  # folder over folder
    assert (target / "meta.pt").read_text() == "2" and os.listdir(tmp_path) == ["last.ckpt"]
    staged = Path(staging_path(target))
    staged.write_text("file")
    replace_path(staged, target)  # file over folder
    assert target.read_text() == "file" and os.listdir(tmp_path) == ["last.ckpt"]
    replace_path(_folder(Path(staging_path(target)), "3"), target)  # folder over file
    assert (target / "meta.pt").read_text() == "3" and os.listdir(tmp_path) == ["last.ckpt"]


def test_atomic_copy_stages_beside_the_target(tmp_path, mode, other_tmpdir):
    src = tmp_path / "epoch=0-step=4.ckpt"
    AtomicCheckpointIO().save_checkpoint(_ckpt(4), src)
    AtomicCheckpointIO().save_checkpoint(_ckpt(3), tmp_path / "last.ckpt")
    atomic_copy(src, tmp_path / "last.ckpt")
    assert (tmp_path / "last.ckpt").read_bytes() == src.read_bytes()
    sharded = _folder(tmp_path / "epoch=0-step=5.ckpt", "5")
    atomic_copy(sharded, tmp_path / "last.ckpt")  # a folder over a file
    atomic_copy(sharded, tmp_path / "last.ckpt")  # and over a folder
    assert (tmp_path / "last.ckpt" / "meta.pt").read_text() == "5"
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=4.ckpt", "epoch=0-step=5.ckpt", "last.ckpt"]


def test_final_checkpoint_copy_on_resume_goes_through_the_staged_copy(tmp_path, monkeypatch):
    from rloo_lightning.callbacks import checkpoint as final

    calls = []
    monkeypatch.setattr(final, "atomic_copy", lambda s, t: calls.append((s, t)))
    final._atomic_copy("a.ckpt", "last.ckpt")
    assert calls == [("a.ckpt", "last.ckpt")]


# -- installing --------------------------------------------------------------------------------------------------
class OwnIO(TorchCheckpointIO):  # a user's plugin: a TorchCheckpointIO subclass of their own
    pass


@pytest.mark.parametrize("strategy", ["auto", "ddp", "ddp_spawn"])
def test_installed_on_lightnings_default_io_under_each_strategy(strategy):
    trainer = _trainer(strategy=strategy, devices=1 if strategy == "auto" else 2)
    assert install_atomic_checkpoint_io(trainer.strategy)
    io = trainer.strategy.checkpoint_io
    assert type(io) is AtomicCheckpointIO
    assert type(pickle.loads(pickle.dumps(io))) is AtomicCheckpointIO  # ddp_spawn pickles the strategy
    assert not install_atomic_checkpoint_io(trainer.strategy)  # once


def test_a_users_plugin_is_left_alone_and_async_gets_the_atomic_base():
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    own = OwnIO()
    trainer = _trainer(plugins=[own])
    assert not install_atomic_checkpoint_io(trainer.strategy)
    assert trainer.strategy.checkpoint_io is own
    trainer = _trainer(plugins=[AsyncCheckpointIO()])
    assert install_atomic_checkpoint_io(trainer.strategy)
    assert type(trainer.strategy.checkpoint_io.checkpoint_io) is AtomicCheckpointIO
    trainer = _trainer(plugins=[AsyncCheckpointIO(OwnIO())])
    assert not install_atomic_checkpoint_io(trainer.strategy)
    assert type(trainer.strategy.checkpoint_io.checkpoint_io) is OwnIO


def _cli_trainer(tiny_model_dir, monkeypatch, *extra):
    from rloo_lightning.cli import RLOOCLI
    from rloo_lightning.data import PromptDataModule
    from rloo_lightning.module import RLOOModule

    monkeypatch.setattr(RLOOCLI, "_subcommand_parsers", {}, raising=False)  # run=False: no subcommands
    args = ["--config", str(HERE.parents[1] / "configs" / "quickstart.yaml"), "--model.model_name_or_path",
            tiny_model_dir, "--model.validation.at_start", "false", *extra]
    return RLOOCLI(RLOOModule, PromptDataModule, run=False, args=args).trainer


def test_the_cli_trainer_has_the_atomic_io(tiny_model_dir, monkeypatch):
    assert type(_cli_trainer(tiny_model_dir, monkeypatch).strategy.checkpoint_io) is AtomicCheckpointIO
    ddp = _cli_trainer(tiny_model_dir, monkeypatch, "--trainer.strategy", "ddp_spawn", "--trainer.devices", "2")
    assert type(ddp.strategy.checkpoint_io) is AtomicCheckpointIO
    own = _cli_trainer(tiny_model_dir, monkeypatch, "--trainer.plugins", "test_runtime_atomic_checkpoint.OwnIO")
    assert type(own.strategy.checkpoint_io) is OwnIO


# -- FinalCheckpoint under a strategy that saves folders ----------------------------------------------------------
def test_final_checkpoint_stages_a_folder_beside_last_ckpt_and_swaps_it_in(tmp_path, monkeypatch):
    """A sharded strategy writes a folder and bypasses the checkpoint IO: FinalCheckpoint saves it under a hidden
    name beside last.ckpt, then swaps it in. During each save the previous last.ckpt is whole."""
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from checkpoint_helpers import Boring

    from rloo_lightning.callbacks import FinalCheckpoint
    from rloo_lightning.callbacks import checkpoint as final

    seen = []

    class FolderStrategy(SingleDeviceStrategy):
        def save_checkpoint(self, checkpoint, filepath, storage_options=None):
            path = Path(filepath)
            last = path.parent / "last.ckpt"
            seen.append((path.name, torch.load(last / "meta.pt")["global_step"] if last.exists() else None))
            path.mkdir(parents=True)
            torch.save(checkpoint.pop("state_dict"), path / "__0_0.distcp")
            (path / ".metadata").write_bytes(b"dcp")
            torch.save(checkpoint, path / "meta.pt")

    monkeypatch.setattr(final, "saves_a_folder", lambda strategy: isinstance(strategy, FolderStrategy))
    trainer = _trainer(strategy=FolderStrategy(device=torch.device("cpu")), max_steps=3, callbacks=[
        FinalCheckpoint(every_n_steps=1)], default_root_dir=tmp_path, **NO_VALIDATION)
    trainer.fit(Boring())
    folder = tmp_path / "checkpoints"
    assert os.listdir(folder) == ["last.ckpt"]
    assert torch.load(folder / "last.ckpt" / "meta.pt")["global_step"] == 3
    check_checkpoint_path(folder / "last.ckpt")
    assert [before for _, before in seen] == [None, 1, 2]  # the previous one whole while the next is written
    assert all(re.fullmatch(r"\.last\.ckpt\.tmp-\d+@.+-[0-9a-f]{8}", name) for name, _ in seen), seen


# -- killed mid-save (subprocesses) -------------------------------------------------------------------------------
def _writer(dest: str, mode: str) -> None:
    """The process the kill tests interrupt: saves the NEW 200 MB checkpoint over ``dest``, then says so."""
    if mode == "named":
        atomic_checkpoint._USE_TMPFILE = False
    new = _ckpt(1, TENSORS, NUMEL)
    print("writing", flush=True)
    if mode == "lightning":
        TorchCheckpointIO().save_checkpoint(new, dest)
    else:
        AtomicCheckpointIO().save_checkpoint(new, dest)
    print("done", flush=True)


def _temp_in_progress(pid: int, folder: Path, dest: Path, mode: str, full: int) -> int:
    """Bytes written so far by the save in progress (0: none seen yet)."""
    if mode == "lightning":  # its cross-filesystem move rewrites the destination in place
        try:
            size = dest.stat().st_size
        except FileNotFoundError:
            return 0
        return size if size < full else 0
    sizes = [p.stat().st_size for p in folder.glob(".last.ckpt.tmp-*") if p.is_file()]
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):  # an O_TMPFILE file: "<folder>/#<inode> (deleted)"
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith(f"{folder}/#"):
                sizes.append(os.stat(f"/proc/{pid}/fd/{fd}").st_size)
    except OSError:
        pass
    return max(sizes, default=0)


def _kill_mid_save(tmp_path: Path, mode: str, tmpdir: Path) -> tuple[Path, bool, subprocess.Popen]:
    """Start the writer over an old checkpoint, SIGKILL it once its temporary file holds 10% of the new one.
    Returns the destination and whether the kill came before the writer was done."""
    folder = tmp_path / "ckpt"
    folder.mkdir(parents=True, exist_ok=True)
    dest = folder / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(_ckpt(0, TENSORS, NUMEL), dest)  # the OLD checkpoint
    full = dest.stat().st_size
    helpers = str(HERE.parent / "helpers")  # this module's imports
    env = dict(os.environ, TMPDIR=str(tmpdir), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in [helpers, os.environ.get("PYTHONPATH", "")] if p))
    out = open(tmp_path / f"{mode}.out", "w+")
    proc = subprocess.Popen([sys.executable, str(HERE), "writer", str(dest), mode], stdout=out, stderr=out, env=env)
    deadline = time.monotonic() + 120
    written = 0
    while proc.poll() is None and time.monotonic() < deadline:
        written = _temp_in_progress(proc.pid, folder, dest, mode, full)
        if written > full // 10:
            break
        time.sleep(0.0005)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    out.seek(0)
    log = out.read()
    out.close()
    assert "writing" in log, log
    print(f"\n{mode}: killed with {written} of {full} bytes written; finished first: {'done' in log}")
    return dest, "done" not in log, proc


@pytest.fixture
def kill_tmpdir(tmp_path):
    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path / "tmpdir"
    base.mkdir(exist_ok=True)
    yield base
    for p in base.iterdir():
        p.unlink()
    if str(base).startswith("/dev/shm/"):
        base.rmdir()


@pytest.mark.slow  # subprocesses writing 200 MB
@pytest.mark.parametrize("mode", ["tmpfile", "named"])
def test_sigkill_mid_save_leaves_the_old_checkpoint_whole(tmp_path, mode, kill_tmpdir):
    for attempt in range(3):  # a kill that came after the save finished tests nothing: again
        run = tmp_path / f"run{attempt}"
        dest, mid_save, proc = _kill_mid_save(run, mode, kill_tmpdir)
        if mid_save:
            break
    assert mid_save, "the writer always finished before the kill"
    assert proc.returncode == -signal.SIGKILL
    check_checkpoint_path(dest)
    assert _same(_load(dest), _ckpt(0, TENSORS, NUMEL))  # the old one, whole
    assert _visible(dest.parent) == {"last.ckpt"}  # nothing a glob for checkpoints would find
    leftovers = sorted(p.name for p in dest.parent.iterdir() if p.name != "last.ckpt")
    if mode == "named":  # the hidden temporary file of the killed save ...
        assert len(leftovers) == 1 and re.fullmatch(rf"\.last\.ckpt\.tmp-{proc.pid}@.+-[0-9a-f]{{8}}", leftovers[0])
    else:  # an anonymous file has no name: nothing is left
        assert leftovers == []
    assert not list(kill_tmpdir.iterdir())  # $TMPDIR (another filesystem) never used
    AtomicCheckpointIO().save_checkpoint(_ckpt(2), dest.parent / "epoch=0-step=2.ckpt")
    assert sorted(os.listdir(dest.parent)) == ["epoch=0-step=2.ckpt", "last.ckpt"]  # ... gone at the next save


@pytest.mark.slow  # subprocesses writing 200 MB
def test_control_lightnings_own_save_killed_mid_move_leaves_a_truncated_file(tmp_path, kill_tmpdir):
    """The same kill of Lightning's ``TorchCheckpointIO`` with ``$TMPDIR`` on another filesystem: its move is a
    copy into the destination, and the destination is left truncated (the kill lands mid-write)."""
    if os.stat(kill_tmpdir).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem for $TMPDIR (/dev/shm)")
    for attempt in range(3):
        dest, mid_save, _ = _kill_mid_save(tmp_path / f"run{attempt}", "lightning", kill_tmpdir)
        if mid_save:
            break
    assert mid_save, "the writer always finished before the kill"
    with pytest.raises(ValueError, match=re.escape(f"--ckpt_path {dest}: truncated")):
        check_checkpoint_path(dest)
    with pytest.raises(RuntimeError, match="failed finding central directory"):
        torch.load(dest, weights_only=True)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "writer":
    _writer(sys.argv[2], sys.argv[3])
