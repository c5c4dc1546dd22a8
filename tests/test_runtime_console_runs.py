"""The console of the real command with its output redirected to a file, as on a cluster (stdout and stderr in one
file, like ``> log 2>&1``): plain progress lines, a warning line, an error on its own line, and a last line naming
where things went after ``fit``, ``test`` and ``predict``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cli_harness import CLI, CONFIGS, Proc, make_env, wait_all


QUICKSTART = str(CONFIGS / "quickstart.yaml")
PROGRESS = re.compile(r"^(train|validation|sanity check|test|predict)\b.* \d+/(\d+|\?)( batches)? \| ")
SOURCE_PATH = re.compile(r"\.py:\d+:")


# --- the real command, its output in a file ---------------------------------------------------------------------
def _combined(name: str, args: list, cwd: Path, env: dict) -> Proc:
    """The CLI with stdout and stderr in one file (``<cwd>/<name>.stdout``), as a cluster's job log."""
    return Proc(name, [*CLI, *map(str, args)], cwd, env, combined=True)


def _data_args(model_dir: str, root: Path) -> list:
    return ["--config", QUICKSTART, "--model.model_name_or_path", model_dir, "--trainer.default_root_dir", root,
            "--data.num_train_rows", 16, "--data.num_val_rows", 8, "--data.batch_size", 4]


LINES_EVERY_UPDATE = ["--trainer.callbacks+=rloo_lightning.callbacks.StepProgressBar",
                      "--trainer.callbacks.interval=0"]


@pytest.fixture(scope="module")
def logged_runs(tmp_path_factory, tiny_model_dir, _cache_dir):
    """fit (2 steps, a validation before training and one at step 2, a warning, a line at every update) and a fit
    whose validation before training fails after its first batch (default bar); then test and predict from the
    first fit's last.ckpt. Every output in a file."""
    env = make_env(_cache_dir, RLOO_TRACEBACK=None)
    root = tmp_path_factory.mktemp("console")
    fit = _combined("fit", ["fit", *_data_args(tiny_model_dir, root / "fit"), "--trainer.max_steps", 2,
                            "--trainer.val_check_interval", 2, *LINES_EVERY_UPDATE,
                            "--trainer.callbacks+=console_helpers.WarnAtTrainStart"], root / "fit", env)
    failing = _combined("failing", ["fit", *_data_args(tiny_model_dir, root / "failing"), "--trainer.max_steps", 2,
                                     "--trainer.callbacks+=console_helpers.FailSecondEvaluation"],
                        root / "failing", env)
    wait_all(fit, failing)
    runs = {"fit": fit, "failing": failing}
    last = root / "fit" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    if fit.rc == 0 and last.exists():
        prompts = root / "prompts.jsonl"
        rows = [{"prompt": p + "=", "answer": p[::-1]} for p in ("abc", "hgfed", "dab", "gefa")]
        prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
        runs["test"] = _combined("test", ["test", *_data_args(tiny_model_dir, root / "test"), "--ckpt_path", last,
                                          *LINES_EVERY_UPDATE], root / "test", env)
        runs["predict"] = _combined("predict", ["predict", *_data_args(tiny_model_dir, root / "predict"), "--ckpt_path",
                                                last, "--data.predict_file", prompts], root / "predict", env)
        wait_all(runs["test"], runs["predict"])
    return runs


def _check_plain(run: Proc) -> list[str]:
    """The run's lines, after the checks every redirected run passes: no escape codes, no carriage returns, no
    progress line twice, no warning with a source path."""
    text = run.stdout
    raw = (run.cwd / f"{run.name}.stdout").read_bytes()  # read as text, a carriage return would be a newline
    assert b"\x1b" not in raw and b"\r" not in raw, run.explain()
    lines = text.splitlines()
    progress = [line for line in lines if PROGRESS.match(line)]
    assert len(set(progress)) == len(progress), run.explain()
    for line in lines:
        assert not SOURCE_PATH.search(line), line
    return lines


def _last_line(run: Proc, subcommand: str) -> str:
    lines = run.stdout.splitlines()
    done = [line for line in lines if line.startswith(f"{subcommand} done: ")]
    assert len(done) == 1 and lines[-1] == done[0], run.explain()
    return done[0]


@pytest.mark.slow
def test_fit_in_a_file_has_plain_progress_lines_a_warning_line_and_a_last_line(logged_runs):
    run = logged_runs["fit"].check()
    lines = _check_plain(run)
    heads = [line.split(" | ")[0] for line in lines if PROGRESS.match(line)]
    assert heads == ["validation (before training) 1/2 batches", "validation (before training) 2/2 batches",
                     "train step 1/2", "validation (step 2) 1/2 batches", "validation (step 2) 2/2 batches",
                     "train step 2/2"], run.explain()
    before = next(line for line in lines if line.startswith("validation (before training) 2/2 batches"))
    assert "done in" in before and "| reward " in before, before  # the metrics, on the last line
    assert "validation before training: {" not in run.stdout  # said once, by that line
    from console_helpers import WARNING

    assert f"warning: {WARNING}" in lines, run.explain()
    version = run.cwd / "lightning_logs" / "version_0"
    assert _last_line(run, "fit") == f"fit done: checkpoint {version / 'checkpoints' / 'last.ckpt'} | logs {version}"


@pytest.mark.slow
def test_an_error_in_the_validation_before_training_is_on_its_own_line(logged_runs):
    from console_helpers import FAILURE

    run = logged_runs["failing"].wait()
    assert run.rc == 1, run.explain()
    lines = _check_plain(run)
    at = lines.index(f"error: {FAILURE}")
    assert lines[at - 1].startswith("validation (before training) 1/2 batches | "), run.explain()
    assert not any(line.startswith("fit done:") for line in lines), run.explain()


@pytest.mark.slow
@pytest.mark.parametrize("subcommand", ["test", "predict"])
def test_test_and_predict_in_a_file_end_with_where_things_went(logged_runs, subcommand):
    assert "test" in logged_runs, logged_runs["fit"].explain()
    run = logged_runs[subcommand].check()
    lines = _check_plain(run)
    logs = run.cwd / "lightning_logs" / "version_0"
    progress = [line for line in lines if PROGRESS.match(line)]
    assert progress and progress[-1].startswith(f"{subcommand} ") and " | done in " in progress[-1], run.explain()
    if subcommand == "test":  # a line at every update
        assert [line.split(" | ")[0] for line in progress] == ["test 1/2 batches", "test 2/2 batches"], run.explain()
        assert "| reward " in progress[-1], run.explain()
        assert _last_line(run, "test") == f"test done: logs {logs}"
    else:
        assert _last_line(run, "predict") == f"predict done: predictions {logs / 'predictions.jsonl'} | logs {logs}"
