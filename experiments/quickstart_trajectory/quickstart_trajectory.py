"""Run the unchanged quickstart once (fresh model cache) and record every logged scalar at full precision.

    python -m experiments.quickstart_trajectory.quickstart_trajectory --out RECORD      # record a trajectory
    python -m experiments.quickstart_trajectory.quickstart_trajectory --compare RECORD  # against a record, e.g.
        # experiments/quickstart_trajectory/quickstart_trajectory.json (this folder's)
    python -m experiments.quickstart_trajectory.quickstart_trajectory --markdown

Also prints ``fit_wall_s``, the wall time of the whole ``fit`` (start-up and model build included).
``--compare`` runs it again and reports, per tag, the largest absolute difference at any logged step
against the recorded file (0.0 everywhere = bit-identical trajectories). Prints JSON.

``--markdown`` prints, instead of the JSON, the quickstart table of this folder's README (:func:`markdown_table`: every
validation, rounded to 3 decimals, under a line naming this script, the package version and the CPU's kind
(vendor and torch kernel family, :func:`cpu_kind`), since only a CPU of the same kind reproduces a trajectory bit
for bit); the wall time, which is not deterministic, goes to stderr. ``tests/test_readme_figures.py`` checks
that this folder's README.md holds it verbatim.

Options of the fit after ``--`` are passed on (``-- --model.model_name_or_path DIR --model.generation_engine
rloo_lightning.engines.vllm.VLLMEngine``: the vLLM record of this folder's README, made with ``.venv-vllm``'s python).

``--max-steps N`` runs only the first N steps, with the full run's warm-up steps (the default schedule's warm-up is
a fraction of ``max_steps``; after it the rate is constant), so the logged values up to step N are the full run's
(the test suite checks the README's first rows this way). ``--cache DIR`` builds the tiny model into ``DIR``, or
takes the one a run of this package version built there (the test suite passes its session cache, whose model it
builds anyway); by default a fresh temporary cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VAL_TAGS = ["val/reward", "val/reward_greedy", "val/accuracy_greedy"]  # the table's columns, in order
TAGS = [*VAL_TAGS, "train/reward", "train/kl", "train/loss", "train/completion_length"]


def run(cache: Path | None = None, max_steps: int | None = None,
        fit_args: list[str] = ()) -> tuple[dict[str, list[list[float]]], float]:
    from benchmarks.bench_common import scalar_curves  # here: the tests import this file for markdown_table alone

    with tempfile.TemporaryDirectory() as tmp:
        # the tiny model built anew (or by this version, in ``cache``): never one of an older builder
        env = {**os.environ, "RLOO_LIGHTNING_CACHE": str(cache or Path(tmp) / "cache")}
        cmd = [sys.executable, "-m", "rloo_lightning", "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"),
               "--trainer.default_root_dir", tmp, "--trainer.enable_progress_bar", "false",
               *(_prefix_args(max_steps) if max_steps else []), *fit_args]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=tmp, env=env, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start  # the whole fit: start-up, building the tiny model (if new), the steps
        curves = scalar_curves(Path(tmp) / "lightning_logs" / "version_0", TAGS)
        return {t: [list(point) for point in curve] for t, curve in curves.items()}, wall


def _prefix_args(max_steps: int) -> list[str]:
    """``--trainer.max_steps N`` and the warm-up ratio that gives the full run's integer warm-up steps at N."""
    import yaml

    from rloo_lightning.config import UpdateArgs

    config = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    warmup = UpdateArgs(**config.get("model", {}).get("update", {})).warmup_steps(config["trainer"]["max_steps"])
    if warmup >= max_steps:
        raise SystemExit(f"--max-steps {max_steps} ends within the warm-up ({warmup} steps)")
    return ["--trainer.max_steps", str(max_steps), "--model.update.warmup_ratio", str((warmup + 0.5) / max_steps)]


def cpu_kind() -> str:
    """The CPU's vendor and the kernel family torch dispatches to on it, e.g. ``AuthenticAMD AVX2``. A sampled
    trajectory is reproduced bit for bit on a CPU of the same kind; elsewhere the kernels (torch's own, and the
    BLAS's, whose code paths and blocking depend on the CPU too) round differently and the trajectory diverges
    from the first sample that differs. Forcing the family alone (``ATEN_CPU_CAPABILITY=avx2``,
    ``MKL_ENABLE_INSTRUCTIONS=AVX2``, ``ONEDNN_MAX_CPU_ISA=AVX2`` on an Intel CPU) did not reproduce an AMD CPU's
    trajectory."""
    import platform

    import torch

    vendor = platform.processor() or "unknown"
    try:
        vendor = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("vendor_id"))
    except (OSError, StopIteration):
        pass
    return f"{vendor} {torch.backends.cpu.get_cpu_capability()}"


def markdown_table(curves: dict[str, list[list[float]]], version: str, cpu: str) -> str:
    """The quickstart table: a row per validation step, the ``VAL_TAGS`` in ``curves`` to 3 decimals,
    under a line naming the version and the :func:`cpu_kind` that produced it."""
    tags = [t for t in VAL_TAGS if t in curves]
    steps = [int(s) for s, _ in curves[tags[0]]]
    values = {t: {int(s): v for s, v in curves[t]} for t in tags}
    lines = [f"Produced by `python -m experiments.quickstart_trajectory.quickstart_trajectory --markdown` at "
             f"rloo_lightning {version} "
             f"(seed 0, fresh model cache, an x86-64 CPU: {cpu}):",
             "",
             "| step | " + " | ".join(f"`{t}`" for t in tags) + " |",
             "|---" * (len(tags) + 1) + "|"]
    lines += ["| " + " | ".join([str(s)] + [f"{values[t][s]:.3f}" for t in tags]) + " |" for s in steps]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compare", type=Path)
    parser.add_argument("--markdown", action="store_true", help="print the quickstart table instead of the JSON")
    parser.add_argument("--cache", type=Path, help="model cache to build into or reuse (default: a fresh one)")
    parser.add_argument("--max-steps", type=int, help="only the first N steps (default: the config's)")
    parser.add_argument("fit_args", nargs="*", help="after --: more options of the fit (e.g. another model and "
                        "--model.generation_engine rloo_lightning.engines.vllm.VLLMEngine)")
    args = parser.parse_args(argv)
    curves, wall = run(args.cache, args.max_steps, args.fit_args)
    if args.markdown:
        from rloo_lightning import __version__

        print(f"fit_wall_s: {wall:.1f}", file=sys.stderr)
        print(markdown_table(curves, __version__, cpu_kind()))
    report: dict = {"val/reward": curves["val/reward"], "fit_wall_s": round(wall, 1)}
    if args.out:
        from benchmarks.bench_common import record_json

        args.out.write_text(record_json({"cpu": cpu_kind(), **curves}) + "\n")
    if args.compare:
        recorded = json.loads(args.compare.read_text())
        diffs = {}
        if recorded.get("cpu") not in (None, cpu_kind()):
            report["note"] = (f"recorded on a {recorded['cpu']} CPU, run on a {cpu_kind()}: differences from "
                              "rounding are expected")
        for tag, points in recorded.items():
            if tag == "cpu":
                continue
            now = dict((s, v) for s, v in curves.get(tag, []))
            then = dict((s, v) for s, v in points)
            if set(now) != set(then):
                diffs[tag] = f"logged steps differ: {sorted(set(now) ^ set(then))[:10]}"
            else:
                diffs[tag] = max(abs(now[s] - then[s]) for s in then)
        report["max_abs_diff"] = diffs
    if not args.markdown:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
