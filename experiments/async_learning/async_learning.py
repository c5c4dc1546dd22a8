"""Learning with a fixed lag K (``rollout.lag``) and vLLM as the rollout engine, on the quickstart's task.

    # in the environment scripts/vllm_cpu_env.sh builds:
    python -m experiments.async_learning.async_learning --out experiments/async_learning/async_learning.json

The quickstart (``configs/quickstart.yaml``: reverse task, 16 prompts x k = 4, 8 new tokens, beta 0.05, lr 1e-3) for
``--steps`` steps on the task's model rebuilt with head size 32 (vLLM's CPU attention has no 16), with
``VLLMEngine`` (its default correction: with K >= 1 ``correction.level: auto`` is token-level truncated importance
weights, cap 2; with K = 0 the same, vLLM being another sampler), for each K of ``--lags`` and each seed:
``val/reward`` (``--val-rows`` held-out prompts, k = 4, sampled by vLLM from the current weights) before training
and at the last step, the mean of ``train/mismatch/kl_k3`` over the run (how far the sampler was from pi_theta: the
staleness plus vLLM's own kernels), the mean ``train/staleness`` and the run's wall time. ``--corrections`` names
``model.correction`` settings (:data:`CORRECTIONS`): each K >= 1 runs with each, K = 0 with the first; or LoRA
policies synced as adapters or merged (``lora8-adapter lora8-merged``: every K with each). Runs two at a
time at most (a new one starts when one ends), one thread each for the trainer and for the engine's child; before
each start the script waits while the 1-minute load is above ``--max-load`` (at most ``--load-wait`` seconds). Prints
one JSON object; ``--out`` writes it too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_common import emit_json

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ["--model.generation_engine", "rloo_lightning.engines.vllm.VLLMEngine",
          "--model.generation_engine.threads", "1"]
_LORA = ["--model.policy.lora", '{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", '
         '"o_proj", "gate_proj", "up_proj", "down_proj"]}', "--model.optimizer.init_args.lr", "3e-3"]
#: The settings ``--corrections`` can name: ``model.correction`` options (docs/correction.md), and a LoRA policy (rank
#: 8 on every projection, lr 3e-3) whose adapter is synced alone or merged (``lora_sync``; the default correction).
CORRECTIONS = {
    "default": [],  # level auto: token TIS, cap 2
    "none": ["--model.correction.level", "none"],
    "sequence": ["--model.correction.level", "sequence", "--model.correction.cap", "null"],
    "seq_tis2": ["--model.correction.level", "sequence", "--model.correction.cap", "2"],
    "topr": ["--model.correction.level", "topr"],
    "geometric2": ["--model.correction.level", "geometric", "--model.correction.cap", "2"],
    "lora8-adapter": [*_LORA, "--model.generation_engine.lora_sync", "adapter"],
    "lora8-merged": [*_LORA, "--model.generation_engine.lora_sync", "merged"],
}


def _scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from rloo_lightning.runtime.tensorboard_logs import read_scalars

    return read_scalars(log_dir)


def _command(model: Path, root: Path, lag: int, seed: int, args, correction: str = "default") -> list[str]:
    return [sys.executable, "-m", "rloo_lightning", "fit", "--config", str(ROOT / "configs/quickstart.yaml"),
            "--model.model_name_or_path", str(model), "--trainer.max_steps", str(args.steps),
            "--trainer.val_check_interval", str(args.steps), "--data.num_val_rows", str(args.val_rows),
            "--seed_everything", str(seed), "--model.sampling.seed", str(seed),
            "--model.rollout.lag", str(lag),
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root), *ENGINE,
            *CORRECTIONS[correction]]


def _record(lag: int, seed: int, root: Path, wall: float, load: float | None, correction: str = "default") -> dict:
    scalars = _scalars(root / "lightning_logs" / "version_0")
    val = scalars["val/reward"]
    first, last = val[min(val)], val[max(val)]
    kl = list(scalars.get("train/mismatch/kl_k3", {}).values())
    stale = list(scalars.get("train/staleness", {}).values())
    reward = scalars.get("train/reward", {})
    tail = [reward[s] for s in sorted(reward)[-10:]]
    return {"lag": lag, "correction": correction, "seed": seed, "val_reward_start": round(first, 4),
            "val_reward_end": round(last, 4),
            "rise": round(last - first, 4), "val_steps": [min(val), max(val)],
            "mean_mismatch_kl_k3": round(statistics.fmean(kl), 6) + 0.0 if kl else None,  # + 0.0: no -0.0
            "mean_staleness": round(statistics.fmean(stale), 3) if stale else 0.0,
            "train_reward_last10": round(statistics.fmean(tail), 4) if tail else None,
            "wall_s": round(wall, 1), "load1_at_start": load}


def _key(lag: int, name: str, seed: int | None, args) -> str:
    """A run's key in the record: ``K<lag>/<seed>`` with the default correction alone (the first records),
    ``K<lag>/<correction>/<seed>`` otherwise; without the seed, its summary's."""
    parts = [f"K{lag}"] + ([name] if args.corrections != ["default"] else []) + ([str(seed)] if seed is not None
                                                                                  else [])
    return "/".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--corrections", nargs="+", default=["default"], choices=sorted(CORRECTIONS),
                        help="each K's runs with each of these settings (K = 0 with the first alone, unless every one "
                             "is a LoRA setting)")
    parser.add_argument("--val-rows", type=int, default=200)
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--max-load", type=float, default=0.7,
                        help="before each start, wait while the 1-minute load (less this script's own runs) is above "
                             "this")
    parser.add_argument("--load-wait", type=float, default=1200.0, help="seconds to wait for it at most, per start")
    parser.add_argument("--out")
    args = parser.parse_args()
    from benchmarks.async_step import load1
    from rloo_lightning.tasks import reverse

    work = Path(tempfile.mkdtemp(prefix="async_learning_"))
    model = work / "reverse_h32"
    reverse.build_tiny_model(model, num_heads=2)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               RLOO_LIGHTNING_CACHE=str(work / "cache"))
    lora = all(name.startswith("lora") for name in args.corrections)  # LoRA runs: every setting at every K
    jobs = [(lag, name, seed) for seed in args.seeds for lag in args.lags
            for name in (args.corrections if lag or lora else args.corrections[:1])]
    runs, running, started = {}, [], time.time()

    def finish(job) -> None:
        lag, name, seed, root, t0, proc, load, log = job
        rc = proc.wait()
        log.close()
        if rc != 0:
            raise SystemExit(f"K={lag} {name} seed {seed} failed (rc {rc}): {(root / 'log.txt').read_text()[-3000:]}")
        key = _key(lag, name, seed, args)
        runs[key] = _record(lag, seed, root, time.time() - t0, load, name)
        print(f"[async_learning] {key}: {runs[key]}", file=sys.stderr)

    while jobs or running:
        while jobs and len(running) < args.parallel:
            # the load less the runs of this script (each keeps about one core busy)
            deadline = time.monotonic() + args.load_wait
            load = load1()
            while (load is not None and load - len(running) > args.max_load and time.monotonic() < deadline
                   and not running):
                print(f"[async_learning] load {load:.2f} > {args.max_load}: waiting 60 s", file=sys.stderr)
                time.sleep(60)
                load = load1()
            lag, name, seed = jobs.pop(0)
            root = work / f"k{lag}_{name}_{seed}"
            root.mkdir()
            log = open(root / "log.txt", "w")
            proc = subprocess.Popen(_command(model, root, lag, seed, args, name), cwd=root, env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
            running.append((lag, name, seed, root, time.time(), proc, load, log))
        time.sleep(0.5)
        for job in [j for j in running if j[5].poll() is not None]:
            running.remove(job)
            finish(job)

    summary = {}
    for lag, name in sorted(dict.fromkeys((r["lag"], r["correction"]) for r in runs.values())):
        mine = [r for r in runs.values() if (r["lag"], r["correction"]) == (lag, name)]
        summary[_key(lag, name, None, args)] = {
            "mean_start": round(statistics.fmean(r["val_reward_start"] for r in mine), 4),
            "mean_end": round(statistics.fmean(r["val_reward_end"] for r in mine), 4),
            "mean_rise": round(statistics.fmean(r["rise"] for r in mine), 4),
            "min_rise": min(r["rise"] for r in mine), "max_rise": max(r["rise"] for r in mine),
            "mean_mismatch_kl_k3": round(statistics.fmean(r["mean_mismatch_kl_k3"] for r in mine), 6) + 0.0,
            "sd_rise": round(statistics.stdev(r["rise"] for r in mine), 4) if len(mine) > 1 else None,
            "mean_wall_s": round(statistics.fmean(r["wall_s"] for r in mine), 1)}
    import torch
    import vllm

    from benchmarks.vllm_compare import _device_name

    emit_json({"study": "async_learning", "date": time.strftime("%Y-%m-%d"), "machine": _device_name(False),
               "cpus": os.cpu_count(), "versions": {"torch": torch.__version__, "vllm": vllm.__version__},
               "settings": {"steps": args.steps, "lags": args.lags, "seeds": args.seeds, "val_rows": args.val_rows,
                            "config": "configs/quickstart.yaml", "model": "reverse task model, 2 heads of 32",
                            "engine": "VLLMEngine(threads=1)",
                            "corrections": {n: CORRECTIONS[n] for n in args.corrections},
                            "threads": "1 trainer + 1 engine per run", "parallel": args.parallel,
                            "max_load": args.max_load},
               "summary": summary, "runs": dict(sorted(runs.items())), "wall_s": round(time.time() - started, 1)},
              args.out)


if __name__ == "__main__":
    main()
