"""Does multi-turn RLOO learn to use an environment's reply? The embedded ``guess`` task, over seeds.

    python -m experiments.multiturn_learning.multiturn_learning --out RECORD        # 3 seeds x 3 arms
    python -m experiments.multiturn_learning.multiturn_learning --markdown RECORD   # the table of the README

(from the repository's root; this folder's record is ``multiturn.json``, its wall time in its README)

Three arms per seed, each the unchanged ``configs/multiturn.yaml`` run through the CLI (only the named options
change), with the seed in ``seed_everything``, ``model.sampling.seed`` and ``data.seed``:

* ``informative``: the environment replies with the first guess's right letters (the config as shipped);
* ``uninformative``: ``feedback: none``, a reply of ``?`` marks that tells nothing (the control);
* ``single_turn``: no environment; one guess scored against the hidden word (``rloo_lightning.tasks.guess.reward``),
  for twice the steps, so that it samples as many policy tokens as a two-turn run.

Held-out ``val/reward`` (new hidden words) at every validation, the wall time of each ``fit`` (the tiny model is
built before the first timed run), and the sampled policy tokens (the sum of ``train/policy_tokens`` or
``train/completion_length`` times the step's episodes). Prints JSON and writes it to ``--out``. Arguments after
``--`` go to every fit (after the arm's own).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_common import emit_json

ROOT = Path(__file__).resolve().parents[2]

CONFIG = ROOT / "configs" / "multiturn.yaml"
ARMS = {
    "informative": [],
    "uninformative": ["--model.environment.init_args.feedback", "none"],
    # no environment: one guess per sample, scored by the reward function; 2x the steps = the same policy tokens
    "single_turn": ["--model.environment.class_path", "null", "--model.rewards.funcs",
                    "[rloo_lightning.tasks.guess.reward]", "--trainer.max_steps", "1200",
                    "--trainer.val_check_interval", "200"],
}


def run(arm: str, seed: int, env: dict, extra: list[str] = ()) -> dict:
    from rloo_lightning.runtime.tensorboard_logs import read_scalars  # here: this process runs no model

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "rloo_lightning", "fit", "--config", str(CONFIG), "--seed_everything", str(seed),
               "--model.sampling.seed", str(seed), "--data.seed", str(seed), "--trainer.default_root_dir", tmp,
               "--trainer.enable_progress_bar", "false", *ARMS[arm], *extra]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        s = read_scalars(Path(tmp) / "lightning_logs" / "version_0")
    val = s["val/reward"]
    tokens_tag = "train/policy_tokens" if "train/policy_tokens" in s else "train/completion_length"
    episodes = 16 * 4  # data.batch_size x sampling.k of the config
    return {"arm": arm, "seed": seed, "wall_s": round(wall, 1),
            "val_reward": {str(k): v for k, v in sorted(val.items())},
            "start": val[min(val)], "final": val[max(val)], "steps": max(s["train/reward"]) + 1,
            "policy_tokens": round(sum(s[tokens_tag].values()) * episodes)}


def summarize(runs: list[dict]) -> dict:
    by = {(r["arm"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    out = {}
    for arm in ARMS:
        rows = [by[(arm, s)] for s in seeds if (arm, s) in by]
        if rows:
            out[arm] = {"final_mean": statistics.mean(r["final"] for r in rows),
                        "rise_min": min(r["final"] - r["start"] for r in rows),
                        "wall_s_max": max(r["wall_s"] for r in rows),
                        "policy_tokens_mean": statistics.mean(r["policy_tokens"] for r in rows)}
    paired = [by[("informative", s)]["final"] - by[("uninformative", s)]["final"] for s in seeds
              if ("informative", s) in by and ("uninformative", s) in by]
    if paired:
        out["informative_minus_uninformative"] = {"per_seed": paired, "min": min(paired),
                                                  "mean": statistics.mean(paired)}
    return out


def markdown(results: dict) -> str:
    lines = ["| arm | seed | val/reward at step 0 | final | rise | steps | policy tokens sampled | wall time |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        lines.append(f"| {r['arm'].replace('_', '-')} | {r['seed']} | {r['start']:.3f} | {r['final']:.3f} | "
                     f"{r['final'] - r['start']:+.3f} | {r['steps']} | {r['policy_tokens']:,} | {r['wall_s']:.0f} s |")
    d = results["summary"].get("informative_minus_uninformative")
    if d:
        lines += ["", "Informative minus uninformative final `val/reward`, paired by seed: "
                  + ", ".join(f"{x:+.3f}" for x in d["per_seed"]) + f" (mean {d['mean']:+.3f}, min {d['min']:+.3f})."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--markdown", type=Path, help="a results JSON: print its table")
    parser.add_argument("--cache", type=Path, help="a model cache to build the tiny model into or take it from "
                                                   "(default: a fresh one, so its build time is measured)")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return
    with tempfile.TemporaryDirectory() as fresh:
        env = {**os.environ, "RLOO_LIGHTNING_CACHE": str(args.cache or fresh)}
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "from rloo_lightning.tasks import get_task; "
                        "get_task('guess').tiny_model_dir()"], check=True, env=env)
        build = time.perf_counter() - start
        runs = []
        for seed in args.seeds:  # arms interleaved, so that a slow spell of the machine hits all of them
            for arm in args.arms:
                runs.append(run(arm, seed, env, extra))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    results = {"config": str(CONFIG.relative_to(ROOT)), "tiny_model_build_s": round(build, 1), "runs": runs,
               "summary": summarize(runs)}
    if extra:
        results["extra_cli_args"] = extra
    emit_json(results, args.out)


if __name__ == "__main__":
    main()
