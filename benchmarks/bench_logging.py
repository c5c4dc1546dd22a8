"""What logging a step's metrics costs in a Lightning loop: ``self.log`` per key against ``log_step_metrics``.

    python -m benchmarks bench_logging [--keys 12] [--steps 300] [--out FILE]     # prints one JSON object

A toy module (one parameter, no compute) runs ``--steps`` steps under a Trainer with a TensorBoard logger and the
progress bar, logging ``--keys`` values a step (two of them on the progress bar) three ways, each in a process of
its own, one thread: not at all, through ``self.log``, and through ``rloo_lightning.metrics.log_step_metrics``.
``ms_per_step`` is the median over steps after the first ``--skip`` (20), from batch start to batch start.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("none", "self_log", "log_step_metrics")


def child(mode: str, keys: int, steps: int, skip: int = 20) -> float:
    import statistics

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger

    from rloo_lightning.metrics import log_step_metrics

    torch.set_num_threads(1)
    shown = ("train/m0", "train/m1")

    class Toy(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            values = {f"train/m{i}": float(i + batch_idx) for i in range(keys)}
            if mode == "self_log":
                for name, value in values.items():
                    self.log(name, value, prog_bar=name in shown, batch_size=4)
            elif mode == "log_step_metrics":
                log_step_metrics(self.trainer, values, self.global_step, prog_bar=shown)
            return (self.w * 0).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader([0] * steps, batch_size=None)

    starts: list[float] = []

    class Clock(pl.Callback):
        def on_train_batch_start(self, *args) -> None:
            starts.append(time.perf_counter())

    trainer = pl.Trainer(max_steps=steps, logger=TensorBoardLogger(tempfile.mkdtemp()), log_every_n_steps=1,
                         enable_checkpointing=False, enable_model_summary=False, callbacks=[Clock()],
                         accelerator="cpu")
    trainer.fit(Toy())
    gaps = [b - a for a, b in zip(starts[skip:], starts[skip + 1:])]
    return statistics.median(gaps) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=12)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--skip", type=int, default=20, help="first steps left out of the median (start-up)")
    parser.add_argument("--child", choices=MODES)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.skip + 2 > args.steps:
        parser.error("--steps must exceed --skip by 2 at least (one gap between two step starts)")
    if args.child:
        print(json.dumps({"ms_per_step": child(args.child, args.keys, args.steps, args.skip)}))
        return
    out = {"keys": args.keys, "steps": args.steps, "skip": args.skip, "ms_per_step": {}}
    for mode in MODES:
        run = subprocess.run([sys.executable, __file__, "--child", mode, "--keys", str(args.keys),
                              "--steps", str(args.steps), "--skip", str(args.skip)],
                             capture_output=True, text=True, check=True)
        out["ms_per_step"][mode] = round(json.loads(run.stdout.strip().splitlines()[-1])["ms_per_step"], 3)
    base = out["ms_per_step"]["none"]
    out["ms_per_key"] = {m: round((out["ms_per_step"][m] - base) / args.keys, 3) for m in MODES[1:]}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
