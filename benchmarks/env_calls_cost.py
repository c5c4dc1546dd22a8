"""What guarding the environment calls costs: a turn's calls run through EnvCalls, serial and unguarded (the
baseline), each in a thread with a timeout (the default), and with 8 workers; printed as JSON.

    python -m benchmarks env_calls_cost [--calls 64] [--repeats 200] [--sleep-ms 0] [--out FILE]

``--sleep-ms``: each call waits that long (an environment that waits on a sandbox or a service), to show what
``environment.workers`` buys.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from rloo_lightning.environments.calls import EnvCalls


def measure(calls: EnvCalls, n: int, repeats: int, sleep_s: float) -> float:
    """Median seconds for one batch of ``n`` calls."""
    def call():
        if sleep_s:
            time.sleep(sleep_s)
        return 1

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        calls.run([call] * n)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=64, help="calls per batch (a step's episodes)")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--sleep-ms", type=float, default=0.0)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    sleep_s = args.sleep_ms / 1000
    repeats = args.repeats if not sleep_s else max(3, min(args.repeats, int(2 / (sleep_s * args.calls) + 1)))
    setups = {"serial, no timeout": EnvCalls(None, 1), "timeout, 1 worker (default)": EnvCalls(60.0, 1),
              "timeout, 8 workers": EnvCalls(60.0, 8)}
    out = {"calls": args.calls, "sleep_ms": args.sleep_ms, "repeats": repeats, "median_ms_per_batch": {},
           "overhead_us_per_call": {}}
    base = None
    for name, calls in setups.items():
        seconds = measure(calls, args.calls, repeats, sleep_s)
        base = seconds if base is None else base
        out["median_ms_per_batch"][name] = round(seconds * 1e3, 3)
        out["overhead_us_per_call"][name] = round((seconds - base) / args.calls * 1e6, 1)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
