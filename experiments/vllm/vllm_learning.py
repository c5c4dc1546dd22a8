"""Learning with vLLM as the rollout engine against the default engine, on the quickstart's task.

    # in the environment scripts/vllm_cpu_env.sh builds:
    python -m experiments.vllm.vllm_learning --out experiments/vllm/vllm_learning.json

The quickstart (``configs/quickstart.yaml``: reverse task, 16 prompts x k = 4, 8 new tokens) for ``--steps`` steps on
the task's model rebuilt with head size 32 (vLLM's CPU attention has no 16), per seed: once with the default engine
(exactly pi_theta, no correction) and once with ``VLLMEngine`` and its default correction (``correction.level:
auto``: token-level truncated importance weights, cap 2). ``val/reward`` (200 held-out prompts, k = 4) before
training and at the end. Two runs at a time, one thread each. Prints one JSON object; ``--out`` writes it too.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_common import emit_json

ROOT = Path(__file__).resolve().parents[2]

ENGINES = {"default": [], "vllm": ["--model.generation_engine", "rloo_lightning.engines.vllm.VLLMEngine"]}


def _val_rewards(log_dir: Path) -> dict[int, float]:
    from rloo_lightning.runtime.tensorboard_logs import read_scalars

    return read_scalars(log_dir)["val/reward"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--val-rows", type=int, default=200)
    parser.add_argument("--out")
    args = parser.parse_args()
    from rloo_lightning.tasks import reverse

    work = Path(tempfile.mkdtemp(prefix="vllm_learning_"))
    model = work / "reverse_h32"
    reverse.build_tiny_model(model, num_heads=2)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", RLOO_LIGHTNING_CACHE=str(work / "cache"))
    jobs = [(engine, seed) for seed in args.seeds for engine in ENGINES]
    runs, started = {}, time.time()
    for i in range(0, len(jobs), 2):
        procs = []
        for engine, seed in jobs[i : i + 2]:
            root = work / f"{engine}_{seed}"
            root.mkdir()
            cmd = [sys.executable, "-m", "rloo_lightning", "fit", "--config", str(ROOT / "configs/quickstart.yaml"),
                   "--model.model_name_or_path", str(model), "--trainer.max_steps", str(args.steps),
                   "--trainer.val_check_interval", str(args.steps), "--data.num_val_rows", str(args.val_rows),
                   "--seed_everything", str(seed), "--model.sampling.seed", str(seed),
                   "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root), *ENGINES[engine]]
            out = open(root / "log.txt", "w")
            procs.append((engine, seed, root, time.time(), subprocess.Popen(cmd, cwd=root, env=env, stdout=out,
                                                                            stderr=subprocess.STDOUT)))
        for engine, seed, root, t0, proc in procs:
            rc = proc.wait()
            if rc != 0:
                raise SystemExit(f"{engine} seed {seed} failed (rc {rc}): {(root / 'log.txt').read_text()[-3000:]}")
            val = _val_rewards(root / "lightning_logs" / "version_0")
            first, last = val[min(val)], val[max(val)]
            runs[f"{engine}/{seed}"] = {"engine": engine, "seed": seed, "val_reward_start": round(first, 4),
                                        "val_reward_end": round(last, 4), "rise": round(last - first, 4),
                                        "wall_s": round(time.time() - t0, 1)}
    summary = {e: {"mean_rise": round(sum(r["rise"] for r in runs.values() if r["engine"] == e) / len(args.seeds), 4),
                   "min_rise": min(r["rise"] for r in runs.values() if r["engine"] == e)} for e in ENGINES}
    import torch
    import vllm

    emit_json({"study": "vllm_learning", "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or
               platform.machine(), "cpus": os.cpu_count(), "versions": {"torch": torch.__version__,
                                                                         "vllm": vllm.__version__},
               "settings": {"steps": args.steps, "seeds": args.seeds, "val_rows": args.val_rows,
                            "config": "configs/quickstart.yaml", "model": "reverse task model, 2 heads of 32"},
               "summary": summary, "runs": runs, "wall_s": round(time.time() - started, 1)}, args.out)


if __name__ == "__main__":
    main()
