"""The effect of torch's CPU threads on the quickstart's training speed, on an idle CPU and beside a busy process.

    python -m benchmarks threads_effect [--steps 200] [--threads 1 2] [--devices 1] [--no-neighbour] [--out FILE]

Runs the quickstart fit (validation off) once per (threads, neighbour) pair, with ``OMP_NUM_THREADS`` set (0: not
set, the package's own choice: the CPUs shared by the node's processes), on ``--devices`` CPU processes (DDP), and
reads the training speed from the TensorBoard events' wall times (steps ``--skip`` (20) to the last: start-up and
the first steps left out). The neighbour is one process spinning on one core for the whole run (another job on a shared
machine). Prints JSON: steps per second for each pair, the CPU count and the affinity.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPIN = "while True: pass"


def steps_per_second(threads: int, neighbour: bool, steps: int, devices: int = 1, skip: int = 20,
                     cache: Path | None = None) -> float:
    from rloo_lightning.runtime.tensorboard_logs import read_events

    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "RLOO_LIGHTNING_CACHE": str(cache or Path(tmp) / "cache")}
        env.pop("OMP_NUM_THREADS", None)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        cmd = [sys.executable, "-m", "rloo_lightning", "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"),
               "--trainer.default_root_dir", tmp, "--trainer.enable_progress_bar", "false", "--trainer.max_steps",
               str(steps), "--trainer.limit_val_batches", "0", "--model.validation.at_start", "false",
               *(["--trainer.strategy", "ddp", "--trainer.devices", str(devices)] if devices > 1 else [])]
        spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if neighbour else None
        try:
            subprocess.run(cmd, check=True, cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finally:
            if spinner is not None:
                spinner.kill()
        events = read_events(Path(tmp) / "lightning_logs" / "version_0")
        times = {e.step: e.wall_time for e in events["train/loss"]}
        first, last = skip, max(times)
        return (last - first) / (times[last] - times[first])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="0: OMP_NUM_THREADS not set")
    parser.add_argument("--devices", type=int, default=1, help="CPU processes (DDP)")
    parser.add_argument("--no-neighbour", action="store_true", help="only the idle runs")
    parser.add_argument("--skip", type=int, default=20, help="first steps left out of the speed (start-up)")
    parser.add_argument("--cache", type=Path, help="the tiny model's cache to reuse (default: built anew per run)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.skip >= args.steps - 1:
        parser.error("--steps must exceed --skip by 2 at least")
    out = {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "steps": args.steps,
           "devices": args.devices, "steps_per_second": {}}
    for neighbour in (False,) if args.no_neighbour else (False, True):
        for threads in args.threads:
            key = f"threads={threads or 'default'}, {'beside a busy process' if neighbour else 'idle'}"
            out["steps_per_second"][key] = round(steps_per_second(threads, neighbour, args.steps, args.devices,
                                                                  args.skip, args.cache), 2)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
