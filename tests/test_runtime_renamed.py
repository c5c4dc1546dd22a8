"""The package's old module paths are gone (no shims); a class path that names one, in a config, on the command line,
stored in a checkpoint or imported by path (an engine, environment, tool or reward function), gets one line naming
the new path (``runtime/renamed.py``), not an import error.

The command runs in process, as in ``test_cli_option_errors.py`` (its ``no_model`` fixture): ``main`` with the model
loader replaced by one that fails the test, in an empty working directory.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from test_cli_option_errors import QUICKSTART, _error, no_model  # noqa: F401 (a fixture)

from rloo_lightning.cli import main
from rloo_lightning.runtime.renamed import RENAMED, renamed_hint, renamed_path

LAYOUT = Path(__file__).resolve().parents[1] / "docs" / "layout.md"
# The old modules: the table's keys that are no name inside another key.
OLD_MODULES = sorted(k for k in RENAMED if not any(k.startswith(other + ".") for other in RENAMED))
ENGINES = [("rloo_lightning.vllm_engine.VLLMEngine", "rloo_lightning.engines.vllm.VLLMEngine"),
           ("rloo_lightning.decode.DecodeLoopEngine", "rloo_lightning.engines.decode.DecodeLoopEngine")]


def _resolve(dotted: str):
    """The module or the object at ``dotted``."""
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError:
        module, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(module), name)


# -- the table ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("old", OLD_MODULES)
def test_each_old_module_is_gone(old):
    assert importlib.util.find_spec(old) is None


@pytest.mark.parametrize("old, new", sorted(RENAMED.items()), ids=sorted(RENAMED))
def test_each_new_path_resolves(old, new):
    assert _resolve(new) is not None


@pytest.mark.parametrize("old, new", [
    *ENGINES,
    ("rloo_lightning.checkpoint_io.AtomicCheckpointIO", "rloo_lightning.runtime.atomic_checkpoint.AtomicCheckpointIO"),
    ("rloo_lightning.checkpoint_io.check_checkpoint_path",
     "rloo_lightning.runtime.checkpoint_check.check_checkpoint_path"),  # a module split in two
    ("rloo_lightning.logprobs.token_logprobs", "rloo_lightning.algo.logprobs.token_logprobs"),
    ("rloo_lightning.logprobs.completion_logits", "rloo_lightning.forward.completion_logits"),
    ("rloo_lightning.logprobs.prefill_groups", "rloo_lightning.engines.kv_cache.prefill_groups"),
    ("rloo_lightning.multiturn.Episode", "rloo_lightning.environments.episodes.LiveEpisode"),  # renamed as it moved
    ("rloo_lightning.multiturn.Environment", "rloo_lightning.environments.base.Environment"),
    ("rloo_lightning.exactness_multiturn.ToyEnvironment", "rloo_lightning.verify.exactness_multiturn.ToyEnvironment"),
    ("rloo_lightning.rewards.shaping.clip_rewards", "rloo_lightning.algo.shaping.clip_rewards"),
    ("rloo_lightning.rewards.parallel.WorkerPool", "rloo_lightning.runtime.workers.WorkerPool"),
    (" rloo_lightning.timing.PhaseTimer ", "rloo_lightning.runtime.timing.PhaseTimer"),
])
def test_an_old_path_names_the_new_object(old, new):
    assert renamed_path(old) == new
    assert _resolve(new) is not None
    assert renamed_hint(old) == f"{old.strip()} was renamed {new}: use the new path"


@pytest.mark.parametrize("path", ["rloo_lightning.engines.vllm.VLLMEngine", "rloo_lightning.policy_module.PolicyModule",
                                  "rloo_lightning.engines.DecodeLoopEngine", "rloo_lightning", "timing.PhaseTimer",
                                  "my_rewards.decode.score", None, 3])
def test_a_path_that_names_no_old_module_has_no_hint(path):
    assert renamed_path(path) is None and renamed_hint(path) is None


def test_the_layout_lists_every_old_module():
    """docs/layout.md's last section lists the renames once: the same old modules as the table, with their new ones."""
    section = LAYOUT.read_text().split("\n## Renamed paths\n", 1)[1]
    rows = dict(re.findall(r"^\| `(rloo_lightning[\w.]*)` \| `(rloo_lightning[\w.]*)`", section, re.M))
    assert sorted(rows) == OLD_MODULES
    assert all(rows[old] == RENAMED[old] for old in OLD_MODULES)


# -- where a path is imported: engines, environments, tools, reward functions ------------------------------------
def test_each_import_by_path_names_the_new_path():
    """``import_object`` (engines, environments, tools and reward functions resolve through it) says one line."""
    from rloo_lightning.engines import build_engine
    from rloo_lightning.environments import EnvironmentConfigError
    from rloo_lightning.environments.sampler import import_environment
    from rloo_lightning.environments.tools import resolve_tools
    from rloo_lightning.rewards.protocol import RewardError, resolve_reward
    from rloo_lightning.runtime.importpath import ImportPathError, import_object

    old, new = ENGINES[0]
    with pytest.raises(ImportError) as raised:
        build_engine({"class_path": old, "init_args": {}})
    assert str(raised.value) == f"generation engine {old} was renamed {new}: use the new path"
    old = "rloo_lightning.exactness_multiturn.ToyEnvironment"
    with pytest.raises(EnvironmentConfigError, match=re.escape(
            f"environment.class_path {old} was renamed rloo_lightning.verify.exactness_multiturn.ToyEnvironment")):
        import_environment(old, "environment.class_path")
    with pytest.raises(EnvironmentConfigError, match=re.escape(
            "tool rloo_lightning.multiturn.EnvCalls was renamed rloo_lightning.environments.calls.EnvCalls")):
        resolve_tools(["rloo_lightning.multiturn.EnvCalls"])
    with pytest.raises(RewardError, match=re.escape(
            "rloo_lightning.rewards.shaping.clip_rewards was renamed rloo_lightning.algo.shaping.clip_rewards")):
        resolve_reward("rloo_lightning.rewards.shaping.clip_rewards")
    with pytest.raises(ImportPathError) as raised:
        import_object("rloo_lightning.timing.PhaseTimer", "callback")
    assert "\n" not in str(raised.value) and raised.value.__cause__ is None


# -- the command: a config, the command line, a checkpoint -------------------------------------------------------
def _run(capsys, args: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(args)
    return exit_.value.code, capsys.readouterr().err


@pytest.mark.parametrize("old, new", ENGINES)
@pytest.mark.parametrize("written", ["class_path", "short"])
@pytest.mark.usefixtures("no_model")
def test_a_config_naming_an_old_engine_path_gets_one_line(tmp_path, capsys, old, new, written):
    path = tmp_path / "mine.yaml"
    engine = f"{{class_path: {old}}}" if written == "class_path" else old
    path.write_text(f"model:\n  generation_engine: {engine}\n")
    assert _error(capsys, ["fit", "--config", QUICKSTART, "--config", str(path)], 2) == \
        f"error: model.generation_engine in {path}: {old} was renamed {new}: use the new path"
    assert list(tmp_path.iterdir()) == [path]  # no log folder


@pytest.mark.parametrize("args, line", [
    (["--model.generation_engine", "rloo_lightning.decode.DecodeLoopEngine"],
     "--model.generation_engine: rloo_lightning.decode.DecodeLoopEngine was renamed "
     "rloo_lightning.engines.decode.DecodeLoopEngine: use the new path"),
    (["--trainer.callbacks+=rloo_lightning.timing.PhaseTimer"],
     "trainer.callbacks: rloo_lightning.timing.PhaseTimer was renamed rloo_lightning.runtime.timing.PhaseTimer: "
     "use the new path"),
    (["--trainer.plugins", json.dumps({"class_path": "rloo_lightning.checkpoint_io.AtomicCheckpointIO"})],
     "--trainer.plugins: rloo_lightning.checkpoint_io.AtomicCheckpointIO was renamed "
     "rloo_lightning.runtime.atomic_checkpoint.AtomicCheckpointIO: use the new path"),
])
@pytest.mark.usefixtures("no_model")
def test_an_old_class_path_on_the_command_line_gets_one_line(capsys, args, line):
    assert _error(capsys, ["fit", "--config", QUICKSTART, *args], 2) == f"error: {line}"


def _checkpoint(folder: Path, engine: dict) -> Path:
    """A checkpoint file with the hyperparameters the command reads before it builds anything (no weights)."""
    path = folder / "old.ckpt"
    torch.save({"pytorch-lightning_version": "2.5.0", "state_dict": {}, "epoch": 0, "global_step": 2,
                "hyper_parameters": {"model_name_or_path": "tiny", "generation_engine": engine},
                "datamodule_hyper_parameters": {}}, path)
    return path


@pytest.mark.slow  # a checkpoint written and a command run on it, per engine
@pytest.mark.parametrize("old, new", ENGINES)
@pytest.mark.usefixtures("no_model")
def test_a_checkpoint_naming_an_old_engine_path_gets_one_line(tmp_path, capsys, tiny_model_dir, old, new):
    """A resume stops with one line naming the new path and the option that rebuilds the stored engine with it;
    that option then gets past the check (to loading the model, which this test's loader refuses)."""
    init_args = {"max_num_seqs": 8} if "vllm" in old else {"return_logprobs": True}
    ckpt = _checkpoint(tmp_path, {"class_path": old, "init_args": init_args})
    fit = ["fit", "--config", QUICKSTART, "--ckpt_path", str(ckpt)]
    line = _error(capsys, fit, 1)
    spec = json.dumps({"class_path": new, "init_args": init_args})
    assert line.startswith(f"error: the checkpoint was trained with {old}, renamed {new} since "
                           f"(--model.generation_engine '{spec}' names it)"), line
    if "vllm" not in old:  # (vLLM is not installed here: its engine stops at setup, after a model is built)
        rc, err = _run(capsys, [*fit, "--model.generation_engine", spec, "--model.model_name_or_path",
                                str(tiny_model_dir)])
        assert rc == 1 and "the model was loaded" in err, err


@pytest.mark.slow  # an evaluation of the tiny model
@pytest.mark.usefixtures("no_model")
def test_a_checkpoint_naming_an_old_engine_path_evaluates_with_the_default_engine_after_one_line(tmp_path, capsys,
                                                                                                tiny_model_dir):
    old, new = ENGINES[1]
    ckpt = _checkpoint(tmp_path, {"class_path": old, "init_args": {}})
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "abc="}\n')
    rc, err = _run(capsys, ["predict", "--config", QUICKSTART, "--ckpt_path", str(ckpt),
                            "--data.predict_file", str(tmp_path / "prompts.jsonl"),
                            "--model.predict.output_file", str(tmp_path / "p.jsonl"),
                            "--model.model_name_or_path", str(tiny_model_dir)])
    warning = [line for line in err.splitlines() if line.startswith("warning:") and old in line]
    assert len(warning) == 1 and f"renamed {new} since" in warning[0], err
    assert "samples with the default engine" in warning[0]
    assert rc == 1 and "the model was loaded" in err, err  # on to loading the model


# -- renamed options: the old name answered with the new one ------------------------------------------------------
def test_a_renamed_option_is_answered_with_its_new_name_in_python_on_the_command_line_and_in_a_config(tmp_path):
    from rloo_lightning.config import RolloutArgs
    from rloo_lightning.options import as_group
    from rloo_lightning.runtime.renamed import renamed_option

    assert renamed_option("rollout.max_staleness") == "rollout.lag"
    assert renamed_option("--model.rollout.max_staleness") == "--model.rollout.lag"
    assert renamed_option("rollout.lag") is None
    with pytest.raises(ValueError, match=r"unknown option rollout.max_staleness; did you mean rollout.lag\?"):
        as_group(RolloutArgs, {"max_staleness": 1})
    assert as_group(RolloutArgs, {"lag": 2}).lag == 2


def test_the_old_lag_option_on_the_command_line_and_in_a_config_names_the_new_one(no_model, capsys):  # noqa: F811
    base = ["fit", "--config", str(QUICKSTART)]
    line = _error(capsys, [*base, "--model.rollout.max_staleness", "1"], 2)
    assert line == "error: unknown option --model.rollout.max_staleness; did you mean --model.rollout.lag?"
    (no_model / "old.yaml").write_text("model:\n  rollout:\n    max_staleness: 1\n")
    line = _error(capsys, [*base, "--config", str(no_model / "old.yaml")], 2)
    assert line == f"error: unknown option model.rollout.max_staleness in {no_model / 'old.yaml'}; did you mean " \
                   "model.rollout.lag?"
