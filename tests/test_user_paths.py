"""The new user's path: their own reward file, a mistyped model path, a reward that scores nothing."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

from rloo_lightning.runtime.importpath import add_cwd_to_sys_path, shadowing_files
from rloo_lightning.models import context_length, load_causal_lm, load_tokenizer, resolve_model_path
from rloo_lightning.rewards import RewardError, RewardSet, RewardWarning, resolve_reward


# -- 1. a reward file in the working directory ------------------------------------------------
def test_missing_reward_module_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError) as info:
        resolve_reward("myreward_not_here.score")
    msg = str(info.value)
    assert "\n" not in msg
    assert "no module named 'myreward_not_here'" in msg
    assert "working directory" in msg and "PYTHONPATH" in msg and str(tmp_path) in msg
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_cwd_appended_to_the_end_of_sys_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.curdir)])
    (tmp_path / "myreward_cwd_test.py").write_text(
        "def score(prompts, completions, completion_ids, **columns):\n    return [1.0] * len(completions)\n")
    assert add_cwd_to_sys_path() == str(tmp_path)
    assert sys.path[-1] == str(tmp_path)
    add_cwd_to_sys_path()
    assert sys.path.count(str(tmp_path)) == 1
    try:
        name, fn = resolve_reward("myreward_cwd_test.score")
        assert name == "score" and fn(["p"], ["c"], [[1]]) == [1.0]
    finally:
        sys.modules.pop("myreward_cwd_test", None)
    assert capsys.readouterr().err == ""  # no file named like a dependency: no warning


def test_file_named_like_a_dependency_warns(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("datasets.py", "torch.py", "myreward.py"):
        (tmp_path / name).write_text("")
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text("")
    assert shadowing_files(tmp_path) == ["datasets.py", "torch.py", "transformers"]
    add_cwd_to_sys_path()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("warning: ") for line in err)
    assert str(tmp_path / "datasets.py") in err[0] and "'datasets'" in err[0]
    import datasets  # the installed one still wins: the folder is at the end of sys.path

    assert not Path(datasets.__file__).resolve().is_relative_to(tmp_path.resolve())


@pytest.mark.slow  # a worker process starts (about 5 s)
def test_worker_gets_the_parents_working_directory(tmp_path, monkeypatch):
    """A reward in the working directory, not on sys.path, runs in a worker process."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "myreward_worker_test.py").write_text(
        "def score(prompts, completions, completion_ids, **columns):\n    return [2.0] * len(completions)\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])
    rs = RewardSet.from_specs(["myreward_worker_test.score"], num_workers=1)
    # the worker must find it through the cwd it is given, not through the parent's sys.path
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    try:
        total, _ = rs.score(["p", "q"], ["a", "b"], [[1], [2]], {})
    finally:
        rs.close()
        sys.modules.pop("myreward_worker_test", None)
    assert total.tolist() == [2.0, 2.0]


# -- 2. model paths that are not models -------------------------------------------------------
@pytest.mark.parametrize("loader", [load_tokenizer, load_causal_lm])
@pytest.mark.parametrize("name", ["./no/such/model", "no/such/model", "/tmp/rloo-no-such-model-dir", "~/no_such_x"])
def test_missing_model_directory(loader, name):
    with pytest.raises(ValueError) as info:
        loader(name)
    assert str(info.value).startswith(f"model_name_or_path {name!r}: no such directory")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("loader", [load_tokenizer, load_causal_lm])
def test_file_is_not_a_model(loader, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("print('hi')\n")
    with pytest.raises(ValueError, match=r"^model_name_or_path 'x\.py' is a file, not a model directory \(a folder "
                                         r"with config\.json, or a hub id\)$"):
        loader("x.py")


def test_directory_without_config(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match=r"directory has no config\.json"):
        load_causal_lm(str(tmp_path))
    with pytest.raises(ValueError, match=r"directory has no config\.json or tokenizer_config\.json"):
        load_tokenizer(str(tmp_path))
    # a GGUF model's folder has no config.json: not checked (transformers reads the GGUF file)
    with pytest.raises(Exception) as info:
        load_causal_lm(str(tmp_path), gguf_file="none.gguf")
    assert "no config.json" not in str(info.value)
    # a real model directory still loads
    assert load_tokenizer(tiny_model_dir).eos_token_id is not None


def test_hub_ids_still_go_to_the_hub(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # offline, an id must be in the cache (below)
    for name in ("Qwen/Qwen2.5-0.5B-Instruct", "gpt2", "x.py"):
        assert resolve_model_path(name) == name


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache, offline; transformers' loaders must not be reached."""
    from huggingface_hub import constants
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for auto in (AutoConfig, AutoModelForCausalLM, AutoTokenizer):
        monkeypatch.setattr(auto, "from_pretrained", lambda *a, **k: pytest.fail("from_pretrained was reached"))
    return cache


@pytest.mark.parametrize("loader", [load_tokenizer, load_causal_lm, context_length])
def test_an_uncached_hub_id_offline_is_refused_before_transformers_looks_naming_it_and_the_cache(hub_cache, loader):
    from rloo_lightning.cli_errors import error_line

    with pytest.raises(ValueError) as info:
        loader("SomeOrg/not-downloaded")
    assert error_line(info.value) == (
        f"error: model_name_or_path 'SomeOrg/not-downloaded': not a local folder (working directory {os.getcwd()}) "
        f"and not in the hub cache ({hub_cache}); HF_HUB_OFFLINE is set, so it is not downloaded: download it where "
        "there is a network (hf download SomeOrg/not-downloaded) or give the folder it is saved in")


def test_a_cached_hub_id_offline_goes_to_transformers(hub_cache):
    (hub_cache / "models--SomeOrg--cached" / "snapshots" / "0123abc").mkdir(parents=True)
    assert resolve_model_path("SomeOrg/cached") == "SomeOrg/cached"


def test_a_hub_id_that_fails_to_download_is_named_in_one_line(hub_cache, monkeypatch):
    """Online, transformers' own message (after the hub's retries) names neither the id nor the cache."""
    from huggingface_hub import constants
    from transformers import AutoTokenizer

    def unreachable(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in "
                      "the cached files.\nCheck your internet connection.")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", unreachable)
    with pytest.raises(OSError) as info:
        load_tokenizer("SomeOrg/not-downloaded")
    assert str(info.value) == (
        f"model_name_or_path 'SomeOrg/not-downloaded': not a local folder (working directory {os.getcwd()}) and not "
        f"in the hub cache ({hub_cache}); downloading its tokenizer failed: We couldn't connect to "
        "'https://huggingface.co' to load the files, and couldn't find them in the cached files. Check your internet "
        "connection.")


def test_a_model_folder_without_a_tokenizer_names_the_folder_and_the_files_it_lacks(tmp_path, tiny_model_dir):
    """Not transformers' text about sentencepiece and tiktoken: which folder, and which files a tokenizer has."""
    import shutil

    from rloo_lightning.cli_errors import error_line
    from rloo_lightning.models import TOKENIZER_FILES

    folder = tmp_path / "model_only"
    folder.mkdir()
    for file in Path(tiny_model_dir).iterdir():
        if file.name not in TOKENIZER_FILES:
            shutil.copy(file, folder / file.name)
    assert (folder / "config.json").is_file()
    with pytest.raises(ValueError) as info:
        load_tokenizer(str(folder))
    line = error_line(info.value)
    assert line.startswith(f"error: model_name_or_path {str(folder)!r}: the directory has no tokenizer_config.json "
                           "or tokenizer.json or tokenizer.model or vocab.json"), line
    assert "so it is not a saved tokenizer (it has the model's config.json: save the tokenizer" in line
    assert load_causal_lm(str(folder)) is not None  # the model itself loads


# -- 3. a reward that never scores ------------------------------------------------------------
def never(prompts, completions, completion_ids, **columns):
    return [None] * len(completions)


def sometimes(prompts, completions, completion_ids, **columns):
    return [None if i % 2 else 1.0 for i in range(len(completions))]


def test_all_none_reward_warns_once():
    rs = RewardSet.from_specs([never, sometimes])
    args = (["p"] * 4, ["a", "b", "c", "d"], [[1]] * 4, {})
    with pytest.warns(RewardWarning, match=r"reward function 'never' gave no reward \(None\) for every one of the 4 "
                                           r"completions.*no learning signal") as record:
        rs.score(*args)
    assert len([w for w in record if issubclass(w.category, RewardWarning)]) == 1  # not for 'sometimes'
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rs.score(*args)  # once per set and function
    with pytest.warns(RewardWarning, match="'never'"):
        RewardSet.from_specs([never]).score(*args)  # a new set warns again


def test_no_signal_warns_once_after_a_streak_of_uninformative_steps():
    from rloo_lightning.metrics import NoSignalWatch

    watch = NoSignalWatch(patience=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step, fraction in enumerate([1.0, 1.0, 0.5, 1.0, 1.0]):  # the streak is broken at step 2
            watch.update(fraction, step)
    with pytest.warns(UserWarning, match=r"no learning signal: in each of the last 3 steps \(up to step 5\)"):
        watch.update(1.0, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch.update(1.0, 6)  # once


def test_module_watches_for_steps_without_signal(tiny_model_dir):
    from module_helpers import configured_module, scored_rollout

    module = configured_module(tiny_model_dir)
    module.no_signal.patience = 2
    rollout = scored_rollout(module)
    rollout.rewards = torch.ones_like(rollout.rewards)  # every group's rewards equal
    module.rollout_loss(rollout)
    module.log_train_metrics(rollout, torch.zeros_like(rollout.completion_mask), torch.tensor(0.0))
    with pytest.warns(UserWarning, match="no learning signal"):
        module.log_train_metrics(rollout, torch.zeros_like(rollout.completion_mask), torch.tensor(0.0))


# -- the CLI, from the user's folder -----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--model.rewards.workers", "1"]], ids=["in_process", "workers"])
def test_cli_reward_file_in_working_directory(tmp_path, extra, _cache_dir):
    """Under DDP (rank 1 re-runs the command): ``test_resume.test_ddp_cli_fit_runs_to_completion``."""
    from cli_harness import CLI, CONFIGS, Proc, entry_point, make_env

    (tmp_path / "myreward.py").write_text(
        "def score(prompts, completions, completion_ids, **columns):\n"
        "    return [sum(ch in 'abc' for ch in c) / 8 for c in completions]\n")
    prompts = ["abc=", "bad=", "cab=", "dhe=", "fgh=", "ace=", "bdf=", "hga=", "gfe=", "dcb=", "abcd=", "efgh=",
               "hgfe=", "aceg=", "bdfh=", "cdab=", "ebc=", "fad=", "gch=", "hab="]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    # the entry-point script, as the user runs it: unlike `python -m`, it does not put the cwd on sys.path
    command = entry_point()
    if command == CLI:
        pytest.skip("no rloo-lightning entry point next to the interpreter")
    args = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--model.rewards.funcs", "[myreward.score]",
            "--data.task", "null", "--data.train_file", "prompts.jsonl", "--trainer.max_steps", "2",
            "--trainer.limit_val_batches", "0", "--model.validation.at_start", "false", *extra]
    proc = Proc("fit", [*command, *args], tmp_path, env=make_env(cache=_cache_dir)).check()
    assert "No module named" not in proc.log
    assert "has the name of the module" not in proc.log  # no file there shadows a dependency


def raises(prompts, completions, completion_ids, **columns):
    raise RuntimeError("boom")


def test_on_error_scored_call_warns_only_about_the_error():
    rs = RewardSet.from_specs([raises], on_error="none")
    with pytest.warns(RewardWarning) as record:
        rs.score(["p"] * 2, ["a", "b"], [[1]] * 2, {})
    messages = [str(w.message) for w in record if issubclass(w.category, RewardWarning)]
    assert len(messages) == 1 and "raised" in messages[0] and "no learning signal" not in messages[0]
