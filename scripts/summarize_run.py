"""Summarise a run's TensorBoard log as JSON: val metrics at each evaluation, train metrics over the
first and last 10 steps, and the median step time.

    python scripts/summarize_run.py lightning_logs/version_0 [--window 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

TRAIN = ["train/reward", "train/completion_length", "train/clipped_ratio", "train/kl", "train/entropy"]


def summarize(log_dir: str, window: int = 10) -> dict:
    from rloo_lightning.runtime.tensorboard_logs import read_events

    scalars = read_events(log_dir)
    tags = set(scalars)
    out: dict = {"log_dir": log_dir}
    for tag in sorted(t for t in tags if t.startswith("val/")):
        out[tag] = [(e.step, round(e.value, 4)) for e in scalars[tag]]
    for tag in TRAIN:
        if tag not in tags:
            continue
        events = scalars[tag]
        last = events[-1].step
        first_vals = [e.value for e in events if e.step < window]
        last_vals = [e.value for e in events if e.step > last - window]
        out[tag] = {f"mean_steps_0_{window - 1}": round(statistics.fmean(first_vals), 4),
                    f"mean_steps_{last - window + 1}_{last}": round(statistics.fmean(last_vals), 4)}
    if "train/reward" in tags:
        times = [e.wall_time for e in scalars["train/reward"]]
        gaps = [b - a for a, b in zip(times, times[1:])]
        out["steps"] = len(times)
        out["median_step_s"] = round(statistics.median(gaps), 2) if gaps else None
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log_dir")
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    text = json.dumps(summarize(args.log_dir, args.window), indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
