"""The README's path for a user's own data, walked as written: reward file, JSONL, fit, test, predict, export.

Every file and command comes from the README itself (its code blocks); only the model (the offline tiny
one for the hub id), the config's path and the run's size are changed, by options appended to the README's
fit command. If the README's commands change, this test runs the new ones.
"""

from __future__ import annotations

import json
import re
import shlex

import pytest

from cli_harness import CLI, REPO, make_env, Proc
from rloo_lightning.tasks import get_task

README = (REPO / "README.md").read_text()


def _blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _commands(block: str) -> list[list[str]]:
    """The shell commands of a block, continuation lines joined, each split like a shell would."""
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def _reward_file() -> str:
    """The README's ``my_rewards.py``, as it shows it."""
    (block,) = [b for b in _blocks("python") if b.startswith("# my_rewards.py")]
    return block


def _readme_command(start: str) -> list[str]:
    found = [c for b in _blocks("bash") for c in _commands(b) if " ".join(c).startswith(start)]
    assert found, f"the README has no command starting with {start!r}"
    return found[0]


def test_the_readme_reward_finds_the_answer_in_a_sentence():
    """A chat model answers in words ("The answer is 78."): the README's example reward and the built-in it names
    score that, and only the right number, as a correct answer; a completion with no number scores 0."""
    from rloo_lightning.rewards.builtin import ExactAnswer

    namespace: dict = {}
    exec(compile(_reward_file(), "my_rewards.py", "exec"), namespace)
    completions = ["The answer is 78.", "78", "I think 87, no: 78", "The answer is 87.", "seventy-eight", " 78 apples"]
    want = [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    for reward in (namespace["correct"], ExactAnswer()):
        assert reward([""] * 6, completions, [[]] * 6, answer=["78"] * 6) == want, reward
    assert namespace["correct"](["", ""], ["It is 1,000.", "It is 12"], [[], []], answer=["1000", 12]) == [1.0, 1.0]


def _run(name: str, argv: list[str], cwd, env) -> Proc:
    assert argv[0] == "rloo-lightning", argv
    return Proc(name, CLI + argv[1:], cwd, env).wait().check()


@pytest.mark.slow  # five CLI runs of the tiny model (about a minute on 2 cores)
def test_the_readme_path_for_your_own_model_data_and_reward(tmp_path, _cache_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    env = make_env(_cache_dir)
    # The reward file, exactly as the README shows it.
    (tmp_path / "my_rewards.py").write_text(_reward_file())
    # Prompt files in the README's row format (its first example row's columns), with the tiny model's task.
    example = json.loads(_blocks("json")[0].splitlines()[0])
    assert set(example) == {"prompt", "answer"}
    rows = get_task("reverse").make_rows(48, seed=3)
    (tmp_path / "data").mkdir()
    for name, part in {"train": rows[:32], "val": rows[32:40], "test": rows[40:44], "new": rows[44:]}.items():
        (tmp_path / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))

    # fit: the README's command; the offline tiny model for its hub id, a short run.
    fit = _readme_command("rloo-lightning fit --config configs/own_model.yaml --model.model_name_or_path")
    fit = [str(REPO / a) if a.startswith("configs/") else a for a in fit]
    fit[fit.index("--model.model_name_or_path") + 1] = "tiny:reverse"
    fit += ["--trainer.max_steps", "2", "--model.sampling.max_new_tokens", "8"]
    _run("fit", fit, tmp_path, env)
    assert (tmp_path / "lightning_logs/version_0/checkpoints/last.ckpt").is_file()

    # test, predict, export: the README's commands verbatim. test and predict log beside the run they evaluate, not
    # among the fit runs of the working folder, and their last line says where.
    run = tmp_path / "lightning_logs" / "version_0"
    test = _run("test", _readme_command("rloo-lightning test --ckpt_path"), tmp_path, env)
    assert "test/reward" in test.stdout + test.stderr
    assert test.stdout.splitlines()[-1] == f"test done: logs {run / 'test' / 'version_0'}", test.explain()
    predict = _run("predict", _readme_command("rloo-lightning predict --ckpt_path"), tmp_path, env)
    predictions = run / "predict" / "version_0" / "predictions.jsonl"
    assert predict.stdout.splitlines()[-1] == (f"predict done: predictions {predictions} | logs "
                                               f"{predictions.parent}"), predict.explain()
    assert [p.name for p in (tmp_path / "lightning_logs").iterdir()] == ["version_0"]
    written = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert [r["prompt"] for r in written] == [r["prompt"] for r in rows[44:]]
    assert all(r["reward"] in (0.0, 1.0) and set(r["scores"]) == {"correct"} for r in written)
    export = _run("export", _readme_command("rloo-lightning export --ckpt_path"), tmp_path, env)
    assert "my_model" in export.stdout

    # The export loads with plain transformers and generates.
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "my_model")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "my_model")
    ids = tokenizer(rows[44]["prompt"], return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_the_vllm_pages_small_model_is_one_vllms_cpu_build_takes(tmp_path, monkeypatch):
    """docs/vllm.md's small model, built as the page shows it (vLLM itself is not needed): it is saved, loads as a
    model and tokenizer, has a head size vLLM's CPU attention supports, and its tokenizer writes the quickstart's
    prompts (which the page's fit trains it on) without an unknown token."""
    from rloo_lightning.models import load_causal_lm, load_tokenizer
    from rloo_lightning.engines.vllm import CPU_HEAD_SIZES

    page = (REPO / "docs" / "vllm.md").read_text()
    (script,) = [b for b in _blocks("python", page) if b.startswith("# small_model.py")]
    monkeypatch.chdir(tmp_path)
    exec(compile(script, "small_model.py", "exec"), {"__name__": "__main__"})
    model, tokenizer = load_causal_lm("small_model"), load_tokenizer("small_model")
    config = model.config
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert head >= 32 and head in CPU_HEAD_SIZES, head
    fit = [c for b in _blocks("bash", page) for c in _commands(b) if c[:2] == ["rloo-lightning", "fit"]]
    assert fit and fit[0][fit[0].index("--model.model_name_or_path") + 1] == "small_model", fit
    for row in get_task("reverse").make_rows(32, seed=0):
        assert tokenizer.unk_token_id not in tokenizer(row["prompt"] + row["answer"])["input_ids"], row

