"""What a user sees from ``rloo-lightning``: no adverts or false warnings, a step bar, errors as one line.

Fast tests check the pieces in process (the log filter, the warning filter, the error line, the bar's
count and metrics, the trainer's progress bar, the stateful training loader); the slow ones run the
real command in subprocesses (the harness in ``cli_harness``).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel

from cli_harness import CONFIGS, make_env, run_cli, start_cli, wait_all
from rloo_lightning.callbacks import StepProgressBar
from rloo_lightning.cli import RLOOCLI, TRACEBACK_ENV, _quiet_third_party, main
from rloo_lightning.cli_errors import error_line

QUICKSTART = str(CONFIGS / "quickstart.yaml")
TIP_LOGGER = "💡 Tip: For seamless cloud logging and experiment tracking, try installing litlogger"
TIP_MODELS = "💡 Tip: For seamless cloud uploads and versioning, try installing litmodels"
PYTREE = "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and treespec.is_leaf()`"
NOT_RESUMABLE = "not resumable"
FINAL = "--trainer.callbacks+=rloo_lightning.callbacks.checkpoint.FinalCheckpoint"


# --- noise filters -------------------------------------------------------------------------------------------


def test_the_two_lightning_tips_are_dropped_and_other_info_passes(caplog):
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    _quiet_third_party()
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        rank_zero_info(TIP_LOGGER)
        rank_zero_info(TIP_MODELS)
        rank_zero_info("💡 Tip: something else")
        rank_zero_info("GPU available: False, used: False")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["💡 Tip: something else", "GPU available: False, used: False"], messages


def test_torchaos_missing_gpu_kernels_and_enum_notes_are_dropped(caplog):
    """transformers imports torchao (the int8 extra) at every model load: its CPU-machine noise is dropped."""
    _quiet_third_party()
    with caplog.at_level(logging.INFO):
        logging.getLogger("torchao").warning("Failed to load /x/_C_cutlass_90a.abi3.so: Could not load this library")
        logging.getLogger("torchao").warning("a real torchao warning")
        logging.getLogger("torch.utils._pytree").warning(
            "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile")
    assert [r.getMessage() for r in caplog.records] == ["a real torchao warning"]


def test_only_the_pytree_deprecation_warning_is_silenced():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _quiet_third_party()
        warnings.warn(PYTREE, FutureWarning, stacklevel=1)
        warnings.warn("some other deprecation", FutureWarning, stacklevel=1)
        warnings.warn("a user warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["some other deprecation", "a user warning"]


def test_transformers_weight_loading_bar_is_off_after_quieting():
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    try:
        _quiet_third_party()
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        if was:
            hf_logging.enable_progress_bar()


def test_an_evaluation_from_a_fits_checkpoint_logs_beside_that_run(tmp_path):
    """validate / test / predict of ``<run>/checkpoints/x.ckpt`` log in ``<run>/<command>/version_N``; a checkpoint
    kept elsewhere, or none on this machine, leaves Lightning's default (the working folder)."""
    from rloo_lightning.cli import _logger_beside_checkpoint

    run = tmp_path / "lightning_logs" / "version_0"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    (run / "test" / "version_0").mkdir(parents=True)  # an earlier test of this run
    logger = _logger_beside_checkpoint(str(run / "checkpoints" / "last.ckpt"), "test")
    assert Path(logger.log_dir) == run / "test" / "version_1"
    assert Path(_logger_beside_checkpoint(str(run / "checkpoints" / "last.ckpt"), "predict").log_dir) == (
        run / "predict" / "version_0")
    (tmp_path / "kept.ckpt").write_bytes(b"")
    assert _logger_beside_checkpoint(str(tmp_path / "kept.ckpt"), "test") is None
    assert _logger_beside_checkpoint("last", "test") is None and _logger_beside_checkpoint(None, "test") is None


# --- the error line ------------------------------------------------------------------------------------------


def _raised(make):
    try:
        make()
    except Exception as exc:  # noqa: BLE001
        return exc
    raise AssertionError("nothing raised")


def test_error_line_says_the_message_of_a_plain_error():
    assert error_line(ValueError("kl.beta must be >= 0, got -1.0")) == "error: kl.beta must be >= 0, got -1.0"
    assert error_line(FileNotFoundError("data file 'x.jsonl' does not exist")) == \
        "error: data file 'x.jsonl' does not exist"


def test_error_line_names_other_exception_types():
    from rloo_lightning.update import NonFiniteError

    assert error_line(NonFiniteError("non-finite loss at step 3")) == "error: NonFiniteError: non-finite loss at step 3"
    assert error_line(KeyError("x")) == "error: KeyError: 'x'"
    assert error_line(RuntimeError()) == "error: RuntimeError"


def test_error_line_looks_through_parser_wrappers_to_the_real_problem():
    from argparse import ArgumentError  # what jsonargparse raises (exit_on_error=False)

    def wrapped():
        try:
            raise ValueError("kl.beta must be >= 0, got -1.0")
        except ValueError as inner:
            raise ArgumentError(None, "Problem with given class_path 'rloo_lightning.RLOOModule'") from inner

    def implicit():  # raised while handling, no `from`; an empty outer message says nothing
        try:
            raise ImportError("No module named 'myreward'")
        except ImportError:
            raise RuntimeError()  # noqa: B904

    assert error_line(_raised(wrapped)) == "error: kl.beta must be >= 0, got -1.0"
    assert error_line(_raised(implicit)) == "error: No module named 'myreward'"


def test_error_line_keeps_an_outer_message_that_adds_context():
    def outer():
        try:
            raise ImportError("No module named 'myreward'")
        except ImportError as inner:
            raise ValueError("reward 'myreward.score' cannot be imported") from inner

    assert error_line(_raised(outer)) == "error: reward 'myreward.score' cannot be imported"


def test_main_prints_a_parse_error_as_one_line_without_the_usage(capsys, monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", QUICKSTART, "--model.sampling.kk", "3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: unknown option --model.sampling.kk; did you mean --model.sampling.k?"], err
    assert "usage:" not in err and "--help" in err, err


def test_main_prints_an_instantiation_error_as_one_line(capsys, monkeypatch, tiny_model_dir):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    args = ["fit", "--config", QUICKSTART, "--model.model_name_or_path", tiny_model_dir, "--model.kl.beta", "-1"]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines == ["error: kl.beta must be >= 0, got -1.0"], err
    assert "Traceback" not in err and f"{TRACEBACK_ENV}=1" in err, err
    # with RLOO_TRACEBACK=1 the exception itself propagates (and Python prints its traceback)
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(ValueError, match="kl.beta must be >= 0"):
        main(args)


# --- the progress bar ----------------------------------------------------------------------------------------


def _fake_trainer(max_steps=400, global_step=0, metrics=None, batches=50):
    return SimpleNamespace(max_steps=max_steps, global_step=global_step, callback_metrics=metrics or {},
                           num_training_batches=batches, max_epochs=1, loggers=[object()])


def test_bar_counts_optimizer_steps_up_to_max_steps():
    bar = StepProgressBar()
    trainer = _fake_trainer(max_steps=400, global_step=40)
    assert bar.counts_steps(trainer)
    assert bar.training_total(trainer) == 400
    assert bar.training_position(trainer, batch_idx=79) == 40  # 80 batches, accumulate 2: 40 steps


def test_bar_without_max_steps_counts_the_epochs_batches():
    bar = StepProgressBar()
    trainer = _fake_trainer(max_steps=-1, global_step=40, batches=50)
    bar._trainer = trainer  # total_train_batches reads trainer.num_training_batches
    assert not bar.counts_steps(trainer)
    assert bar.training_total(trainer) == 50
    assert bar.training_position(trainer, batch_idx=9) == 10


def test_bar_shows_the_chosen_metrics_only_and_no_v_num():
    metrics = {"train/reward": torch.tensor(0.4123), "train/kl": torch.tensor(0.03), "train/loss": torch.tensor(1.0),
               "val/reward": torch.tensor(0.39), "train/completion_length": torch.tensor(7.0)}
    items = StepProgressBar().get_metrics(_fake_trainer(metrics=metrics), None)
    assert items == pytest.approx({"reward": 0.4123, "kl": 0.03, "val_reward": 0.39})
    assert "v_num" not in items
    chosen = StepProgressBar(metrics=["train/loss"]).get_metrics(_fake_trainer(metrics=metrics), None)
    assert chosen == {"train/loss": 1.0}
    assert StepProgressBar().get_metrics(_fake_trainer(metrics={}), None) == {}  # nothing logged yet


class _LoggingBoring(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train/reward", 0.5)
        return out


@pytest.mark.parametrize("accumulate", [1, 2])
def test_bar_in_a_real_fit_ends_at_max_steps_under_accumulation(tmp_path, accumulate):
    bar = StepProgressBar(plain=False)  # the terminal's tqdm bar (pytest's stdout is none: plain lines by default)
    trainer = Trainer(accelerator="cpu", max_steps=3, accumulate_grad_batches=accumulate, limit_val_batches=0,
                      logger=False, enable_checkpointing=False, enable_model_summary=False, callbacks=[bar],
                      default_root_dir=str(tmp_path))
    trainer.fit(_LoggingBoring())
    assert trainer.global_step == 3
    tqdm = bar.train_progress_bar
    assert (tqdm.n, tqdm.total) == (3, 3)
    assert tqdm.postfix == "reward=0.500", tqdm.postfix
    assert "3/3" in str(tqdm) and "step/s" in str(tqdm) and "v_num" not in str(tqdm), str(tqdm)


def _cli_trainer(tiny_model_dir, *extra):
    cli = RLOOCLI(*_cli_classes(), run=False, args=["--config", QUICKSTART, "--model.model_name_or_path",
                                                    tiny_model_dir, "--model.validation.at_start", "false", *extra])
    return cli.trainer


def _cli_classes():
    from rloo_lightning.data import PromptDataModule
    from rloo_lightning.module import RLOOModule

    return RLOOModule, PromptDataModule


def test_cli_puts_the_step_bar_in_place_of_lightnings_default_only(tiny_model_dir, monkeypatch):
    # run=False (no subcommands): RLOOCLI.parse_arguments looks for subcommand parsers, which this mode has none of
    monkeypatch.setattr(RLOOCLI, "_subcommand_parsers", {}, raising=False)
    bars = lambda t: [type(c) for c in t.callbacks if isinstance(c, (TQDMProgressBar, RichProgressBar))]  # noqa: E731
    assert bars(_cli_trainer(tiny_model_dir)) == [StepProgressBar]
    assert bars(_cli_trainer(tiny_model_dir, "--trainer.enable_progress_bar", "false")) == []
    own = ["--trainer.callbacks+=lightning.pytorch.callbacks.RichProgressBar"]
    assert bars(_cli_trainer(tiny_model_dir, *own)) == [RichProgressBar]


# --- the resumable loader ------------------------------------------------------------------------------------


def test_train_loader_is_stateful_in_lightnings_sense_and_its_state_changes_nothing(tiny_model_dir):
    from lightning.fabric.utilities.types import _Stateful

    from rloo_lightning.data import PromptDataModule

    data = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="reverse", batch_size=4, num_train_rows=16,
                            num_val_rows=4, max_new_tokens=8)
    data.setup("fit")
    data.trainer = SimpleNamespace(world_size=1, global_rank=0, global_step=3, accumulate_grad_batches=1)
    loader = data.train_dataloader()
    assert isinstance(loader, _Stateful)
    before = [b["input_ids"].tolist() for b in loader]
    assert loader.state_dict() == {"consumed_batches": 3}
    loader.load_state_dict({"consumed_batches": 0})  # the sampler's position stays the source of truth
    assert [b["input_ids"].tolist() for b in loader] == before
    assert len(before) == 1  # 4 batches an epoch, 3 consumed: the last one


# --- the real command (subprocesses) -------------------------------------------------------------------------


def _fit_args(root: Path, model_dir: str, max_steps: int = 3, *extra) -> list:
    return ["fit", "--config", QUICKSTART, "--model.model_name_or_path", model_dir, "--trainer.max_steps", max_steps,
            "--trainer.val_check_interval", 3, "--trainer.default_root_dir", root, "--data.num_val_rows", 8,
            "--data.num_train_rows", 16, "--data.batch_size", 4, *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, _cache_dir):
    env, tb_env = make_env(_cache_dir, RLOO_TRACEBACK=None), make_env(_cache_dir, RLOO_TRACEBACK="1")
    root = tmp_path_factory.mktemp("cli_output")
    beta = _fit_args(root / "beta", tiny_model_dir, 3, "--model.kl.beta", "-1")
    missing = _fit_args(root / "missing", tiny_model_dir, 3, "--data.task", "null", "--data.train_file",
                        "no_such_file.jsonl")
    procs = {
        "fit": start_cli("fit", _fit_args(root / "fit", tiny_model_dir, 3, FINAL), root / "fit", env),
        "beta": start_cli("beta", beta, root / "beta", env),
        "beta_tb": start_cli("beta_tb", beta, root / "beta_tb", tb_env),
        "missing": start_cli("missing", missing, root / "missing", env),
    }
    wait_all(*procs.values())
    return procs


@pytest.mark.slow
def test_cli_fit_output_has_no_adverts_or_warnings_and_a_step_bar(runs):
    run = runs["fit"].check()
    text = run.log
    assert "💡 Tip" not in text and "litlogger" not in text and "litmodels" not in text, text
    assert "LeafSpec" not in text and "Loading weights" not in text, text
    assert "Failed to load" not in text and "Enum subclass" not in text, text  # torchao, imported by transformers
    assert "v_num" not in text and "Epoch 0/" not in text, text
    # stdout is a file: the step bar is plain lines (tests/test_runtime_console.py), the last one at max_steps
    last = [line for line in run.stdout.splitlines() if line.startswith("train step ")][-1]
    assert last.startswith("train step 3/3 | ") and " | done in " in last, last
    assert "| reward " in last and "| kl " in last and "| val_reward " in last, last


@pytest.mark.slow
@pytest.mark.parametrize("name, line", [("beta", "error: kl.beta must be >= 0, got -1.0"),
                                        ("missing", "error: data file 'no_such_file.jsonl' does not exist")])
def test_cli_error_is_one_line_without_a_traceback(runs, name, line):
    run = runs[name].wait()
    assert run.rc == 1, run.explain()
    errors = [x for x in run.stderr.splitlines() if x.startswith("error:")]
    assert errors == [line], run.explain()
    assert "Traceback" not in run.log and f"{TRACEBACK_ENV}=1" in run.stderr, run.explain()


@pytest.mark.slow
def test_cli_error_with_rloo_traceback_shows_the_traceback(runs):
    run = runs["beta_tb"].wait()
    assert run.rc not in (0, None), run.explain()
    assert "Traceback (most recent call last)" in run.stderr, run.explain()
    assert "ValueError: kl.beta must be >= 0, got -1.0" in run.stderr, run.explain()


@pytest.mark.slow
def test_cli_mid_epoch_resume_gives_no_not_resumable_warning(runs, tiny_model_dir, _cache_dir):
    root = runs["fit"].check().cwd  # 3 steps of 4 batches an epoch: last.ckpt is mid-epoch
    last = root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    state = torch.load(last, map_location="cpu", weights_only=False)
    assert state["global_step"] == 3
    assert state["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"consumed_batches": 3}]
    resumed = run_cli("resumed", _fit_args(root, tiny_model_dir, 5, FINAL, "--ckpt_path", last), root,
                      make_env(_cache_dir))
    assert NOT_RESUMABLE not in resumed.log, resumed.explain()
    # a new version folder: said in one line of its own, not by Lightning's "dirpath has changed" warning
    assert "dirpath has changed" not in resumed.log, resumed.explain()
    end = root / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt"
    said = [line for line in resumed.stderr.splitlines() if line.startswith("resuming from ")]
    assert said == [f"resuming from {last}: this run's checkpoints go to a new folder, {end.parent}"], resumed.explain()
    assert torch.load(end, map_location="cpu", weights_only=False)["global_step"] == 5
