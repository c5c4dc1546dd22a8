"""Each system's own rollout pipeline from the same starting weights: ours (``PromptDataModule``, the module's
``sample`` and ``score``) against TRL's ``RLOOTrainer`` (its data loader, ``_generate``, its reward call on its own
decoded text). Prints one JSON object.

    python -m experiments.rollout_stats.rollout_stats --hf-dir DIR [--batches 40] [--seed 0] [--weights CKPT] \
        [--out FILE]

``experiments/trl_parity/parity_trajectory.py`` shows that the two trainers make the same model from the same rollouts,
with TRL's generation and reward calls replaced by ours. This script covers what that leaves out: each pipeline draws
``--batches`` batches of the learning-parity run (4 prompts x k = 4, 48 new tokens, temperature 0.7) of its own training
rows, from SmolLM2's starting weights (or from ``--weights``: a policy trained some steps, loaded into both pipelines'
models, so that they are compared where the policy has moved) and without training, and the statistics that shape an
RLOO update are compared batch by batch: the task reward, the groups whose k rewards are all equal (no learning signal),
the completion length and the completions cut at ``max_new_tokens``. Both pipelines sample from the same distribution,
so each difference should be within about two of its standard errors.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path


def batch_stats(rewards: list[float], lengths: list[int], truncated: list[bool], k: int) -> dict:
    """One batch's statistics: ``rewards`` / ``lengths`` / ``truncated`` per completion, prompt-major groups of
    ``k``."""
    groups = [rewards[i:i + k] for i in range(0, len(rewards), k)]
    return {"reward": statistics.fmean(rewards), "flat_groups": statistics.fmean(len(set(g)) == 1 for g in groups),
            "length": statistics.fmean(lengths), "truncated": statistics.fmean(truncated)}


def policy_weights(path: str) -> dict:
    """A policy's state dict (Hugging Face names) from ``path``: a checkpoint of ``rloo-lightning fit`` (its
    ``policy.`` entries; a sharded folder is gathered) or a ``torch.save``-d state dict."""
    from rloo_lightning.export import read_checkpoint

    state = read_checkpoint(path)
    if "state_dict" in state:
        state = {n[len("policy."):]: t for n, t in state["state_dict"].items() if n.startswith("policy.")}
    if not state:
        raise SystemExit(f"--weights {path}: no policy weights in it (a Lightning checkpoint's 'policy.' entries, "
                         "or a state dict)")
    return state


def compare(ours: list[dict], trl: list[dict]) -> dict:
    """Per statistic: each side's mean over batches and ours minus TRL with its standard error (batches
    independent)."""
    out = {}
    for key in ours[0]:
        a, b = [s[key] for s in ours], [s[key] for s in trl]
        se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
        diff = statistics.fmean(a) - statistics.fmean(b)
        out[key] = {"ours": round(statistics.fmean(a), 4), "trl": round(statistics.fmean(b), 4),
                    "difference": round(diff, 4), "se": round(se, 4),
                    "z": round(diff / se, 2) if se > 0 else None}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf-dir", required=True, help="a SmolLM2 Hugging Face directory")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weights", help="the policy's weights to start both pipelines from (see policy_weights)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from experiments.learning_parity import learning_parity as lp
    _hyper, trl_config = lp._hyper, lp.trl_config
    from experiments.trl_parity import parity_fed_steps as fed
    ours_sampler = fed.ours_sampler
    from transformers import set_seed
    from trl import RLOOTrainer

    from benchmarks.bench_common import emit_json
    from benchmarks.bench_trl import trl_dataset, trl_reward
    from rloo_lightning.models import load_tokenizer
    from rloo_lightning.rollout import derive_seed

    h = _hyper()
    k = h["k"]
    weights = policy_weights(args.weights) if args.weights else None
    t0 = time.perf_counter()
    # -- ours: the data module and the module's sample and score, as a run's training_step calls them ----------
    module, data = ours_sampler(args.hf_dir, h, args.seed)
    if weights is not None:
        module.policy.load_state_dict(weights, strict=True)
    ours = []
    with torch.no_grad():
        for step, batch in zip(range(args.batches), data.train_dataloader()):
            rollout = module.sample(batch, k, seed=derive_seed(args.seed, 0, "train", step))
            rollout.scores, rollout.rewards = module.score(rollout, shape=False)
            lengths = rollout.completion_mask.sum(1).long().tolist()
            ours.append(batch_stats(rollout.rewards.float().tolist(), lengths, rollout.truncated.tolist(), k))
    ours_s = time.perf_counter() - t0
    del module

    # -- TRL: its trainer's data loader, _generate and the reward on its decoded completions --------------------
    t0 = time.perf_counter()
    tok = load_tokenizer(args.hf_dir)
    spec = dict(h, hf_dir=args.hf_dir, seed=args.seed, steps=args.batches)
    set_seed(args.seed)
    reward = trl_reward(spec)
    trainer = RLOOTrainer(model=args.hf_dir, reward_funcs=reward,
                          args=trl_config(spec, Path(tempfile.mkdtemp()) / "trl"),
                          train_dataset=trl_dataset(spec, tok), processing_class=tok)
    if weights is not None:
        trainer.model.load_state_dict(weights, strict=True)
    eos = set(trainer.eos_token_ids)
    trl = []
    with torch.no_grad():
        for _, inputs in zip(range(args.batches), trainer.get_train_dataloader()):
            if len(inputs) != h["prompts"] * k or any(inputs[i]["prompt"] != inputs[i - i % k]["prompt"]
                                                      for i in range(len(inputs))):
                raise SystemExit("TRL's batch is not 4 prompts x k rows, prompt-major: the group statistics would be "
                                 "wrong")
            _, completion_ids, completions = trainer._generate([x["prompt"] for x in inputs])
            rewards = reward([x["prompt"] for x in inputs], completions, completion_ids,
                             answer=[x["answer"] for x in inputs])
            ended = [bool(ids) and ids[-1] in eos for ids in completion_ids]
            trl.append(batch_stats([float(r) for r in rewards], [len(ids) for ids in completion_ids],
                                   [not e for e in ended], k))
    trl_s = time.perf_counter() - t0

    result = {"hf_dir": args.hf_dir, "weights": args.weights, "seed": args.seed, "batches": args.batches,
              "hyperparameters": h,
              "compare": compare(ours, trl), "ours_s": round(ours_s), "trl_s": round(trl_s),
              "per_batch": {"ours": ours, "trl": trl}}
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
