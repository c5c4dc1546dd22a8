"""Repeat the quickstart for several seeds; print each seed's step-0 and final val/reward as JSON.

    python -m experiments.quickstart_seeds.quickstart_seeds [--seeds 0 1 2] [--out PATH] [-- extra CLI args]

Each run is the unchanged `configs/quickstart.yaml` with `seed_everything`, `model.sampling.seed` and
`data.seed` set to the seed. Writes `<out>.json` (each seed's validation curves, step-0 and final `val/reward`,
wall time) and, if matplotlib is installed, `<out>.png`; `--out` defaults to this folder's `quickstart_seeds`.
`--plot RECORD` redraws the figure of a record without running anything.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_common import record_json, scalar_curves

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

TAGS = ["val/reward", "val/reward_greedy"]  # what the table and the figure read


def run_seed(seed: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "rloo_lightning", "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"),
               "--seed_everything", str(seed), "--model.sampling.seed", str(seed), "--data.seed", str(seed),
               "--trainer.default_root_dir", tmp, "--trainer.enable_progress_bar", "false", *extra]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=tmp, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        curves = scalar_curves(Path(tmp) / "lightning_logs" / "version_0", TAGS)
    val = curves["val/reward"]
    return {"seed": seed, "wall_s": round(wall, 1), "val_reward_step0": round(val[0][1], 4),
            "val_reward_final": round(val[-1][1], 4), "gain": round(val[-1][1] - val[0][1], 4),
            "curves": {t: [(s, round(v, 4)) for s, v in c] for t, c in curves.items()}}


def plot(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in results:
        steps, values = zip(*r["curves"]["val/reward"])
        ax.plot(steps, values, marker="o", label=f"seed {r['seed']} val/reward")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("val/reward (sampled, T=1)")
    ax.set_title("quickstart: RLOO k=4 on the embedded reverse task")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default=str(HERE / "quickstart_seeds"))
    parser.add_argument("--plot", type=Path, help="a record: redraw its figure beside it, and run nothing")
    args, extra = parser.parse_known_args(argv)
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return
    extra = [a for a in extra if a != "--"]
    results = [run_seed(s, extra) for s in args.seeds]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(record_json(results) + "\n")
    plotted = plot(results, out.with_suffix(".png"))
    summary = {"runs": [{k: v for k, v in r.items() if k != "curves"} for r in results],
               "plot": str(out.with_suffix(".png")) if plotted else None}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
