"""This machine's limits, and the floors they put under a rollout's phases for the benchmark's shapes.

    python -m benchmarks machine_limits                 # SmolLM2-135M shapes (4 prompts x k = 4, 48 new tokens)
    python -m benchmarks machine_limits --params 2.3e5  # another model size (parameters)

Measures, with every thread torch uses (``--threads``):

- memory bandwidth: the best of ``--reps`` reads of a 1 GiB fp32 tensor (``--bandwidth-mib``; ``sum``, which
  streams it once)
  and copies (``copy_``: one read and one write), in GB/s;
- matmul throughput: the best of ``--reps`` ``[m, 576] x [576, 1536]`` matmuls (SmolLM2's hidden and MLP
  widths) at ``m`` = 16 rows (one decode step of the benchmark) and ``m`` = 16 x 96 rows (a forward over
  its whole rollout), in fp32 and (where the CPU has native bf16) bf16, in GFLOP/s.

and derives, for a decoder of ``--params`` parameters (weights in fp32 unless ``--bytes-per-param``):

- one decode step's floor: ``max(weight bytes / bandwidth, 2 * params * rows / decode matmul rate)``
  (every weight is read once per step; every row costs 2 FLOPs per parameter);
- a generation's floor: ``max_new_tokens`` decode steps (the prefill is small beside them here);
- the update's floor: forward + backward of the policy, ``6 * params * tokens`` FLOPs at the large-matmul
  rate, and the reference forward, ``2 * params * tokens``.

Attention and the LM head's softmax are left out (small at these lengths), so each floor is a lower bound:
a phase can approach it, never beat it. The update's floor is only as right as ``--prompt-tokens`` and
``--max-new-tokens`` are for the real rollout (padding trimmed, completions that end early): pass the
measured token counts. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

HIDDEN, MLP = 576, 1536  # SmolLM2-135M's widths


def _best(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bandwidth(reps: int, mib: int = 1024) -> dict:
    x = torch.ones(mib * 256 * 1024)  # 1 GiB of fp32 by default: far beyond any cache
    y = torch.empty_like(x)
    nbytes = x.numel() * 4
    read = nbytes / _best(lambda: x.sum(), reps) / 1e9
    copy = 2 * nbytes / _best(lambda: y.copy_(x), reps) / 1e9
    return {"read_GBps": round(read, 2), "copy_GBps": round(copy, 2)}


def matmul_rate(rows: int, dtype: torch.dtype, reps: int, calls: int = 2000) -> float:
    a = torch.randn(rows, HIDDEN, dtype=dtype)
    b = torch.randn(HIDDEN, MLP, dtype=dtype)
    inner = max(1, calls // max(1, rows // 16))  # enough work per timing to be above the clock's noise

    def run():
        for _ in range(inner):
            torch.mm(a, b)

    return 2 * rows * HIDDEN * MLP * inner / _best(run, reps) / 1e9


def measure(decode_rows: int, update_rows: int, reps: int = 5, bf16: bool = False, bandwidth_mib: int = 1024,
            matmul_calls: int = 2000) -> dict:
    """This machine's read bandwidth and fp32 (and, with ``bf16``, bf16) matmul rates at ``decode_rows`` and
    ``update_rows`` rows. bf16 is measured only where the CPU has it natively: emulated, it runs far slower than
    fp32 and a measurement takes minutes (measured: see benchmarks/generation.md)."""
    from rloo_lightning.engines import cpu_supports_bf16

    dtypes = [("fp32", torch.float32)] + ([("bf16", torch.bfloat16)] if bf16 and cpu_supports_bf16() else [])
    rates = {f"{name}_m{rows}": round(matmul_rate(rows, dtype, reps, matmul_calls), 1)
             for name, dtype in dtypes for rows in (decode_rows, update_rows)}
    return {"threads": torch.get_num_threads(), "torch": torch.__version__,
            "bandwidth": bandwidth(reps, bandwidth_mib),
            "matmul_GFLOPs": rates, "decode_rows": decode_rows, "update_rows": update_rows}


def phase_floors(limits: dict, params: float, prompt_tokens: float, completion_tokens: float, rows: int,
                 bytes_per_param: float = 4.0) -> dict:
    """Lower bounds (seconds) of one RLOO step's phases on this machine, for the work of one rollout.

    Args:
        limits: :func:`measure`'s result (its fp32 rates).
        params: decoder parameters.
        prompt_tokens: prompt positions that must be computed (the distinct prompts' tokens: a prompt shared by
            its k samples counts once).
        completion_tokens: sampled tokens of the rollout (all rows).
        rows: sequences decoded together (``N*k``).

    generation: every decode step reads all weights once (``steps >= completion_tokens / rows``) and costs
    ``2 * params`` FLOPs per live row, at the small-matmul rate; the prefill ``2 * params * prompt_tokens`` at the
    large-matmul rate. policy forward + backward: ``6 * params * tokens``; reference: ``2 * params * tokens``
    (``tokens = prompt_tokens + completion_tokens``); optimizer: AdamW reads parameter, gradient and two moments and
    writes three of them, ``7 * bytes_per_param * params`` bytes. Attention and the softmax are left out.
    """
    bw = limits["bandwidth"]["read_GBps"] * 1e9
    small = limits["matmul_GFLOPs"][f"fp32_m{limits['decode_rows']}"] * 1e9
    big = limits["matmul_GFLOPs"][f"fp32_m{limits['update_rows']}"] * 1e9
    steps = completion_tokens / max(rows, 1)
    decode = max(steps * params * bytes_per_param / bw, 2 * params * completion_tokens / small)
    tokens = prompt_tokens + completion_tokens
    return {"generation": decode + 2 * params * prompt_tokens / big,
            "policy_forward_backward": 6 * params * tokens / big,
            "reference": 2 * params * tokens / big,
            "optimizer": 7 * bytes_per_param * params / bw}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=134.5e6, help="decoder parameters (SmolLM2-135M: 134.5M)")
    parser.add_argument("--bytes-per-param", type=float, default=4.0)
    parser.add_argument("--rows", type=int, default=16, help="sequences decoded together (prompts x k)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=48, help="typical prompt length (the update's tokens)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--bandwidth-mib", type=int, default=1024, help="size of the tensor read for the bandwidth")
    parser.add_argument("--matmul-calls", type=int, default=2000, help="matmuls per timing at 16 rows")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = args.rows * (args.prompt_tokens + args.max_new_tokens)
    limits = measure(args.rows, tokens, args.reps, bf16=True, bandwidth_mib=args.bandwidth_mib,
                     matmul_calls=args.matmul_calls)
    bw, rates = limits["bandwidth"], limits["matmul_GFLOPs"]
    weight_bytes = args.params * args.bytes_per_param
    decode_memory = weight_bytes / (bw["read_GBps"] * 1e9)
    decode_compute = 2 * args.params * args.rows / (rates[f"fp32_m{args.rows}"] * 1e9)
    decode = max(decode_memory, decode_compute)
    big = rates[f"fp32_m{tokens}"] * 1e9
    report = {
        **limits,
        "shapes": {"params": args.params, "bytes_per_param": args.bytes_per_param, "rows": args.rows,
                   "max_new_tokens": args.max_new_tokens, "update_tokens": tokens},
        "floors_s": {
            "decode_step": round(decode, 5),
            "decode_step_bound_by": "memory" if decode_memory >= decode_compute else "compute",
            "decode_step_memory": round(decode_memory, 5),
            "decode_step_compute": round(decode_compute, 5),
            "generation": round(decode * args.max_new_tokens, 3),
            "policy_forward_backward": round(6 * args.params * tokens / big, 3),
            "reference_forward": round(2 * args.params * tokens / big, 3),
        },
    }
    print(json.dumps(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
