"""FinalCheckpoint: last.ckpt at the end of fit (and every N steps), never stale or versioned after a resume.

In-process with a small Lightning module (fast), then through the real CLI (slow, subprocesses).
"""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from checkpoint_helpers import Boring, _assert_same_checkpoint
from cli_harness import CONFIGS, make_env, run_cli, start_cli, wait_all
from rloo_lightning.callbacks import FinalCheckpoint


def _trainer(root: Path, max_steps: int, callbacks: list, **kwargs) -> Trainer:
    # as the quickstart: validation by steps (check_val_every_n_epoch=None), here turned off
    kwargs = {"limit_val_batches": 0, "check_val_every_n_epoch": None, "val_check_interval": 100, "logger": False,
              **kwargs}
    return Trainer(default_root_dir=root, max_steps=max_steps, callbacks=callbacks, accelerator="cpu",
                   enable_progress_bar=False, enable_model_summary=False, **kwargs)


def _step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False)["global_step"]


def _listing(folder: Path) -> dict[str, int]:
    return {p.name: _step(p) for p in sorted(folder.glob("*.ckpt"))}


def _record_saves(monkeypatch) -> list[int]:
    """The global steps at which FinalCheckpoint itself writes last.ckpt."""
    saved: list[int] = []
    original = FinalCheckpoint._save

    def spy(self, trainer):
        saved.append(trainer.global_step)
        original(self, trainer)

    monkeypatch.setattr(FinalCheckpoint, "_save", spy)
    return saved


def test_without_it_a_fit_with_validation_off_leaves_no_checkpoint(tmp_path):
    """The gap it closes: Lightning's default ModelCheckpoint saves after a validation (or at an epoch's end,
    but not when validation is by steps, ``check_val_every_n_epoch=None``, as in the quickstart)."""
    _trainer(tmp_path, 3, []).fit(Boring())
    assert not list(tmp_path.rglob("*.ckpt"))


def test_last_ckpt_at_the_end_of_fit_with_validation_off(tmp_path):
    _trainer(tmp_path, 3, [FinalCheckpoint()]).fit(Boring())
    assert _listing(tmp_path / "checkpoints") == {"last.ckpt": 3}


def test_last_ckpt_goes_to_the_logger_checkpoints_folder(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    _trainer(tmp_path, 2, [FinalCheckpoint()], logger=CSVLogger(tmp_path, name="logs")).fit(Boring())
    assert _listing(tmp_path / "logs" / "version_0" / "checkpoints") == {"last.ckpt": 2}


def test_nothing_without_checkpointing_or_steps(tmp_path):
    _trainer(tmp_path / "off", 3, [FinalCheckpoint(every_n_steps=1)], enable_checkpointing=False).fit(Boring())
    _trainer(tmp_path / "zero", 0, [FinalCheckpoint()]).fit(Boring())
    assert not list(tmp_path.rglob("*.ckpt"))
    with pytest.raises(ValueError, match="every_n_steps"):
        FinalCheckpoint(every_n_steps=-1)


def test_every_n_steps_and_the_end(tmp_path, monkeypatch):
    saved = _record_saves(monkeypatch)
    _trainer(tmp_path, 5, [FinalCheckpoint(every_n_steps=2)]).fit(Boring())
    assert saved == [2, 4, 5]
    assert _listing(tmp_path / "checkpoints") == {"last.ckpt": 5}


def test_user_model_checkpoint_keeps_its_files_and_is_not_duplicated(tmp_path, monkeypatch):
    saved = _record_saves(monkeypatch)
    # a ModelCheckpoint of the user's, in a folder of its own: its files are all there, last.ckpt beside them
    user = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1)
    _trainer(tmp_path, 5, [FinalCheckpoint(), user]).fit(Boring())
    assert _listing(tmp_path / "ck") == {"epoch=0-step=2.ckpt": 2, "epoch=0-step=4.ckpt": 4, "last.ckpt": 5}
    assert saved == [5]
    # save_last=True that has just written last.ckpt of the final step: nothing more to write
    saved.clear()
    user = ModelCheckpoint(dirpath=tmp_path / "ck2", every_n_train_steps=1, save_top_k=-1, save_last=True)
    _trainer(tmp_path, 3, [FinalCheckpoint(), user]).fit(Boring())
    assert saved == []
    assert _listing(tmp_path / "ck2")["last.ckpt"] == 3
    assert len(_listing(tmp_path / "ck2")) == 4


def _state(path: Path) -> tuple[dict, dict]:
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    return ckpt["state_dict"], ckpt["optimizer_states"][0]["state"]


def _assert_same(a: Path, b: Path) -> None:
    (wa, oa), (wb, ob) = _state(a), _state(b)
    assert wa.keys() == wb.keys() and oa.keys() == ob.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0)
    for k in oa:
        torch.testing.assert_close(oa[k]["momentum_buffer"], ob[k]["momentum_buffer"], rtol=0, atol=0)


@pytest.mark.parametrize("every_n_steps", [0, 2])
def test_resume_from_last_ckpt_is_exact(tmp_path, every_n_steps):
    """3 steps, then from last.ckpt (the end-of-fit one, or the periodic one at step 2) to 5: as 5 in one go."""
    _trainer(tmp_path / "a", 5, [FinalCheckpoint()]).fit(Boring())
    _trainer(tmp_path / "b", 3, [FinalCheckpoint(every_n_steps)]).fit(Boring())
    last = tmp_path / "b" / "checkpoints" / "last.ckpt"
    assert _step(last) == 3
    if every_n_steps:  # stop at the periodic save instead: a kill after step 2
        _trainer(tmp_path / "b2", 2, [FinalCheckpoint(every_n_steps)]).fit(Boring())
        last = tmp_path / "b2" / "checkpoints" / "last.ckpt"
        assert _step(last) == 2
    _trainer(tmp_path / "b", 5, [FinalCheckpoint(every_n_steps)]).fit(Boring(), ckpt_path=last)
    assert _step(tmp_path / "b" / "checkpoints" / "last.ckpt") == 5
    _assert_same(tmp_path / "b" / "checkpoints" / "last.ckpt", tmp_path / "a" / "checkpoints" / "last.ckpt")


def _every_step(folder: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1, save_last=True)


def test_lightning_alone_versions_last_after_resuming_from_an_early_checkpoint(tmp_path):
    """The cause of the versioned/stale last.ckpt: a checkpoint written before the run's first last.ckpt
    restores ``last_model_path == ""``; ModelCheckpoint then finds last.ckpt on disk and writes last-v1.ckpt."""
    ck = tmp_path / "ck"
    _trainer(tmp_path, 3, [_every_step(ck)]).fit(Boring())
    _trainer(tmp_path, 5, [_every_step(ck)]).fit(Boring(), ckpt_path=ck / "epoch=0-step=1.ckpt")
    listing = _listing(ck)
    assert listing["last.ckpt"] == 3 and listing["last-v1.ckpt"] == 5  # last.ckpt left stale


def test_with_it_last_ckpt_stays_the_newest_after_resuming_from_an_early_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    _trainer(tmp_path, 3, [FinalCheckpoint(), _every_step(ck)]).fit(Boring())
    _trainer(tmp_path, 5, [FinalCheckpoint(), _every_step(ck)]).fit(Boring(), ckpt_path=ck / "epoch=0-step=1.ckpt")
    listing = _listing(ck)
    # steps 2 and 3 were taken again: ModelCheckpoint versions their files (epoch=0-step=2-v1.ckpt), not last.ckpt
    assert not [name for name in listing if name.startswith("last-")], listing
    assert listing["last.ckpt"] == 5 == max(listing.values()), listing


class _LastAtFirstStep(Callback):
    """Records last.ckpt's step and bytes when the first step of the (resumed) run starts."""

    def __init__(self, folder: Path, source: Path) -> None:
        self.folder, self.source, self.seen = folder, source, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.seen is None:
            last = self.folder / "last.ckpt"
            self.seen = (_step(last), filecmp.cmp(last, self.source, shallow=False))


def test_resuming_from_a_step_file_brings_last_ckpt_up_to_it_before_the_first_step(tmp_path):
    """A kill before the resumed run's first save must not leave last.ckpt two steps behind the step files:
    last.ckpt is the checkpoint resumed from (a byte copy) from the start of the resumed run on."""
    ck = tmp_path / "ck"
    _trainer(tmp_path, 4, [FinalCheckpoint(), _every_step(ck)]).fit(Boring())
    (ck / "last.ckpt").unlink()  # as if killed between step 4's file and its last.ckpt ...
    (ck / "epoch=0-step=3.ckpt").rename(ck / "last.ckpt")  # ... with last.ckpt one step behind
    start = ck / "epoch=0-step=4.ckpt"
    probe = _LastAtFirstStep(ck, start)
    _trainer(tmp_path, 6, [FinalCheckpoint(), _every_step(ck), probe]).fit(Boring(), ckpt_path=start)
    assert probe.seen == (4, True)
    assert _listing(ck)["last.ckpt"] == 6


def test_resumed_at_max_steps_from_a_step_file_still_brings_last_ckpt_up(tmp_path):
    """The fit loop is skipped (nothing to train): last.ckpt still becomes the checkpoint resumed from."""
    ck = tmp_path / "ck"
    _trainer(tmp_path, 3, [_every_step(ck)]).fit(Boring())
    (ck / "last.ckpt").unlink()
    (ck / "epoch=0-step=2.ckpt").rename(ck / "last.ckpt")
    _trainer(tmp_path, 3, [FinalCheckpoint(), _every_step(ck)]).fit(Boring(), ckpt_path=ck / "epoch=0-step=3.ckpt")
    assert filecmp.cmp(ck / "last.ckpt", ck / "epoch=0-step=3.ckpt", shallow=False)


def test_resuming_from_another_folder_copies_nothing(tmp_path, monkeypatch):
    _trainer(tmp_path / "a", 2, [FinalCheckpoint()]).fit(Boring())
    saved = _record_saves(monkeypatch)
    probe = _LastAtFirstStep(tmp_path / "b" / "checkpoints", tmp_path / "a" / "checkpoints" / "last.ckpt")
    probe.on_train_batch_start = lambda *a, **k: probe.__setattr__(
        "seen", sorted(p.name for p in (tmp_path / "b").rglob("*.ckpt")))
    _trainer(tmp_path / "b", 3, [FinalCheckpoint(), probe]).fit(
        Boring(), ckpt_path=tmp_path / "a" / "checkpoints" / "last.ckpt")
    assert probe.seen == []  # no copy of the other folder's checkpoint
    assert saved == [3] and _listing(tmp_path / "b" / "checkpoints") == {"last.ckpt": 3}


# -- through the real CLI ----------------------------------------------------------------------------------------
FINAL = "--trainer.callbacks+=rloo_lightning.callbacks.checkpoint.FinalCheckpoint"


def _cli_args(root: Path, model_dir: str, max_steps: int, *extra: str) -> list[str]:
    """The quickstart, a small tiny model, validation off: 4 steps per epoch."""
    return ["fit", "--config", CONFIGS / "quickstart.yaml", "--model.model_name_or_path", model_dir,
            "--trainer.max_steps", max_steps, "--trainer.limit_val_batches", "0",
            "--trainer.default_root_dir", root, "--trainer.enable_progress_bar", "false",
            "--data.num_train_rows", "16", "--data.num_val_rows", "8", "--data.batch_size", "4", FINAL, *extra]


SIGTERM_AT_3 = ["--trainer.callbacks+=reliability_helpers.callbacks.SigtermAt", "--trainer.callbacks.step=3"]


@pytest.mark.slow
def test_cli_validation_off_or_sigterm_leaves_last_ckpt_and_its_resume_is_exact(tmp_path, tiny_model_dir,
                                                                               _cache_dir):
    """Run a (validation off) leaves last.ckpt of its final step 5. Run c, preempted by SIGTERM after step 3 of
    5, exits 143 and leaves last.ckpt of step 3; resumed to step 5 it ends where run a does."""
    env = make_env(_cache_dir)
    a, c = tmp_path / "a", tmp_path / "c"
    procs = [start_cli("a", _cli_args(a, tiny_model_dir, 5), a, env),
             start_cli("c1", _cli_args(c, tiny_model_dir, 5, *SIGTERM_AT_3), c, env)]
    wait_all(*procs)
    procs[0].check()
    assert procs[1].rc == 143, procs[1].explain()  # not 0: the scheduler sees the run did not finish
    last = c / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert _listing(last.parent) == {"last.ckpt": 3}
    assert f"stopped by SIGTERM after step 3; {last} holds that step: resume with --ckpt_path" in procs[1].log
    run_cli("c2", _cli_args(c, tiny_model_dir, 5, "--ckpt_path", last), c, env)
    end = c / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt"
    ref = a / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert _step(end) == _step(ref) == 5
    _assert_same_checkpoint(end, ref)


@pytest.mark.slow
def test_cli_callbacks_config_keeps_its_model_checkpoint_files(tmp_path, tiny_model_dir, _cache_dir):
    """configs/callbacks.yaml's ModelCheckpoint (top 2 by val/reward, save_last) still writes its files."""
    root = tmp_path / "run"
    args = ["fit", "--config", CONFIGS / "quickstart.yaml", "--config", CONFIGS / "callbacks.yaml",
            "--model.model_name_or_path", tiny_model_dir, "--trainer.max_steps", "5",
            "--trainer.val_check_interval", "2", "--trainer.default_root_dir", root,
            "--trainer.enable_progress_bar", "false", "--data.num_train_rows", "32", "--data.num_val_rows", "8",
            "--data.batch_size", "4", FINAL]
    run_cli("fit", args, root, make_env(_cache_dir))
    listing = _listing(root / "lightning_logs" / "version_0" / "checkpoints")
    steps = sorted(s for name, s in listing.items() if name != "last.ckpt")
    assert len(steps) == 2 and set(steps) <= {2, 4}, listing  # validation at steps 2 and 4: the top 2 of them
    assert listing["last.ckpt"] == 5, listing  # and the last step, which no validation followed


@pytest.mark.slow
def test_cli_ddp_resume_from_a_step_file_refreshes_last_ckpt_on_every_rank(tmp_path, tiny_model_dir, _cache_dir):
    """Under DDP (2 CPU ranks): the copy on resume is rank 0's and every rank meets the barrier (no hang);
    ModelCheckpoint(save_last) goes on writing last.ckpt, not last-v1.ckpt."""
    ck = tmp_path / "ck"
    every_step = ["--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                  f"--trainer.callbacks.dirpath={ck}", "--trainer.callbacks.every_n_train_steps=1",
                  "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.save_last=true"]
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--data.num_train_rows", "32", *every_step]
    env = make_env(_cache_dir)
    run_cli("first", _cli_args(tmp_path, tiny_model_dir, 3, *ddp), tmp_path, env, timeout=300)
    assert _listing(ck)["last.ckpt"] == 3
    start = ck / "epoch=0-step=2.ckpt"
    resumed = run_cli("resumed", _cli_args(tmp_path, tiny_model_dir, 4, *ddp, "--ckpt_path", start), tmp_path, env,
                      timeout=300)
    listing = _listing(ck)
    assert not [name for name in listing if name.startswith("last-")], listing
    assert listing["last.ckpt"] == 4 == max(listing.values()), (listing, resumed.explain())


# -- any failure keeps the last finished step; a periodic write bounds what a kill loses ---------------------------
@pytest.mark.parametrize("minutes,expected", [(1e-9, [1, 2, 3]), (60.0, [3])])
def test_every_minutes_writes_at_the_first_step_end_past_the_interval(tmp_path, monkeypatch, minutes, expected):
    saved = _record_saves(monkeypatch)
    _trainer(tmp_path, 3, [FinalCheckpoint(every_minutes=minutes)]).fit(Boring())
    assert saved == expected  # a tiny interval: every step's end; an hour: only the end of fit
    with pytest.raises(ValueError, match="every_minutes"):
        FinalCheckpoint(every_minutes=-1)


class _FailsAt(Boring):
    """Boring, whose training step raises at optimizer step ``at`` (as an engine, a reward or a stall does)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def training_step(self, batch, batch_idx):
        if self.global_step == self.at:
            raise RuntimeError("the server at http://127.0.0.1:1 is gone")
        return super().training_step(batch, batch_idx)


def test_a_failure_inside_a_step_keeps_the_step_before_and_its_resume_is_exact(tmp_path):
    from rloo_lightning.callbacks.checkpoint import FAILURE_CHECKPOINT

    _trainer(tmp_path / "a", 5, [FinalCheckpoint()]).fit(Boring())
    with pytest.raises(RuntimeError, match="is gone"):
        _trainer(tmp_path / "b", 5, [FinalCheckpoint()]).fit(_FailsAt(3))
    last = tmp_path / "b" / "checkpoints" / "last.ckpt"
    assert _step(last) == 3  # steps 1-3 finished; the 4th failed
    assert FAILURE_CHECKPOINT == {"path": str(last), "step": 3}
    _trainer(tmp_path / "b", 5, [FinalCheckpoint()]).fit(Boring(), ckpt_path=last)
    _assert_same(tmp_path / "b" / "checkpoints" / "last.ckpt", tmp_path / "a" / "checkpoints" / "last.ckpt")


def test_a_failure_in_the_first_step_writes_nothing(tmp_path):
    from rloo_lightning.callbacks.checkpoint import FAILURE_CHECKPOINT

    with pytest.raises(RuntimeError, match="is gone"):
        _trainer(tmp_path, 5, [FinalCheckpoint()]).fit(_FailsAt(0))
    assert not list(tmp_path.rglob("*.ckpt")) and FAILURE_CHECKPOINT == {}


@pytest.mark.slow
def test_cli_a_reward_error_keeps_the_last_finished_step_names_it_and_resumes_bit_identically(tmp_path,
                                                                                              tiny_model_dir,
                                                                                              _cache_dir):
    """A reward that raises (rewards.on_error: raise) in step 4: exit 1, the error line names the failure and
    last.ckpt of step 3; resumed, the run ends where an uninterrupted one does."""
    def env(name: str, at: int) -> dict:
        return make_env(_cache_dir, STOP_LOG=str(tmp_path / f"events-{name}"), FAIL_AT_CALL=str(at))

    common = ["--model.validation.at_start", "false", "--model.rewards.on_error", "raise",
              "--model.rewards.funcs", "[stop_helpers.reward_that_fails]"]
    a, c = tmp_path / "a", tmp_path / "c"
    procs = [start_cli("a", _cli_args(a, tiny_model_dir, 6, *common), a, env("a", -1)),
             start_cli("c", _cli_args(c, tiny_model_dir, 6, *common), c, env("c", 3))]
    wait_all(*procs)
    procs[0].check()
    last = c / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert procs[1].rc == 1, procs[1].explain()
    assert _step(last) == 3
    error = [line for line in procs[1].stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and "reward failed on call 3" in error[0], procs[1].explain()
    assert error[0].endswith(f"; {last} holds step 3: resume with --ckpt_path {last}"), procs[1].explain()
    resumed = _cli_args(c, tiny_model_dir, 6, *common, "--ckpt_path", last)
    wait_all(start_cli("c2", resumed, c, env("c2", -1)))
    _assert_same_checkpoint(c / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt",
                            a / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt")
