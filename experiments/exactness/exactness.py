"""Exactness study of RLOOModule's training step: option variants x k x beta against the exact gradient.

Every draw is ``-grad`` of ``RLOOModule.training_step``'s loss on the enumerable toy of
``rloo_lightning/verify/exactness.py`` (the module's own sampling masks, rewards, log-probs, KL, baseline
and loss); the z-test compares the draws' mean with the exact ``grad J``. Prints one JSON object (``--out``
writes it too), then a markdown table. Reproduce this folder's README.md:

    python -m experiments.exactness.exactness            # the full table (its wall time: see the README)
    python -m experiments.exactness.exactness --quick    # 5x fewer draws
    python -m experiments.exactness.exactness --corrections-only --out experiments/exactness/exactness_corrections.json
        # the importance corrections' table
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

from rloo_lightning.verify.exactness import check_training_step, make_toy, perturbed_table

KS = (2, 4, 8)
BETAS = (0.0, 0.1)
# name -> RLOOModule option groups; "default" is the paper's algorithm.
VARIANTS: dict[str, dict] = {
    "default": {},
    "micro_batch_size=40": {"update": {"micro_batch_size": 40}},
    "baseline=none": {"advantage": {"baseline": "none"}},
    "baseline=moving_average": {"advantage": {"baseline": "moving_average"}},
    "baseline=group_mean (Dr.GRPO)": {"advantage": {"baseline": "group_mean"}},
    "baseline=group_mean_std (GRPO)": {"advantage": {"baseline": "group_mean_std"}},
    "kl.placement=token_reward (OpenRLHF)": {"kl": {"placement": "token_reward"}},
    "kl.placement=loss, k3 (GRPO)": {"kl": {"placement": "loss", "estimator": "k3"}},
    "kl.estimator=k2": {"kl": {"estimator": "k2"}},
    "kl.estimator=k3": {"kl": {"estimator": "k3"}},
    "update.loss_aggregation=token_mean": {"update": {"loss_aggregation": "token_mean"}},
    "update.loss_aggregation=seq_mean_token_mean": {"update": {"loss_aggregation": "seq_mean_token_mean"}},
    "advantage.whiten": {"advantage": {"whiten": True}},
}


# A sampler pi_s that is not pi_theta (the policy's logits + 0.5 N(0, 1), reporting its log-probs), and the
# importance corrections: name -> the correction group.
MISMATCH_SCALE = 0.5
CORRECTIONS: dict[str, dict] = {
    "uncorrected": {},
    "sequence, untruncated": {"level": "sequence", "cap": None},
    "sequence, TIS cap 2": {"level": "sequence", "cap": 2.0},
    "sequence, TIS cap 1": {"level": "sequence", "cap": 1.0},
    "sequence, mask [1/1.5, 1.5]": {"level": "sequence", "mode": "mask", "cap": 1.5},
    "token, untruncated": {"level": "token", "cap": None},
    "token, TIS cap 2": {"level": "token", "cap": 2.0},
    "token, mask [0.5, 2]": {"level": "token", "mode": "mask", "cap": 2.0},
}


def with_k_beta(options: dict, k: int, beta: float) -> dict:
    out = {group: dict(values) for group, values in options.items()}
    out.setdefault("sampling", {})["k"] = k
    out.setdefault("kl", {})["beta"] = beta
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=500, help="training steps (independent batches) per cell")
    parser.add_argument("--repeats", type=int, default=16, help="copies of each prompt in a batch")
    parser.add_argument("--alpha", type=float, default=1e-3, help="family-wise false-alarm rate (Bonferroni)")
    parser.add_argument("--quick", action="store_true", help="5x fewer draws")
    parser.add_argument("--corrections-only", action="store_true", help="only the sampler-mismatch table")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--corrections", nargs="+", choices=list(CORRECTIONS), default=list(CORRECTIONS))
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*self.log.*")
    torch.set_num_threads(1)
    draws = args.draws // 5 if args.quick else args.draws
    toy = make_toy()
    results, start = [], time.perf_counter()
    for name, options in [] if args.corrections_only else [(v, VARIANTS[v]) for v in args.variants]:
        for k in KS:
            for beta in BETAS:
                if beta == 0 and name.startswith("kl."):
                    continue  # no KL term: the same as the default
                z = check_training_step(toy, draws, args.repeats, with_k_beta(options, k, beta), seed=k,
                                        alpha=args.alpha)
                results.append({"variant": name, "k": k, "beta": beta, **asdict(z)})
    sampler = perturbed_table(toy, MISMATCH_SCALE)
    corrections = []
    for name, correction in ((c, CORRECTIONS[c]) for c in args.corrections):
        for beta in BETAS:
            z = check_training_step(toy, draws, args.repeats, with_k_beta({"correction": correction}, 4, beta),
                                    seed=4, alpha=args.alpha, sampler_table=sampler)
            corrections.append({"correction": name, "k": 4, "beta": beta, **asdict(z)})
    report = {"draws": draws, "repeats": args.repeats, "alpha": args.alpha, "mismatch_scale": MISMATCH_SCALE,
              "seconds": round(time.perf_counter() - start, 1), "results": results, "corrections": corrections}
    print(json.dumps(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("\n| variant | k | beta | unbiased | max abs z | scale |\n|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['k']} | {r['beta']} | {'yes' if r['unbiased'] else '**no**'} | "
              f"{r['max_abs_z']:.1f} | {r['scale']:.3f} |")
    print("\n| sampler pi_s != pi_theta, correction | beta | unbiased | max abs z | relative bias | variance (trace) |"
          "\n|---|---|---|---|---|---|")
    for r in corrections:
        print(f"| {r['correction']} | {r['beta']} | {'yes' if r['unbiased'] else '**no**'} | {r['max_abs_z']:.1f} | "
              f"{r['relative_bias']:.3f} | {r['variance_trace']:.5f} |")


if __name__ == "__main__":
    main()
