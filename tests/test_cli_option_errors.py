"""Errors about options that say where the option was set and what was meant, before any model is loaded.

A misspelt option (command line or ``--config`` file) names the key, the file, and the closest valid key; a
learning rate that is not a finite number > 0 and an existing predictions file are refused before the model
loads, naming the option as the user set it. All in process: ``main`` with the model loader replaced by one
that fails the test, in an empty working directory that must stay empty of log folders.
"""

from __future__ import annotations

import pytest

from cli_harness import CONFIGS
from rloo_lightning.cli import TRACEBACK_ENV, main

QUICKSTART = str(CONFIGS / "quickstart.yaml")


@pytest.fixture
def no_model(monkeypatch, tmp_path):
    """``main`` run in an empty ``tmp_path``; loading the policy fails with an error line of its own."""

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("rloo_lightning.policy_module.load_models", loaded)
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _error(capsys, args: list[str], code: int) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == code, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


# --- a misspelt option ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("yaml_text, line", [
    ("model: {samplng: {k: 4}}\n", "unknown option model.samplng in {path}; did you mean model.sampling?"),
    ("trainer: {max_step: 5}\n", "unknown option trainer.max_step in {path}; did you mean trainer.max_steps?"),
    ("model:\n  sampling:\n    kk: 3\n", "unknown option model.sampling.kk in {path}; did you mean model.sampling.k?"),
    ("data: {batch_sise: 4}\n", "unknown option data.batch_sise in {path}; did you mean data.batch_size?"),
])
def test_a_misspelt_key_in_a_config_file_names_the_file_and_the_closest_key(no_model, capsys, yaml_text, line):
    path = no_model / "mine.yaml"
    path.write_text(yaml_text)
    assert _error(capsys, ["fit", "--config", QUICKSTART, "--config", str(path)], 2) == \
        "error: " + line.format(path=path)
    assert list(no_model.iterdir()) == [path]  # no log folder


@pytest.mark.parametrize("args, line", [
    (["--model.samplng.k", "4"], "unknown option --model.samplng.k; did you mean --model.sampling.k?"),
    (["--model.sampling.kk=4"], "unknown option --model.sampling.kk; did you mean --model.sampling.k?"),
    # an unambiguous prefix is no longer taken for the option it starts (argparse's abbreviations are off)
    (["--trainer.max_step", "5"], "unknown option --trainer.max_step; did you mean --trainer.max_steps?"),
    (["--trainr.max_steps", "5"], "unknown option --trainr.max_steps; did you mean --trainer.max_steps?"),
    (["--model.zzzzzz", "5"], "unknown option --model.zzzzzz"),
])
def test_a_misspelt_command_line_option_names_the_closest_option(no_model, capsys, args, line):
    assert _error(capsys, ["fit", "--config", QUICKSTART, *args], 2) == "error: " + line
    assert list(no_model.iterdir()) == []


def test_a_misspelt_subcommand_names_the_closest_one(no_model, capsys):
    assert _error(capsys, ["fti", "--config", QUICKSTART], 2).endswith("; did you mean fit?")


def test_a_key_in_a_file_given_before_the_subcommand_is_found_under_the_subcommand(no_model, capsys):
    path = no_model / "top.yaml"
    path.write_text("fit:\n  model:\n    samplng: {k: 4}\n")
    assert _error(capsys, ["--config", str(path), "fit", "--config", QUICKSTART], 2) == \
        f"error: unknown option model.samplng in {path}; did you mean model.sampling?"


# --- the learning rate ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, shown", [("-0.001", "-0.001"), ("0", "0"), (".nan", "nan"), (".inf", "inf")])
def test_a_learning_rate_in_a_config_file_is_refused_before_the_model_loads(no_model, capsys, value, shown):
    path = no_model / "lr.yaml"
    path.write_text(f"model: {{optimizer: {{init_args: {{lr: {value}}}}}}}\n")
    line = _error(capsys, ["fit", "--config", QUICKSTART, "--config", str(path)], 1)
    assert line == f"error: model.optimizer.init_args.lr in {path} must be a finite number > 0, got {float(shown)}"
    assert list(no_model.iterdir()) == [path]  # no log folder: nothing was instantiated


@pytest.mark.parametrize("option", ["--model.optimizer.init_args.lr", "--model.optimizer.lr", "--optimizer.lr"])
def test_a_learning_rate_on_the_command_line_is_named_as_given(no_model, capsys, option):
    extra = ["--optimizer", "torch.optim.SGD"] if option == "--optimizer.lr" else []
    line = _error(capsys, ["fit", "--config", QUICKSTART, *extra, f"{option}=-1e-3"], 1)
    assert line == f"error: {option} must be a finite number > 0, got -0.001"
    assert list(no_model.iterdir()) == []


def test_check_learning_rate():
    from rloo_lightning.options import check_learning_rate

    for good in (1e-6, 1, 0.5):
        check_learning_rate(good, "x.lr")
    check_learning_rate(None, "x.lr")  # not set, or no plain number: the optimizer's to judge
    for bad in (-1e-3, 0, 0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"^x\.lr must be a finite number > 0"):
            check_learning_rate(bad, "x.lr")


# --- an existing predictions file ----------------------------------------------------------------------------


def _predict_args(tmp_path) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "abc=", "answer": "cba"}\n')
    return ["predict", "--config", QUICKSTART, "--data.predict_file", str(prompts)]


def test_an_existing_output_file_is_refused_before_the_model_loads(no_model, capsys):
    out = no_model / "predictions.jsonl"
    out.write_text("earlier results\n")
    args = _predict_args(no_model)
    line = _error(capsys, [*args, "--model.predict.output_file", str(out)], 1)
    assert line == f"error: --model.predict.output_file: {out} exists; remove it or choose another file"
    config = no_model / "predict.yaml"
    config.write_text(f"model: {{predict: {{output_file: {out}}}}}\n")
    line = _error(capsys, [*args, "--config", str(config)], 1)
    assert line == f"error: model.predict.output_file in {config}: {out} exists; remove it or choose another file"
    assert out.read_text() == "earlier results\n"
    assert sorted(p.name for p in no_model.iterdir()) == ["predict.yaml", "predictions.jsonl", "prompts.jsonl"]


def test_an_existing_default_output_file_is_refused_before_the_model_loads(no_model, capsys):
    folder = no_model / "logs" / "fixed"
    folder.mkdir(parents=True)
    (folder / "predictions.jsonl").write_text("earlier results\n")
    logger = ["--trainer.logger.class_path", "lightning.pytorch.loggers.CSVLogger",
              "--trainer.logger.init_args.save_dir", str(no_model), "--trainer.logger.init_args.name", "logs",
              "--trainer.logger.init_args.version", "fixed"]
    line = _error(capsys, [*_predict_args(no_model), *logger], 1)
    assert line == (f"error: the predictions file {folder / 'predictions.jsonl'} exists (the default, in the log "
                    "folder); remove it or set model.predict.output_file to another file")
    assert [p.name for p in folder.iterdir()] == ["predictions.jsonl"]  # no config.yaml, no metrics written there
    assert (folder / "predictions.jsonl").read_text() == "earlier results\n"


def test_prediction_writer_refuses_an_existing_file_at_setup(tmp_path):
    """Without the CLI (a Trainer of one's own): the writer's ``setup``, which Lightning calls before
    ``configure_model``, refuses the file."""
    from types import SimpleNamespace

    from rloo_lightning.callbacks.predict import PredictionWriter

    out = tmp_path / "out.jsonl"
    out.write_text("x\n")
    trainer = SimpleNamespace(world_size=1, global_rank=0, log_dir=str(tmp_path), default_root_dir=str(tmp_path))
    PredictionWriter(str(out)).setup(trainer, None, "fit")  # idle outside predict
    with pytest.raises(FileExistsError, match=f"^model.predict.output_file: {out} exists"):
        PredictionWriter(str(out)).setup(trainer, None, "predict")
    PredictionWriter(str(tmp_path / "new.jsonl")).setup(trainer, None, "predict")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]
    # several processes: rank N writes <stem>.rankN.jsonl; the CLI, before the ranks are numbered, checks them all
    (tmp_path / "new.rank1.jsonl").write_text("x\n")
    ranks = SimpleNamespace(world_size=2, global_rank=0, log_dir=str(tmp_path), default_root_dir=str(tmp_path))
    PredictionWriter(str(tmp_path / "new.jsonl")).setup(ranks, None, "predict")  # rank 0's own file is free
    with pytest.raises(FileExistsError, match="new.rank1.jsonl exists"):
        PredictionWriter(str(tmp_path / "new.jsonl")).check(ranks, every_rank=True)


# -- the parsers built: the named subcommand's only ----------------------------------------------------------------
def test_only_the_subcommand_named_has_its_parser_built():
    from rloo_lightning.cli import RLOOCLI

    cli = RLOOCLI.__new__(RLOOCLI)  # what subcommands() reads, without building a parser
    for only, built in (("fit", ["fit"]), ("test", ["test"]), (None, ["fit", "validate", "test", "predict"]),
                        ("export", ["fit", "validate", "test", "predict"])):
        cli.only = only
        assert list(cli.subcommands()) == built


def test_a_command_without_or_with_a_misspelt_subcommand_still_lists_all_four(no_model, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("fit", "validate", "test", "predict")), out
    assert _error(capsys, ["fitt", "--config", QUICKSTART], 2).startswith(
        "error: argument subcommand: invalid choice: 'fitt' (choose from 'fit', 'validate', 'test', 'predict')")
    with pytest.raises(SystemExit) as exit_:
        main(["predict", "--help"])
    assert exit_.value.code == 0 and "--data.predict_file" in capsys.readouterr().out
