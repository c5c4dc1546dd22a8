"""Start-up cost of a prompt set's size: time from process start to the end of step 1, and peak RSS.

    python -m benchmarks data_scale [--rows 1000 1000000] [--reps 2] [--smollm2 DIR] \
        [--out benchmarks/results/data_scale.json]

For each size, a JSONL file of the tiny model's task (``reverse``, ``make_rows(n, 0)``) is written once (not
timed). Each measured run is a fresh ``rloo-lightning fit`` process with ``configs/quickstart.yaml``, the
file as ``data.train_file`` (``val_size`` 0.1), ``max_steps 1`` and validation off. A run is either a
*first start* (an empty prompt cache: the cache is built) or a *second start* (the cache the first one
built). The clock runs from just before the process is spawned to the end of the first training batch
(``on_train_batch_end``, written by a callback); the peak RSS is the child's own (``wait4``). The runs are
interleaved by repetition, and the tiny model is built before any of them.

Targets (against the smallest size): a first start within 60 s more, a second start within 15 s more, and at
most 200 MB more peak RSS in both. ``--smollm2 DIR`` adds SmolLM2-135M-Instruct (a Hugging Face directory; its
chat template applies) on the arithmetic task at each size, first start only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_common import QUICKSTART, child_env, emit_json

ROOT = Path(__file__).resolve().parents[1]

SMOLLM2_CONFIG = ROOT / "configs" / "smollm2_arithmetic.yaml"


def _step_one_callback():
    import lightning.pytorch as L

    class StepOneClock(L.Callback):
        """Writes ``time.time()`` at the end of the first training batch to ``path``."""

        def __init__(self, path: str) -> None:
            self.path = path

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if not Path(self.path).exists():
                Path(self.path).write_text(json.dumps({"step1_end": time.time()}))

    return StepOneClock


def __getattr__(name: str):  # `benchmarks.data_scale.StepOneClock` as a callback class path, built on use
    if name == "StepOneClock":
        return _step_one_callback()
    raise AttributeError(name)


def write_task_file(task: str, n: int, path: Path) -> None:
    from rloo_lightning.tasks import get_task

    with path.open("w") as f:
        for row in get_task(task).make_rows(n, 0):
            f.write(json.dumps(row) + "\n")


def run_once(config: Path, train_file: Path, cache_dir: Path, workdir: Path, extra: list[str], threads: int) -> dict:
    clock = workdir / "step1.json"
    clock.unlink(missing_ok=True)
    args = [sys.executable, "-m", "rloo_lightning", "fit", "--config", str(config), "--data.task", "null",
            "--data.train_file", str(train_file), "--data.cache_dir", str(cache_dir), "--data.val_size", "0.1",
            "--data.num_train_rows", "null", "--data.num_val_rows", "null",
            "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", "--trainer.enable_checkpointing", "false",
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
            "--trainer.callbacks+=benchmarks.data_scale.StepOneClock", f"--trainer.callbacks.path={clock}", *extra]
    env = child_env(threads)  # the repository's root on the import path: the callback's package
    log = (workdir / "run.log").open("w")
    start = time.time()
    proc = subprocess.Popen(args, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)
    log.close()
    if os.waitstatus_to_exitcode(status) != 0 or not clock.exists():
        raise SystemExit(f"run failed: {' '.join(args)}\n{(workdir / 'run.log').read_text()[-3000:]}")
    end = json.loads(clock.read_text())["step1_end"]
    return {"start_to_step1_s": round(end - start, 2), "peak_rss_mb": round(usage.ru_maxrss / 1024)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1000, 1_000_000])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smollm2", help="a SmolLM2-135M-Instruct Hugging Face directory (adds its runs)")
    parser.add_argument("--workdir", help="default: a temporary folder, removed at the end")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--no-warmup", action="store_true",
                        help="no untimed run first (the tiny model must be built already: it would be timed)")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="data_scale_"))
    workdir.mkdir(parents=True, exist_ok=True)
    files = {}
    for task in ["reverse"] + (["arithmetic"] if args.smollm2 else []):
        for n in args.rows:
            files[task, n] = workdir / f"{task}_{n}.jsonl"
            if not files[task, n].exists():
                write_task_file(task, n, files[task, n])
    # The tiny model is built (and the interpreter's files cached) before anything is timed.
    if not args.no_warmup:
        run_once(QUICKSTART, files["reverse", args.rows[0]], workdir / "warmup_cache", workdir, [], args.threads)
    runs: dict[str, list[dict]] = {}
    for rep in range(args.reps):
        for n in args.rows:
            cache = workdir / f"cache_{n}_{rep}"
            shutil.rmtree(cache, ignore_errors=True)
            for start in ("first", "second"):
                result = run_once(QUICKSTART, files["reverse", n], cache, workdir, [], args.threads)
                runs.setdefault(f"tiny {n} {start}", []).append(result)
                print(json.dumps({"rows": n, "start": start, "rep": rep, **result}), file=sys.stderr, flush=True)
            shutil.rmtree(cache, ignore_errors=True)
    if args.smollm2:
        for n in args.rows:
            cache = workdir / f"cache_smollm2_{n}"
            shutil.rmtree(cache, ignore_errors=True)
            extra = ["--model.model_name_or_path", args.smollm2, "--model.policy.gguf_file", "null"]
            result = run_once(SMOLLM2_CONFIG, files["arithmetic", n], cache, workdir, extra, args.threads)
            runs.setdefault(f"smollm2 {n} first", []).append(result)
            print(json.dumps({"smollm2": True, "rows": n, **result}), file=sys.stderr, flush=True)
            shutil.rmtree(cache, ignore_errors=True)

    def median(key, field):
        values = [r[field] for r in runs.get(key, [])]
        return round(statistics.median(values), 2) if values else None

    small, large = args.rows[0], args.rows[-1]
    summary = {}
    for start, limit_s in (("first", 60), ("second", 15)) if args.reps else ():
        dt = median(f"tiny {large} {start}", "start_to_step1_s") - median(f"tiny {small} {start}", "start_to_step1_s")
        drss = median(f"tiny {large} {start}", "peak_rss_mb") - median(f"tiny {small} {start}", "peak_rss_mb")
        summary[f"{start}_start"] = {"extra_s": round(dt, 2), "target_extra_s": limit_s, "met_s": dt <= limit_s,
                                     "extra_rss_mb": drss, "target_extra_rss_mb": 200, "met_rss": drss <= 200}
    if args.smollm2:
        summary["smollm2_first_start_extra_s"] = round(
            median(f"smollm2 {large} first", "start_to_step1_s")
            - median(f"smollm2 {small} first", "start_to_step1_s"), 2)
        summary["smollm2_first_start_extra_rss_mb"] = (
            median(f"smollm2 {large} first", "peak_rss_mb") - median(f"smollm2 {small} first", "peak_rss_mb"))
    sizes = {n: files["reverse", n].stat().st_size for n in args.rows}
    emit_json({"rows": args.rows, "file_bytes": sizes, "reps": args.reps, "threads": args.threads,
               "median": {k: {f: median(k, f) for f in ("start_to_step1_s", "peak_rss_mb")} for k in runs},
               "runs": runs, "summary": summary}, args.out)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
