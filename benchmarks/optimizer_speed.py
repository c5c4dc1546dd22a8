"""torch's AdamW three ways on a policy's parameters: the per-tensor loop, ``foreach`` and ``fused``.

    python -m benchmarks optimizer_speed --model DIR         # SmolLM2 rebuilt by benchmarks/bench.py
    python -m benchmarks optimizer_speed --model tiny:reverse --reps 200

On CPU, ``torch.optim.AdamW(params, lr)`` runs its per-tensor loop (torch turns ``foreach`` on by default only on
accelerators): several small kernels per parameter tensor. ``foreach`` batches each op over the tensors, ``fused``
does the whole update in one kernel per tensor group. This times one ``optimizer.step()`` of each, interleaved
over ``--reps`` rounds, on the model's own parameters with fixed random gradients (lr and weight decay as the
configs: ``--lr``, torch's default 0.01), and checks that all three land on the same weights: after ``--steps``
steps from the same start, the largest absolute and relative difference of any parameter from the loop's.

Prints one JSON object (and writes it to ``--out``): median seconds per step for each, and the differences.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_common import emit_json


IMPLEMENTATIONS = {"loop": {"foreach": False, "fused": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _model_params(model_arg: str) -> list[torch.Tensor]:
    from rloo_lightning.models import load_causal_lm, resolve_model_path

    model = load_causal_lm(resolve_model_path(model_arg), dtype=torch.float32)
    return [p for p in model.parameters() if p.requires_grad]


def _optimizer(params: list[torch.Tensor], grads: list[torch.Tensor], kind: str, lr: float):
    """Detached copies of ``params`` with ``grads`` attached, and an AdamW of ``kind`` over them."""
    copies = [p.detach().clone().requires_grad_(True) for p in params]
    for c, g in zip(copies, grads):
        c.grad = g
    return copies, torch.optim.AdamW(copies, lr=lr, **IMPLEMENTATIONS[kind])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face directory or tiny:<task>")
    parser.add_argument("--lr", type=float, default=5e-6)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10, help="steps for the same-weights check")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    params = _model_params(args.model)
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=generator) * 1e-3 for p in params]

    # The same weights: --steps steps of each from the same start, with the same gradients.
    finals = {}
    for kind in IMPLEMENTATIONS:
        copies, opt = _optimizer(params, grads, kind, args.lr)
        for _ in range(args.steps):
            opt.step()
        finals[kind] = copies
    change = max(float((b - p).abs().max()) for b, p in zip(finals["loop"], params))  # the loop's largest move
    agreement = {}
    for kind in ("foreach", "fused"):
        abs_diff = max(float((a - b).abs().max()) for a, b in zip(finals[kind], finals["loop"]))
        agreement[kind] = {"max_abs_diff_vs_loop": abs_diff, "max_abs_change_loop": change,
                           "diff_over_change": abs_diff / change if change else None}
    del finals

    # Speed: one step of each, interleaved (the first step creates the state: warm-up, untimed).
    setups = {kind: _optimizer(params, grads, kind, args.lr) for kind in IMPLEMENTATIONS}
    for _, opt in setups.values():
        opt.step()
    seconds = {kind: [] for kind in IMPLEMENTATIONS}
    for _ in range(args.reps):
        for kind, (_, opt) in setups.items():
            start = time.perf_counter()
            opt.step()
            seconds[kind].append(time.perf_counter() - start)
    median = {kind: statistics.median(s) for kind, s in seconds.items()}
    emit_json({"model": args.model, "tensors": len(params), "params": sum(p.numel() for p in params),
               "threads": args.threads, "reps": args.reps, "torch": torch.__version__,
               "median_step_s": {k: round(v, 6) for k, v in median.items()},
               "speedup_vs_loop": {k: round(median["loop"] / v, 2) for k, v in median.items()},
               "same_weights": agreement}, args.out)


if __name__ == "__main__":
    main()
