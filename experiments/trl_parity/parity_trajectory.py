"""Ours and TRL's ``RLOOTrainer`` along one on-policy trajectory of the learning-parity run (SmolLM2, the
arithmetic task, ``configs/smollm2_arithmetic.yaml``): the same rollouts, the weights compared as the KL grows,
and whether each system's own sampler would have drawn the same rollout. Prints one JSON object.

    python -m experiments.trl_parity.parity_trajectory --hf-dir DIR [--steps 50] [--seed 0] [--out FILE]

``experiments/trl_parity/parity_fed_steps.py`` feeds both trainers rollouts sampled once from the *initial* policy,
where the policy is its own reference and the KL term of the reward is near 0. Here ours runs the learning-parity run
as it is (``rloo-lightning fit``, its own sampler, on-policy for ``--steps`` steps, the policy drifting to a
sequence KL of a few nats), and every rollout it trains on is recorded. TRL's ``RLOOTrainer`` then trains on
the same rollouts, step by step, with its own loop, KL, advantages, loss, optimizer and schedule:

- at each step TRL's ``_generate`` first samples the step's prompts from TRL's *current* weights with our
  engine and ours' seed of that step, and counts the rows equal to ours' (the two sampling streams are the
  same, so rows differ only where the weights' rounding difference moves a draw across a token boundary);
- it then returns ours' rollout (``--free``: its own samples instead, scored by the task's reward), and
  ``_calculate_rewards`` the task rewards of what it returned;
- at ``--compare-steps`` the weight change from the start is compared with ours' (relative difference,
  cosine), as in ``parity_fed_steps.py``.

Ours' engine reports its log-probs (``train/mismatch/*``), so the record also holds, at every step of the
trajectory, how far its sampling distribution is from the training forward's. With ``--score`` both final
models are scored by ``experiments/learning_parity/learning_parity.py``'s scorer (greedy, the held-out prompts of
its record).
"""

from __future__ import annotations

import argparse
import copy
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


STATE: dict = {}  # the recorded rollouts, the initial weights, the per-step records (one process)


def _trajectory_callback():
    from experiments.trl_parity import parity_fed_steps as fed
    _rows, _save_step = fed._rows, fed._save_step

    from rloo_lightning.callbacks import RolloutHook

    class Trajectory(RolloutHook):
        """Records the starting weights, every rollout ours trains on (and its sampling seed), and the weights at
        the compared steps."""

        def on_train_start(self, trainer, pl_module):
            STATE["init"] = {n: p.detach().clone() for n, p in pl_module.policy.named_parameters()}

        def on_rollout_end(self, trainer, pl_module, rollout):
            STATE.setdefault("generation_config", copy.deepcopy(pl_module.generation_config))
            STATE["rollouts"].append({
                "seed": pl_module.sampling_seed("train", pl_module.global_step),
                "prompt_ids": rollout.prompt_ids.cpu().clone(), "prompt_mask": rollout.prompt_mask.cpu().clone(),
                "completions": _rows(rollout.completion_ids.cpu(), rollout.completion_mask.cpu()),
                "rewards": rollout.rewards.float().cpu().clone(), "answer": list(rollout.columns["answer"]),
                "kl": rollout.kl.float().mean().item(), "mismatch": {
                    name: round(float(s) / max(float(n), 1.0), 8) for name, (s, n) in rollout.mismatch.items()}})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if pl_module.global_step in STATE["compare_steps"]:
                _save_step(pl_module.policy, STATE["work"] / f"ours_step{pl_module.global_step}.pt")

    return Trajectory


def __getattr__(name: str):  # `parity_trajectory.Trajectory` as a callback class path
    if name == "Trajectory":
        return _trajectory_callback()
    raise AttributeError(name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf-dir", required=True, help="a SmolLM2 HF directory, or 'gguf' to build one")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-steps", type=int, nargs="+", default=[1, 2, 5, 10, 20, 30, 40, 50])
    parser.add_argument("--free", action="store_true", help="TRL trains on its own samples, not ours' rollouts")
    parser.add_argument("--score", action="store_true", help="score both final models on held-out prompts")
    parser.add_argument("--eval-rows", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/parity_trajectory")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.steps not in args.compare_steps:
        parser.error("--compare-steps must include --steps (the final weights)")
    sys.modules.setdefault("parity_trajectory", sys.modules[__name__])  # the CLI's callback path: this STATE

    import torch

    torch.set_num_threads(args.threads)
    from experiments.learning_parity import learning_parity as lp
    CONFIG, _child, _hyper, _prepare_gguf, held_out_rows, trl_config = (
        lp.CONFIG, lp._child, lp._hyper, lp._prepare_gguf, lp.held_out_rows, lp.trl_config)
    from experiments.trl_parity import parity_fed_steps as fed
    _compare_deltas, _rows = fed._compare_deltas, fed._rows
    from transformers import TrainerCallback
    from trl import RLOOTrainer

    from benchmarks.bench_common import emit_json, reward_fn, stand_in
    from benchmarks.bench_trl import trl_dataset, trl_reward
    from rloo_lightning.cli import main as cli_main
    from rloo_lightning.engines.decode import DecodeLoopEngine
    from rloo_lightning.algo.logprobs import completion_mask
    from rloo_lightning.models import load_tokenizer

    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    hf_dir = _prepare_gguf(workdir, args.threads) if args.hf_dir == "gguf" else str(Path(args.hf_dir).resolve())
    h = _hyper()
    work = Path(tempfile.mkdtemp(dir=workdir))
    STATE.update(rollouts=[], compare_steps=set(args.compare_steps), work=work, trl=[], trl_log=[], samples=[])

    # -- ours: the learning-parity run (learning_parity.py's run_a), its rollouts recorded ------------------------
    s = str(args.seed)
    t0 = time.perf_counter()
    cli_main(["fit", "--config", str(CONFIG), "--model.model_name_or_path", hf_dir,
              "--model.policy.gguf_file", "null", "--trainer.max_steps", str(args.steps),
              "--trainer.limit_val_batches", "0", "--trainer.enable_checkpointing", "false",
              "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
              "--seed_everything", s, "--model.sampling.seed", s, "--data.seed", s,
              "--model.generation_engine", "rloo_lightning.engines.decode.DecodeLoopEngine",
              "--model.generation_engine.return_logprobs", "true",
              "--trainer.default_root_dir", str(work), "--trainer.callbacks+=parity_trajectory.Trajectory"])
    ours_s = time.perf_counter() - t0
    rollouts = STATE["rollouts"]
    if len(rollouts) != args.steps:
        raise SystemExit(f"ours recorded {len(rollouts)} rollouts for {args.steps} steps")

    # -- TRL: its trainer and loop on the same rollouts; its own draws counted ---------------------------------
    tokenizer = load_tokenizer(hf_dir)
    reward = reward_fn(h)
    engine, config = DecodeLoopEngine(), STATE["generation_config"]
    spec = dict(h, hf_dir=hf_dir, seed=args.seed, steps=args.steps)
    current: dict = {}

    def generate(prompts):
        r = rollouts[len(STATE["samples"])]
        trainer = current["trainer"]  # TRL's, built below
        model = trainer.accelerator.unwrap_model(trainer.model)
        with torch.no_grad():
            ids = engine.generate(model, tokenizer, r["prompt_ids"], r["prompt_mask"], config, r["seed"])
        eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        own = _rows(ids, completion_mask(ids, eos))
        own_texts = tokenizer.batch_decode(own, skip_special_tokens=True)
        own_rewards = torch.tensor(reward(None, own_texts, own, answer=r["answer"]), dtype=torch.float32)
        equal = sum(a == b for a, b in zip(own, r["completions"]))
        STATE["samples"].append({"rows_equal": equal, "rows": len(own),
                                 "own_reward": own_rewards.mean().item(), "ours_reward": r["rewards"].mean().item()})
        completions = own if args.free else r["completions"]
        current["rewards"] = own_rewards if args.free else r["rewards"]
        texts = own_texts if args.free else tokenizer.batch_decode(completions, skip_special_tokens=True)
        return (_rows(r["prompt_ids"], r["prompt_mask"]), completions,
                [[{"role": "assistant", "content": t}] for t in texts])

    class Record(TrainerCallback):
        def on_step_end(self, args_, state, control, model=None, **kwargs):
            if state.global_step in STATE["compare_steps"]:
                path = STATE["work"] / f"ours_step{state.global_step}.pt"
                STATE["trl"].append({"step": state.global_step, **_compare_deltas(path, model, STATE["init"])})
                if state.global_step == args.steps:
                    trl_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
                    torch.save(trl_state, work / "trl_final.pt")
                    final, first = torch.load(path), {}
                    ours_state = dict(trl_state)  # ours' final weights in TRL's state-dict layout, tied ones included
                    for n, p in model.named_parameters(remove_duplicate=False):
                        ours_state[n] = final[first.setdefault(id(p), n)]
                    torch.save(ours_state, work / "ours_final.pt")
                path.unlink()

        def on_log(self, args_, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                STATE["trl_log"].append({"kl": logs.get("kl"), "reward": logs.get("reward")})

    t0 = time.perf_counter()
    trainer = RLOOTrainer(model=hf_dir, reward_funcs=trl_reward(spec), args=trl_config(spec, work / "trl"),
                          train_dataset=trl_dataset(spec, tokenizer), processing_class=tokenizer, callbacks=[Record()])
    stand_in(trainer, "_generate", generate)  # TRL 1.16's signatures, checked
    stand_in(trainer, "_calculate_rewards",
             lambda inputs, prompts, completions, completion_ids_list: current["rewards"][:, None])
    current["trainer"] = trainer
    trainer.train()
    trl_s = time.perf_counter() - t0
    del trainer, current["trainer"]

    steps = []
    for i, (r, sample) in enumerate(zip(rollouts, STATE["samples"])):
        trl_kl = STATE["trl_log"][i]["kl"] if i < len(STATE["trl_log"]) else None
        steps.append({"step": i + 1, "ours_kl_mean": round(r["kl"], 5), "trl_kl_per_token": trl_kl,
                      "task_reward_mean": round(r["rewards"].mean().item(), 4), **sample, "mismatch": r["mismatch"]})
    equal = [s["rows_equal"] for s in STATE["samples"]]
    mismatch_k3 = [r["mismatch"].get("mismatch/kl_k3", float("nan")) for r in rollouts]
    out = {"hf_dir": hf_dir, "seed": args.seed, "steps_run": args.steps, "mode": "free" if args.free else "fed",
           "hyperparameters": h, "weights": STATE["trl"], "per_step": steps,
           "rows_equal_total": [sum(equal), sum(s["rows"] for s in STATE["samples"])],
           "first_step_with_a_different_row": next((i + 1 for i, s in enumerate(STATE["samples"])
                                                    if s["rows_equal"] < s["rows"]), None),
           "mismatch_kl_k3_max": max(mismatch_k3), "ours_wall_s": round(ours_s), "trl_wall_s": round(trl_s)}
    if args.score:
        rows = held_out_rows(args.eval_rows, [args.seed], h["num_train_rows"], h["task"])
        score_spec = {"hf_dir": hf_dir, "rows": rows, "reward": h["reward"], "threads": args.threads,
                      "max_new_tokens": h["max_new_tokens"], "batch": 100,
                      "snapshots": [None, str(work / "ours_final.pt"), str(work / "trl_final.pt")]}
        scored = _child("score", score_spec, workdir / "score", args.threads)["results"]
        start, ours, trl = (r["correct"] for r in scored)
        out["held_out"] = {"prompts": len(rows), "step0": statistics.fmean(start), "ours": statistics.fmean(ours),
                           "trl": statistics.fmean(trl), "prompts_scored_differently": sum(a != b for a, b in
                                                                                            zip(ours, trl))}
    shutil.rmtree(work)
    emit_json(out, args.out)


if __name__ == "__main__":
    main()
