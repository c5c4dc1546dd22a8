"""The paper's ablations (Ahmadian et al. 2024, Table 1) on the embedded `reverse` task, at an equal sample budget.

    python -m experiments.ablations.ablations [--seeds 0 1 2] [--steps 400] [--completions 64] [--jobs 2]
        [--threads 1] [--runs rloo_k2 rloo_k4 ...] [--out experiments/ablations/ablations] [-- extra CLI args]

Reads TensorBoard scalars as experiments/quickstart_seeds/quickstart_seeds.py does. 18 fits of 400 steps (their wall
time, measured: see experiments/ablations/README.md).

Every run is `rloo-lightning fit --config configs/quickstart.yaml` with overrides, one CLI subprocess each:

    rloo_k2, rloo_k4, rloo_k8   leave-one-out baseline (the paper's RLOO), k = 2, 4, 8
    reinforce                   `--model.advantage.baseline none` (vanilla policy gradient), k = 4
    reinforce_ma                `--model.advantage.baseline moving_average` (REINFORCE w/ baseline), k = 4
    grpo_std                    `--model.advantage.baseline group_mean_std` (GRPO's advantage, no clip), k = 4

Equal sample budget: every run samples `--completions` completions per step (batch_size = completions / k
prompts) for the same number of steps, so completions seen are equal at every step. The group-mean baseline
(Dr.GRPO) is not a run: it is leave-one-out times (k-1)/k, a learning-rate change (a test shows the identity).

Validation uses the same prompts (`data.seed`), the same validation batches (`--data.val_batch_size` fixed for
every run, so the batch layout does not change with k) and the same sampler stream (`model.sampling.seed`) in
every run of a seed, so runs of one seed are compared on identical draws. `seed_everything`, `model.sampling.seed`
and `data.seed` are all set to the seed.

Writes `<out>.json` (curves, final values, mean +- std over seeds, commands, wall time) and `<out>.png`
(`--plot RECORD` redraws the figure of a record without running anything).
Defaults: two fits at a time (`--jobs 2`), one torch thread each (`--threads 1`, OMP/MKL_NUM_THREADS; 0 = torch's
default): faster than one at a time with torch's default threads, with identical val/reward values (measured: see
experiments/ablations/README.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.bench_common import scalar_curves

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

CONFIG = ROOT / "configs" / "quickstart.yaml"

# name -> (k, baseline, label)
RUNS: dict[str, tuple[int, str, str]] = {
    "rloo_k2": (2, "leave_one_out", "RLOO k=2"),
    "rloo_k4": (4, "leave_one_out", "RLOO k=4"),
    "rloo_k8": (8, "leave_one_out", "RLOO k=8"),
    "reinforce": (4, "none", "vanilla REINFORCE (k=4)"),
    "reinforce_ma": (4, "moving_average", "REINFORCE + moving-average baseline (k=4)"),
    "grpo_std": (4, "group_mean_std", "GRPO-std (k=4)"),
}
TAGS = ["val/reward", "val/accuracy_greedy", "val/reward_greedy"]


def cli() -> str:
    exe = Path(sys.executable).parent / "rloo-lightning"
    return str(exe) if exe.exists() else (shutil.which("rloo-lightning") or "rloo-lightning")


def command(name: str, seed: int, args: argparse.Namespace, extra: list[str]) -> list[str]:
    k, baseline, _ = RUNS[name]
    if args.completions % k:
        raise SystemExit(f"--completions {args.completions} is not a multiple of k={k}")
    return [cli(), "fit", "--config", str(CONFIG.relative_to(ROOT)),
            "--seed_everything", str(seed), "--model.sampling.seed", str(seed), "--data.seed", str(seed),
            "--model.sampling.k", str(k), "--model.advantage.baseline", baseline,
            "--data.batch_size", str(args.completions // k), "--data.val_batch_size", str(args.val_batch_size),
            "--trainer.max_steps", str(args.steps), "--trainer.val_check_interval", str(args.val_every),
            "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false", *extra]


def to_updates(step: int) -> int:
    """Lightning logs the validation after n updates at step n-1; the pass before training at step 0."""
    return 0 if step == 0 else step + 1


def run_one(name: str, seed: int, args: argparse.Namespace, extra: list[str]) -> dict:
    cmd = command(name, seed, args, extra)
    env = dict(os.environ)
    if args.threads > 0:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    with tempfile.TemporaryDirectory(prefix=f"abl_{name}_{seed}_") as tmp:
        start = time.perf_counter()
        run = [str(CONFIG) if a == str(CONFIG.relative_to(ROOT)) else a for a in cmd]  # cwd is the temp dir
        proc = subprocess.run([*run, "--trainer.default_root_dir", tmp], cwd=tmp, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wall = time.perf_counter() - start
        if proc.returncode:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"{name} seed {seed} failed (rc={proc.returncode})")
        curves = scalar_curves(Path(tmp) / "lightning_logs" / "version_0", TAGS)
    out = {"wall_s": round(wall, 1),
           "curves": {t: {str(to_updates(s)): round(v, 4) for s, v in c} for t, c in curves.items()}}
    out["final"] = {t: list(c.values())[-1] for t, c in out["curves"].items()}
    print(f"  {name:13s} seed {seed}: val/reward {list(out['curves']['val/reward'].values())} "
          f"({wall:.0f} s)", flush=True)
    return out


def auc(curve: dict[str, float]) -> float:
    """Trapezoid area under val/reward over updates, divided by the update range: the curve's mean."""
    pts = sorted((int(s), v) for s, v in curve.items())
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(pts, pts[1:]))
    return area / (pts[-1][0] - pts[0][0])


def mean_std(values: list[float]) -> dict:
    return {"mean": round(statistics.fmean(values), 4),
            "std": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0, "n": len(values)}


def compare(a: dict, b: dict, key: str, seeds_a: dict, seeds_b: dict) -> dict:
    """a - b: difference of means, its standard error (unpaired, sqrt(sa^2/n + sb^2/n)) and the paired one."""
    sa, sb = a[key], b[key]
    diff = sa["mean"] - sb["mean"]
    se = math.sqrt(sa["std"] ** 2 / sa["n"] + sb["std"] ** 2 / sb["n"])
    common = sorted(set(seeds_a) & set(seeds_b))
    pd = [seeds_a[s] - seeds_b[s] for s in common]
    pse = statistics.stdev(pd) / math.sqrt(len(pd)) if len(pd) > 1 else None
    return {"diff": round(diff, 4), "se": round(se, 4), "z": round(diff / se, 2) if se else None,
            "paired_se": None if pse is None else round(pse, 4),
            "paired_z": round(statistics.fmean(pd) / pse, 2) if pse else None,
            "a_wins_seeds": f"{sum(d > 0 for d in pd)}/{len(pd)}"}


def summarize(results: dict[str, dict[int, dict]]) -> tuple[dict, dict]:
    summary = {}
    per_seed = {}
    for name, seeds in results.items():
        fin = {s: r["final"]["val/reward"] for s, r in seeds.items()}
        areas = {s: auc(r["curves"]["val/reward"]) for s, r in seeds.items()}
        per_seed[name] = {"final": fin, "auc": areas}
        summary[name] = {"label": RUNS[name][2], "final_val_reward": mean_std(list(fin.values())),
                         "auc_val_reward": mean_std(list(areas.values()))}
        acc = [r["final"]["val/accuracy_greedy"] for r in seeds.values() if "val/accuracy_greedy" in r["final"]]
        if acc:
            summary[name]["final_val_accuracy_greedy"] = mean_std(acc)
    pairs = [("rloo_k4", "rloo_k2"), ("rloo_k8", "rloo_k4"), ("rloo_k4", "reinforce_ma"), ("rloo_k2", "reinforce_ma"),
             ("reinforce_ma", "reinforce"), ("rloo_k4", "reinforce"), ("rloo_k4", "grpo_std")]
    comparisons = {}
    for a, b in pairs:
        if a in summary and b in summary:
            comparisons[f"{a} - {b}"] = {
                key: compare(summary[a], summary[b], key + "_val_reward", per_seed[a][key], per_seed[b][key])
                for key in ("final", "auc")}
    return summary, comparisons


def plot(results: dict[str, dict[int, dict]], completions: int, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return False
    panels = [t for t in ("val/reward", "val/accuracy_greedy")
              if all(t in r["curves"] for seeds in results.values() for r in seeds.values())]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    for ax, tag in zip(axes[0], panels):
        for name, seeds in results.items():
            steps = sorted(int(s) for s in next(iter(seeds.values()))["curves"][tag])
            ys = np.array([[r["curves"][tag][str(s)] for s in steps] for r in seeds.values()])
            x = np.array(steps) * completions
            mean, std = ys.mean(0), ys.std(0, ddof=1) if len(ys) > 1 else np.zeros(len(steps))
            line, = ax.plot(x, mean, marker="o", ms=3, label=RUNS[name][2])
            ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.15)
        ax.set_xlabel(f"completions seen (= step x {completions})")
        ax.set_ylabel(tag + (" (sampled, T=1)" if tag == "val/reward" else " (greedy, exact match)"))
        ax.grid(alpha=0.3)
    n = len(next(iter(results.values())))
    axes[0][0].set_title(f"reverse task, equal sample budget; mean ± std over {n} seeds", fontsize=10)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per run (quickstart: 400)")
    parser.add_argument("--val_every", type=int, default=100, help="validation every N steps (quickstart: 100)")
    parser.add_argument("--completions", type=int, default=64, help="completions per step, the same for every run")
    parser.add_argument("--val_batch_size", type=int, default=16, help="validation prompts per batch, every run")
    parser.add_argument("--jobs", type=int, default=2, help="fits run at a time (1: one after the other, here)")
    parser.add_argument("--threads", type=int, default=1, help="OMP/MKL threads per fit; 0 = torch default")
    parser.add_argument("--out", default=str(HERE / "ablations"))
    parser.add_argument("--plot", type=Path, help="a record: redraw its figure beside it, and run nothing")
    argv = sys.argv[1:] if argv is None else argv
    args, extra = parser.parse_known_args(argv)
    if args.plot:
        record = json.loads(args.plot.read_text())
        runs = {name: {int(s): r for s, r in run["seeds"].items()} for name, run in record["runs"].items()}
        plot(runs, record["settings"]["completions_per_step"], args.plot.with_suffix(".png"))
        return
    extra = [a for a in extra if a != "--"]
    invocation = " ".join(["python", "experiments/ablations/ablations.py", *argv])

    jobs = [(name, seed) for seed in args.seeds for name in args.runs]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[int, dict]] = {name: {} for name in args.runs}
    start = time.perf_counter()

    def document(complete: bool) -> dict:
        done = {name: dict(sorted(seeds.items())) for name, seeds in results.items() if seeds}
        summary, comparisons = summarize(done)
        return {
            "task": "reverse (embedded), tiny:reverse, configs/quickstart.yaml",
            "invocation": invocation,
            "complete": complete,
            "total_wall_s": round(time.perf_counter() - start, 1),
            "settings": {"steps": args.steps, "val_every": args.val_every, "completions_per_step": args.completions,
                         "val_batch_size": args.val_batch_size, "seeds": args.seeds, "jobs": args.jobs,
                         "threads_per_fit": args.threads or "torch default", "extra_cli_args": extra,
                         "cpus": os.cpu_count()},
            "notes": ["curve keys are optimizer updates done (0 = before training); completions seen = updates x "
                      f"{args.completions}",
                      "val/reward: one sample per held-out prompt at T=1, same prompts and sampler stream for every "
                      "run of a seed; val/accuracy_greedy: greedy completion == answer",
                      "auc_val_reward: trapezoid area under val/reward over updates / number of updates (the "
                      "curve's mean)", "std: sample std over seeds (ddof=1)",
                      "comparisons a - b: se = sqrt(sa^2/n + sb^2/n) (unpaired); paired_se from per-seed "
                      "differences (runs of one seed share prompts and the validation stream)"],
            "summary": summary,
            "comparisons": comparisons,
            "runs": {name: {"label": RUNS[name][2],
                            "commands": {str(s): " ".join(command(name, s, args, extra)) for s in seeds},
                            "seeds": {str(s): r for s, r in seeds.items()}}
                     for name, seeds in done.items()},
        }

    def job(j: tuple[str, int]) -> None:
        name, seed = j
        r = run_one(name, seed, args, extra)
        with lock:  # a partial JSON after every run: an interrupted sweep keeps what it finished
            results[name][seed] = r
            out.with_suffix(".json").write_text(json.dumps(document(False), indent=1))

    lock = threading.Lock()
    if args.jobs == 1:
        for j in jobs:
            job(j)
    else:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            list(pool.map(job, jobs))
    doc = document(True)
    summary, comparisons = doc["summary"], doc["comparisons"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    plotted = plot(results, args.completions, out.with_suffix(".png"))
    print(json.dumps({"total_wall_s": doc["total_wall_s"], "summary": summary, "comparisons": comparisons,
                      "plot": str(out.with_suffix(".png")) if plotted else None}, indent=1))


if __name__ == "__main__":
    main()
