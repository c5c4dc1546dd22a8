"""The benchmarks' one entry point: ``python -m benchmarks <name> [args]`` runs ``benchmarks/<name>.py`` with
``args``; each prints one JSON object (``--out FILE`` writes it too). ``python -m benchmarks`` lists them.

Run from the repository's root (``benchmarks`` is a folder of it, not an installed package). Every script also runs
as a module, ``python -m benchmarks.<name> [args]``, the same way.
"""

from __future__ import annotations

import importlib
import sys

# name -> what it measures; the scripts left out are helpers: bench_common (shared code), bench_trl and bench_bare
# (systems (b) and (c) of ``bench``, run by it in processes of their own), _memory_probe (memory_report's callback)
BENCHMARKS = {
    "bench": "step time, tokens/s and peak memory against TRL's RLOOTrainer and a bare PyTorch loop",
    "async_step": "fixed-lag asynchronous rollouts with VLLMEngine: step time per lag K and per trainer:engine thread "
                  "split",
    "machine_limits": "this machine's memory bandwidth and matmul rates, and the floors they put under each phase",
    "generation_speed": "generation variants one at a time (shared prefill, decode loop, static cache, compile, ...)",
    "update_speed": "the update's forwards: padded, shared prompts, packed",
    "optimizer_speed": "torch's AdamW three ways: the per-tensor loop, foreach, fused",
    "bench_logging": "what logging a step's metrics costs: self.log against log_step_metrics",
    "memory_report": "peak memory with LoRA, bf16, gradient checkpointing and micro-batches",
    "data_scale": "start-up time and peak memory at 1,000 and 1,000,000 prompts (the prompt cache)",
    "cache_check_cost": "what checking a prompt cache entry costs when it is opened",
    "env_calls_cost": "what guarding a multi-turn environment's calls costs (threads, timeouts, workers)",
    "threads_effect": "torch's CPU thread count against the quickstart's speed, idle and beside a busy process",
    "sync_transport": "moving weights to a generation server on a CPU: a safetensors folder against a gloo broadcast",
    "vllm_compare": "step time, generation time and tokens/s: the default engine, VLLMEngine, TRL's colocated vLLM",
    "checkpoint_cost": "seconds and bytes of one last.ckpt write against the step time (quickstart, SmolLM2)",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "list"):
        width = max(map(len, BENCHMARKS))
        print("usage: python -m benchmarks <name> [args]   (<name> --help: its options)\n")
        print("\n".join(f"  {name:{width}}  {what}" for name, what in BENCHMARKS.items()))
        return
    name, args = argv[0], argv[1:]
    if name not in BENCHMARKS:
        sys.exit(f"error: unknown benchmark {name!r}; one of: {', '.join(BENCHMARKS)}")
    sys.argv = [f"benchmarks/{name}.py", *args]  # what the script's own parser names in its messages
    importlib.import_module(f"benchmarks.{name}").main(args)


if __name__ == "__main__":
    main()
