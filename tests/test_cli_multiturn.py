"""Multi-turn episodes through the CLI: a resumed tool run replays its episodes bit-identically, and ranks whose
episodes take different numbers of turns train together under DDP and FSDP2 (2 CPU processes, gloo).

The resumed run is a tiny policy that writes calculator calls (``tool_helpers.build_tool_caller``), rewarded per
successful call, in ``multiturn_helpers.NoisyTools``: a ``ToolEnvironment`` whose tool messages end in a letter
drawn from the episode's seed, so a replay that reseeded the environment or ran a call differently would show.
The distributed runs use ``multiturn_helpers.Noisy`` (a letter from the seed after each turn). Every run is a
subprocess, started together where independent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_harness import CONFIGS, make_env, start_cli, wait_all
from rloo_lightning.runtime.tensorboard_logs import read_scalars
from run_helpers import _assert_same_tensors, _flat_tensors, _jsonl, _load
from tool_helpers import build_tool_caller

pytestmark = pytest.mark.slow  # distributed and resumed CLI subprocesses

TIMEOUT = 300
STEPS, RESUME_AT = 4, 2


# The quickstart model's context (32 tokens) would cut the third turn: the budget is set past it.
NOISY = ["--model.rewards.funcs", "[]", "--model.environment.class_path", "multiturn_helpers.Noisy",
         "--model.sampling.max_new_tokens", "4", "--model.environment.max_context_tokens", "64"]
TOOLS = ["--model.rewards.funcs", "[tool_helpers.successful_calls]",
         "--model.environment.class_path", "multiturn_helpers.NoisyTools",
         "--model.environment.init_args", json.dumps({"tools": ["rloo_lightning.environments.tools.calculator"]}),
         "--model.sampling.max_new_tokens", "8", "--trainer.limit_val_batches", "0",
         "--data.on_unreadable_prompt", "keep"]  # the tool caller reads every prompt as <unk> (tool_helpers)


def _args(root: Path, model: str, steps: int, *extra: str, config: str = "quickstart.yaml", env=NOISY) -> list[str]:
    return [
        "fit", "--config", str(CONFIGS / config),
        "--model.model_name_or_path", model,
        *env,
        "--model.environment.max_turns", "3",
        "--trainer.max_steps", str(steps),
        "--trainer.val_check_interval", str(steps),
        "--trainer.default_root_dir", str(root),
        "--trainer.enable_progress_bar", "false",
        "--data.num_train_rows", "40",
        "--data.num_val_rows", "4",
        "--data.batch_size", "4",
        *extra,
    ]


def _recorder(path: Path) -> list[str]:
    return ["--trainer.callbacks+=reliability_helpers.callbacks.RolloutRecorder", f"--trainer.callbacks.path={path}"]


def _every_step(dirpath: Path) -> list[str]:
    return ["--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            f"--trainer.callbacks.dirpath={dirpath}",
            "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_top_k=-1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, _cache_dir):
    env = make_env(_cache_dir)
    root = tmp_path_factory.mktemp("multiturn_runs")
    turns = json.dumps({"turns_by_rank": [1, 3], "log": str(root / "{}" / "turns.txt")})
    tool_model = root / "tool_caller"
    build_tool_caller(tool_model)
    a = start_cli("a", _args(root / "a", str(tool_model), STEPS, *_every_step(root / "a" / "ckpt"),
                             *_recorder(root / "a" / "rollouts.jsonl"), env=TOOLS), root / "a", env, timeout=TIMEOUT)
    distributed = {}
    for name, config, extra in (("ddp", "quickstart.yaml", ["--trainer.devices", "2", "--trainer.strategy", "ddp"]),
                                ("fsdp2", "fsdp2_cpu.yaml", [])):
        args = _args(root / name, tiny_model_dir, 3, "--model.environment.init_args", turns.replace("{}", name),
                     *_recorder(root / name / "rollouts.jsonl"), *extra, config=config)
        distributed[name] = start_cli(name, args, root / name, env, timeout=TIMEOUT)
    a.wait()  # the resume starts once its source run is done, beside the distributed runs
    ckpt = sorted((root / "a" / "ckpt").glob(f"epoch=*-step={RESUME_AT}.ckpt")) if a.rc == 0 else []
    b = start_cli("b", _args(root / "b", str(tool_model), STEPS, "--ckpt_path", str(ckpt[0]),
                             *_every_step(root / "b" / "ckpt"), *_recorder(root / "b" / "rollouts.jsonl"), env=TOOLS),
                  root / "b", env, timeout=TIMEOUT) if len(ckpt) == 1 else None
    wait_all(*distributed.values(), *([b] if b else []))
    a.check()
    assert len(ckpt) == 1
    return {"root": root, "a": a, "b": b, **distributed}


def test_a_resumed_tool_run_replays_its_calls_results_and_errors_bit_identically(runs):
    runs["b"].check()
    root = runs["root"]
    a = {r["global_step"]: r for r in _jsonl(root / "a" / "rollouts.jsonl")}
    b = _jsonl(root / "b" / "rollouts.jsonl")
    assert [r["global_step"] for r in b] == list(range(RESUME_AT, STEPS))
    for r in b:
        ref = a[r["global_step"]]
        assert (r["prompts"], r["transcripts"], r["rewards"]) == (ref["prompts"], ref["transcripts"], ref["rewards"])
    results = [m["content"] for r in b for t in r["transcripts"] for m in t if m["role"] == "tool"]
    assert any(not c.startswith("error (") for c in results)  # tool results were replayed,
    assert any(c.startswith("error (") for c in results)  # and tool errors
    assert any(x > 0 for r in b for x in r["rewards"])
    last = lambda run: _load(sorted((root / run / "ckpt").glob(f"epoch=*-step={STEPS}.ckpt"))[0])  # noqa: E731
    _assert_same_tensors(last("a")["state_dict"], last("b")["state_dict"], "final state_dict")
    _assert_same_tensors(_flat_tensors(last("a")["optimizer_states"]), _flat_tensors(last("b")["optimizer_states"]),
                         "final optimizer state")
    scalars_a = read_scalars(root / "a" / "lightning_logs" / "version_0")
    scalars_b = read_scalars(root / "b" / "lightning_logs" / "version_0")
    for tag in ("train/turns", "train/env_tokens", "train/reward", "train/loss", "train/tool_calls",
                "train/tool_errors"):
        assert all(scalars_b[tag][s] == scalars_a[tag][s] for s in range(RESUME_AT, STEPS)), tag


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_ranks_with_different_turn_counts_train_together(runs, name):
    runs[name].check()  # no deadlock (the harness kills a hung run at its timeout), exit 0
    lines = (runs["root"] / name / "turns.txt").read_text().split()
    taken = {}
    for rank, turns in zip(lines[::2], lines[1::2]):
        taken.setdefault(int(rank), set()).add(int(turns))
    assert taken[0] == {1}  # rank 0's episodes end after one turn
    assert max(taken[1]) == 3  # rank 1's go on for three (some cut earlier by a turn without EOS)
    assert "`max_steps=3` reached" in runs[name].stdout + runs[name].stderr
