"""The console in a log file, in process (``rloo_lightning.callbacks.progress``, ``rloo_lightning.runtime.console``):
plain progress lines at a steady rate, warnings and errors on lines of their own, and a last line naming where the
run's files went.

The line bars are driven with a fake clock and a real (tiny) Lightning fit; ``test_runtime_console_runs.py`` runs
the command with its output in a file.
"""

from __future__ import annotations

import io
import re
import warnings
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel

from rloo_lightning.runtime import console
from rloo_lightning.callbacks.progress import (
    EvaluationProgress,
    LineBar,
    StepProgressBar,
    format_duration,
    format_rate,
    format_value,
)


SOURCE_PATH = re.compile(r"\.py:\d+:")


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _lines(stream: io.StringIO) -> list[str]:
    text = stream.getvalue()
    assert "\r" not in text and "\x1b" not in text, repr(text)
    assert text == "" or text.endswith("\n"), repr(text)
    return text.splitlines()


# --- the formats ---------------------------------------------------------------------------------------------


def test_durations_rates_and_values_are_short_and_readable():
    assert [format_duration(s) for s in (0, 0.44, 9.9, 12.4, 59.4, 60, 185, 3599, 3600, 7620, 90000)] == [
        "0.0s", "0.4s", "9.9s", "12s", "59s", "1m00s", "3m05s", "59m59s", "1h00m", "2h07m", "25h00m"]
    assert format_duration(float("inf")) == "?"
    assert [format_rate(s) for s in (0.07123, 3.1, 12.34, 125.4)] == ["0.0712", "3.1", "12.3", "125"]
    assert [format_value(v) for v in (0.41234, 1234.5, float("nan"), torch.tensor(0.5), 3, "x")] == [
        "0.4123", "1234", "nan", "0.5", "3", "x"]


def test_a_line_bar_writes_the_first_update_then_one_line_per_interval_then_the_end():
    clock, out = FakeClock(), io.StringIO()
    bar = LineBar("train", "step", interval=30, stream=out, clock=clock)
    bar.total = 400
    for step in range(1, 401):
        clock.now += 3.0  # 3 s a step: a line every 10 steps at most (30 s)
        bar.n = step
        bar.set_postfix({"reward": 0.25 + step / 1000, "kl": 0.031})
    bar.close()
    bar.close()  # once only
    lines = _lines(out)
    assert lines[0] == "train step 1/400 | 3 s/step | elapsed 3.0s | eta 19m57s | reward 0.251 | kl 0.031"
    assert lines[1] == "train step 11/400 | 3 s/step | elapsed 33s | eta 19m27s | reward 0.261 | kl 0.031"
    assert lines[-2].startswith("train step 391/400 | 3 s/step | elapsed 19m33s | eta 27s")
    assert lines[-1] == "train step 400/400 | 3 s/step | done in 20m00s | reward 0.65 | kl 0.031"
    assert len(lines) == 41  # 1, 11, ..., 391, and the end (400 is written by the last line only)
    assert len(set(lines)) == len(lines)


def test_a_line_bar_never_writes_a_position_twice_and_waits_for_progress():
    clock, out = FakeClock(), io.StringIO()
    bar = LineBar("validation (step 100)", interval=0, stream=out, clock=clock)
    bar.reset(total=3)
    bar.refresh()  # no batch done: nothing
    bar.update()
    bar.set_postfix({"x": 1})  # the same position: nothing new to say
    clock.now += 1
    bar.refresh()
    bar.update()
    bar.final_metrics = {"reward": 0.3}
    bar.update()  # the total: left to the last line
    bar.close()
    assert _lines(out) == [
        "validation (step 100) 1/3 batches | 0 s/batch | elapsed 0.0s | eta 0.0s",
        "validation (step 100) 2/3 batches | 0.5 s/batch | elapsed 1.0s | eta 0.5s | x 1",
        "validation (step 100) 3/3 batches | 0.333 s/batch | done in 1.0s | x 1 | reward 0.3",
    ]


def test_a_stage_that_ends_early_says_stopped_and_a_reset_ends_the_previous_loader():
    clock, out = FakeClock(), io.StringIO()
    bar = LineBar("train", "step", interval=1000, stream=out, clock=clock)
    bar.reset(total=400)
    bar.initial = bar.n = 40  # resumed at step 40: the rate counts this run's steps
    clock.now += 20
    bar.n = 50
    bar.refresh()
    clock.now += 10
    bar.n = 60
    bar.close()
    assert _lines(out) == ["train step 50/400 | 2 s/step | elapsed 20s | eta 11m40s",
                           "train step 60/400 | 1.5 s/step | stopped after 30s"]
    out.truncate(0), out.seek(0)
    test = LineBar("test", interval=1000, stream=out, clock=clock)
    test.reset(total=2)
    test.update(2)
    test.reset(total=5)  # the next dataloader: the first one's last line
    test.update()
    test.update()
    test.close()
    assert _lines(out) == ["test 2/2 batches | 0 s/batch | done in 0.0s",
                           "test 1/5 batches | 0 s/batch | elapsed 0.0s | eta 0.0s",
                           "test 2/5 batches | 0 s/batch | stopped after 0.0s"]


def test_a_disabled_or_abandoned_line_bar_writes_nothing_and_an_epoch_names_itself():
    out = io.StringIO()
    quiet = LineBar("train", interval=0, disable=True, stream=out)
    quiet.update(3)
    quiet.close()
    failed = LineBar("validation", interval=1000, stream=out, clock=FakeClock())
    failed.total = 9
    failed.update()
    failed.update()
    failed.abandon()  # an error follows: no last line
    failed.close()
    epoch = LineBar("train", interval=1000, stream=out, clock=FakeClock())
    epoch.reset()
    epoch.total = 4
    epoch.set_description("Epoch 2")
    epoch.n = 4
    epoch.close()
    assert _lines(out) == ["validation 1/9 batches | 0 s/batch | elapsed 0.0s | eta 0.0s",
                           "train epoch 2 4/4 batches | 0 s/batch | done in 0.0s"]


# --- the progress bar: plain lines unless stdout is a terminal --------------------------------------------------


def test_plain_lines_unless_the_stream_is_a_terminal(monkeypatch):
    bar = StepProgressBar()
    bar.stream = io.StringIO()
    assert bar.plain_lines
    bar.stream = FakeTerminal()
    monkeypatch.setenv("TERM", "xterm")
    assert not bar.plain_lines
    monkeypatch.setenv("TERM", "dumb")
    assert bar.plain_lines
    monkeypatch.setenv("TERM", "xterm")
    assert StepProgressBar(plain=True).plain_lines and not StepProgressBar(plain=False).plain_lines
    with pytest.raises(ValueError, match="interval must be >= 0"):
        StepProgressBar(interval=-1)


class _ValBoring(BoringModel):
    def training_step(self, batch, batch_idx):
        self.log("train/reward", 0.5)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.log("val/reward", 0.25)
        return super().validation_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        self.log("test/reward", 0.125)
        return super().test_step(batch, batch_idx)


def _trainer(tmp_path, bar, **kwargs):
    options = dict(accelerator="cpu", max_steps=4, val_check_interval=2, limit_val_batches=3, limit_test_batches=2,
                   logger=False, enable_checkpointing=False, enable_model_summary=False, callbacks=[bar],
                   default_root_dir=str(tmp_path), num_sanity_val_steps=1)
    return Trainer(**{**options, **kwargs})


def _recording_bar(interval: float) -> StepProgressBar:
    """A plain-line bar that writes to a string and reads a fake clock."""
    bar = StepProgressBar(interval=interval)
    bar.stream, bar.clock = io.StringIO(), FakeClock()
    return bar


def test_plain_lines_in_a_real_fit_and_test(tmp_path):
    bar = _recording_bar(0)
    trainer = _trainer(tmp_path, bar)
    trainer.fit(_ValBoring())
    trainer.test(_ValBoring(), verbose=False)
    lines = _lines(bar.stream)
    heads = [line.split(" | ")[0] for line in lines]
    assert heads == ["sanity check 1/1 batches",
                     "train step 1/4", "train step 2/4",
                     "validation (step 2) 1/3 batches", "validation (step 2) 2/3 batches",
                     "validation (step 2) 3/3 batches",
                     "train step 3/4",
                     "validation (step 4) 1/3 batches", "validation (step 4) 2/3 batches",
                     "validation (step 4) 3/3 batches",
                     "train step 4/4",
                     "test 1/2 batches", "test 2/2 batches"], lines
    assert lines[5].endswith("| done in 0.0s | reward 0.25"), lines[5]  # a validation's last line: val/ metrics
    assert "done in" in lines[10] and lines[10].endswith("reward 0.5 | val_reward 0.25"), lines[10]
    assert lines[6].endswith("| reward 0.5 | val_reward 0.25"), lines[6]  # after a validation: its reward
    assert lines[-1].endswith("| done in 0.0s | reward 0.125"), lines[-1]
    assert "reward" not in lines[0]  # the sanity check's metrics are discarded: not shown
    assert len(set(lines)) == len(lines)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_plain_training_lines_count_optimizer_steps_once_each(tmp_path, accumulate):
    bar = _recording_bar(0)
    _trainer(tmp_path, bar, max_steps=3, accumulate_grad_batches=accumulate, limit_val_batches=0,
             num_sanity_val_steps=0).fit(_ValBoring())
    assert [line.split(" | ")[0] for line in _lines(bar.stream)] == ["train step 1/3", "train step 2/3",
                                                                      "train step 3/3"]


def test_plain_lines_go_to_stdout_with_module_prints_on_their_own_line(tmp_path, capsys):
    class Printing(_ValBoring):
        def on_train_start(self):
            self.print("hello", "there")

    bar = StepProgressBar(interval=0)
    bar.clock = FakeClock()
    _trainer(tmp_path, bar, max_steps=1, limit_val_batches=0, num_sanity_val_steps=0).fit(Printing())
    out = capsys.readouterr().out
    assert out.splitlines() == ["hello there", "train step 1/1 | 0 s/step | done in 0.0s | reward 0.5"], out


def test_a_terminal_keeps_a_tqdm_bar(tmp_path, monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    bar = StepProgressBar(plain=False)
    _trainer(tmp_path, bar, max_steps=2, limit_val_batches=0, num_sanity_val_steps=0).fit(_ValBoring())
    assert not isinstance(bar.train_progress_bar, LineBar)
    assert "2/2" in str(bar.train_progress_bar)


# --- the validation outside Lightning's loops (before training) -------------------------------------------------


def _fake_trainer(callback):
    return SimpleNamespace(progress_bar_callback=callback)


def test_evaluation_progress_shows_on_the_step_bar_and_its_last_line_has_the_metrics():
    bar = _recording_bar(0)
    progress = EvaluationProgress(_fake_trainer(bar), "validation (before training)", 2)
    progress.advance()
    progress.advance()
    assert progress.close({"val/reward": 0.2866, "val/accuracy_greedy": 0.0339})
    assert _lines(bar.stream) == [
        "validation (before training) 1/2 batches | 0 s/batch | elapsed 0.0s | eta 0.0s",
        "validation (before training) 2/2 batches | 0 s/batch | done in 0.0s | reward 0.2866 | accuracy_greedy 0.0339"]


def test_evaluation_progress_without_the_step_bar_shows_nothing():
    for callback in (None, RichProgressBar()):
        progress = EvaluationProgress(_fake_trainer(callback), "validation (before training)", 2)
        progress.advance()
        assert progress.close({"val/reward": 0.3}) is False  # the caller prints the metrics itself
    bar = StepProgressBar(interval=0)
    bar.stream = io.StringIO()
    bar.disable()  # ranks other than 0
    progress = EvaluationProgress(_fake_trainer(bar), "validation (before training)", 2)
    progress.advance()
    assert progress.close({"val/reward": 0.3}) is False and bar.stream.getvalue() == ""


def test_an_exception_ends_the_bars_without_a_last_line():
    bar = _recording_bar(1000)
    progress = EvaluationProgress(_fake_trainer(bar), "validation (before training)", 5)
    progress.advance()
    progress.advance()
    bar.on_exception(None, None, RuntimeError("boom"))
    progress.close({"val/reward": 0.3})
    assert _lines(bar.stream) == ["validation (before training) 1/5 batches | 0 s/batch | elapsed 0.0s | eta 0.0s"]


# --- warnings, log records and errors: lines of their own ------------------------------------------------------


def test_warnings_are_one_line_without_a_source_path(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        console.install()
        warnings.warn("PromptDataModule: val_size=0.2 ignored", UserWarning, stacklevel=1)
        warnings.warn("old option", FutureWarning, stacklevel=1)
    err = capsys.readouterr().err
    assert err.splitlines() == ["warning: PromptDataModule: val_size=0.2 ignored", "warning: old option"], err
    assert not SOURCE_PATH.search(err)
    assert console.format_warning(UserWarning("two\nlines\n")) == "warning: two\nlines"


def test_a_line_written_under_a_terminal_bar_starts_a_line_of_its_own():
    from tqdm import tqdm

    screen = FakeTerminal()
    bar = tqdm(total=10, file=screen, mininterval=0, ascii=True)
    try:
        bar.update(3)
        console.write_line("warning: look", screen)
        text = screen.getvalue()
        before = text[:text.index("warning: look")]
        assert before.endswith("\r"), repr(text)  # the bar was cleared: the line starts at column 0
        assert "3/10" in text.split("warning: look\n")[1], repr(text)  # and drawn again below it
        screen.truncate(0), screen.seek(0)
        console.end_partial_line()
        assert screen.getvalue().endswith("\r"), repr(screen.getvalue())
    finally:
        bar.close()


def test_building_a_tiny_task_model_says_what_and_where_once(tmp_path, monkeypatch, caplog):
    """``tiny:<task>`` is a warm start of seconds to minutes on first use: one line says so and where it is cached;
    a later run loads the cache without a word."""
    import logging

    from rloo_lightning.tasks.base import Task

    built = []
    task = Task(name="probe", make_rows=lambda n, seed: [], reward=lambda *a, **k: [],
                build_tiny_model=lambda d: (built.append(d), (d / "config.json").write_text("{}")), version=3)
    monkeypatch.setenv("RLOO_LIGHTNING_CACHE", str(tmp_path))
    lightning_logger = logging.getLogger("lightning.pytorch")
    if not lightning_logger.propagate:  # Lightning's own handler in place of the root's: caplog's is not reached
        monkeypatch.setattr(lightning_logger, "handlers", [*lightning_logger.handlers, caplog.handler])
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        first, again = task.tiny_model_dir(), task.tiny_model_dir()
    assert first == again == tmp_path / "tiny-probe-v3" and len(built) == 1
    lines = [r.getMessage() for r in caplog.records if "tiny:probe" in r.getMessage()]
    assert lines == [f"tiny:probe: building the task's tiny model (a short warm start on the CPU, done once: it is "
                     f"cached in {first})"], lines


# --- where the run's files went --------------------------------------------------------------------------------


def test_the_last_line_names_the_checkpoint_and_the_logs(tmp_path):
    trainer = Trainer(accelerator="cpu", max_steps=2, limit_val_batches=0, enable_model_summary=False,
                      enable_progress_bar=False, default_root_dir=str(tmp_path))
    trainer.fit(BoringModel())
    line = console.outputs_line(trainer, "fit")
    version = tmp_path / "lightning_logs" / "version_0"
    assert line == f"fit done: checkpoint {version / 'checkpoints' / 'epoch=0-step=2.ckpt'} | logs {version}", line
    bare = Trainer(accelerator="cpu", max_steps=1, limit_val_batches=0, enable_model_summary=False, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, default_root_dir=str(tmp_path))
    bare.fit(BoringModel())
    assert console.outputs_line(bare, "fit") == "fit done: nothing was saved"


def test_a_resume_into_a_new_folder_says_where_and_one_in_its_own_folder_says_nothing(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    ckpt = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"")

    def trainer(**kwargs) -> Trainer:
        return Trainer(accelerator="cpu", default_root_dir=str(tmp_path), enable_progress_bar=False,
                       enable_model_summary=False, **kwargs)

    new = trainer()  # Lightning's default logger: the next version, version_1
    assert console.resume_line(new, str(ckpt)) == (
        f"resuming from {ckpt}: this run's checkpoints go to a new folder, "
        f"{tmp_path / 'lightning_logs' / 'version_1' / 'checkpoints'}")
    # the run's own folder (its version pinned): nothing to say, whatever folder the checkpoint recorded
    assert console.resume_line(trainer(logger=CSVLogger(str(tmp_path), version=0)), str(ckpt)) is None
    assert console.resume_line(new, None) is None and console.resume_line(new, "last") is None  # no local file
    assert console.resume_line(trainer(enable_checkpointing=False), str(ckpt)) is None  # no checkpoints saved


def test_the_last_line_is_written_once_on_rank_zero_only(capsys):
    trainer = SimpleNamespace(is_global_zero=True, callbacks=[], checkpoint_callbacks=[], loggers=[])
    console.report_outputs(trainer, "test")
    console.report_outputs(trainer, "export")  # not a trainer subcommand
    console.report_outputs(SimpleNamespace(is_global_zero=False), "test")
    assert capsys.readouterr().out == "test done: nothing was saved\n"
