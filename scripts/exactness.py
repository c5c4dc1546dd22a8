"""Full exactness study of the RLOO estimator: every variant, k in {2, 4, 8}, beta in {0, 0.1}.

Prints one JSON object, then the same results as markdown tables. Reproduce ``docs/exactness.md``:

    python scripts/exactness.py            # 3-4 minutes on 2 CPU cores
    python scripts/exactness.py --quick    # a smoke run with 10x fewer minibatches

See ``rloo_lightning/exactness.py`` for the toy, the estimator and the z-test.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from typing import Any

import torch

from rloo_lightning.exactness import (
    Toy,
    completion_probabilities,
    exact_gradient,
    exact_objective,
    enumerate_completions,
    kl_placement_target,
    make_toy,
    minibatch_gradients,
    z_test,
)

KS = (2, 4, 8)
BETAS = (0.0, 0.1)
# name -> keyword arguments of minibatch_gradients; "default" is RLOOModule's algorithm.
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "baseline=none": {"baseline": "none"},
    "baseline=moving_average": {"baseline": "moving_average"},
    "baseline=group_mean_std (GRPO)": {"baseline": "group_mean_std"},
    "baseline=group_mean (self-incl., unscaled)": {"baseline": "group_mean"},
    "baseline=group_max (bug)": {"baseline": "group_max"},
    "kl=loss_k1": {"kl_mode": "loss_k1"},
    "kl=loss_k3": {"kl_mode": "loss_k3"},
    "kl=reward_k1_not_detached (bug)": {"kl_mode": "reward_k1_not_detached"},
    "kl=token_reward_k1 (OpenRLHF)": {"kl_mode": "token_reward_k1"},
    "kl=reward_k2_detached": {"kl_mode": "reward_k2_detached"},
    "kl=reward_k3_detached": {"kl_mode": "reward_k3_detached"},
    "aggregation=token_mean": {"aggregation": "token_mean"},
    "mask_leak (bug)": {"mask_leak": True},
    "zero_variance_filter=score": {"zero_variance_filter": "score"},
    "zero_variance_filter=shaped": {"zero_variance_filter": "shaped"},
}
# The binary-reward toy repeats the variants whose behaviour depends on the reward distribution.
BINARY_VARIANTS = (
    "default",
    "baseline=none",
    "baseline=moving_average",
    "baseline=group_mean_std (GRPO)",
    "aggregation=token_mean",
    "zero_variance_filter=score",
    "zero_variance_filter=shaped",
)


def describe(toy: Toy, name: str) -> dict[str, Any]:
    """Facts about a toy that the reader needs to judge the results."""
    probs = completion_probabilities(toy)
    token_probs = torch.softmax(toy.policy_logits / toy.temperature, dim=-1)
    _, mask = enumerate_completions(toy.max_len, toy.vocab, toy.eos_id, toy.pad_id)
    per_prompt_reward = exact_objective_per_prompt(toy)
    return {
        "name": name,
        "num_prompts": toy.num_prompts,
        "max_len": toy.max_len,
        "vocab": toy.vocab,
        "completions_per_prompt": probs.shape[1],
        "temperature": toy.temperature,
        "min_token_prob": round(float(token_probs.min()), 4),
        "min_completion_prob": round(float(probs.min()), 5),
        "expected_reward_per_prompt": [round(v, 4) for v in per_prompt_reward],
        "mean_completion_length": round(float((probs * mask.sum(1)).sum(1).mean()), 4),
        "sequence_kl_to_ref": round(float((exact_objective(toy, 0.0) - exact_objective(toy, 1.0))), 5),
    }


def exact_objective_per_prompt(toy: Toy) -> list[float]:
    """E[r] of each prompt alone (beta = 0), from the same enumeration."""
    out = []
    for p in range(toy.num_prompts):
        one = Toy(toy.policy_logits[p:p + 1], toy.ref_logits[p:p + 1], toy.rewards[p:p + 1],
                  toy.temperature, toy.eos_id, toy.pad_id)
        out.append(float(exact_objective(one, 0.0)))
    return out


def kl_targets(toy: Toy, n: int, seed: int, alpha: float) -> list[dict[str, Any]]:
    """Each KL placement against the gradient that ``kl_placement_target`` says it is unbiased for."""
    rows = []
    for k in KS:
        for mode in ("loss_k1", "loss_k3", "reward_k1_not_detached"):
            target = kl_placement_target(toy, 0.1, mode)
            result = z_test(minibatch_gradients(toy, k, 0.1, n, seed=seed + k, kl_mode=mode), target, alpha)
            rows.append({"kl_mode": mode, "k": k, "beta": 0.1, "max_abs_z": result.max_abs_z,
                         "num_rejected": result.num_rejected, "num_coords": result.num_coords,
                         "verdict": "unbiased for target" if result.unbiased else "BIASED for target"})
    return rows


def calibrate(toy: Toy, toy_name: str, k: int, beta: float, seeds: int, n: int, seed: int) -> dict[str, Any]:
    """False alarms of the default (unbiased) estimator over independent repetitions."""
    exact = exact_gradient(toy, beta)
    rejected_05 = rejected_1e3 = 0
    zs = []
    for s in range(seeds):
        draws = minibatch_gradients(toy, k, beta, n, seed=seed + 10_000 + s)
        rejected_05 += not z_test(draws, exact, alpha=0.05).unbiased
        rejected_1e3 += not z_test(draws, exact, alpha=1e-3).unbiased
        var = draws.var(0)
        zs.append(((draws.mean(0) - exact) / (var / n).sqrt())[var > 0])
    z = torch.cat(zs)
    return {
        "toy": toy_name, "k": k, "beta": beta, "repetitions": seeds, "minibatches": n,
        "family_rejections_at_0.05": rejected_05,
        "family_rejections_at_1e-3": rejected_1e3,
        "coord_fraction_abs_z_gt_1.96": round(float((z.abs() > 1.96).double().mean()), 4),
        "coord_sd_of_z": round(float(z.std()), 3),
    }


def run_grid(toy: Toy, toy_name: str, variants: list[str], n: int, seed: int, alpha: float) -> list[dict[str, Any]]:
    rows = []
    for k in KS:
        for beta in BETAS:
            exact = exact_gradient(toy, beta)
            for name in variants:
                # Same seed for every variant at a given k: common samples, so differences are the variant's.
                start = time.perf_counter()
                result = z_test(minibatch_gradients(toy, k, beta, n, seed=seed + k, **VARIANTS[name]), exact, alpha)
                row = {"toy": toy_name, "variant": name, "k": k, "beta": beta, **asdict(result)}
                row["verdict"] = "unbiased" if result.unbiased else "BIASED"
                row["seconds"] = round(time.perf_counter() - start, 2)
                rows.append(row)
    return rows


def markdown(report: dict[str, Any]) -> str:
    lines = []
    for toy in report["toys"]:
        lines += [f"### Toy `{toy['name']}`", "", "```", json.dumps(toy), "```", ""]
        lines += [
            "| variant | k | beta | verdict | max abs z | rejected / coords | scale c | max abs z after c "
            "| rel. bias | var trace |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in report["results"]:
            if r["toy"] != toy["name"]:
                continue
            lines.append(
                f"| {r['variant']} | {r['k']} | {r['beta']} | {r['verdict']} | {r['max_abs_z']:.1f} | "
                f"{r['num_rejected']} / {r['num_coords']} | {r['scale']:.3f} | {r['max_abs_z_scaled']:.1f} | "
                f"{r['relative_bias']:.3f} | {r['variance_trace']:.4f} |"
            )
        lines.append("")
        lines += ["Variance (trace of the covariance of one minibatch's gradient) of the unbiased baselines:", ""]
        lines += ["| baseline | beta | " + " | ".join(f"k={k}" for k in KS) + " |", "|---|---|" + "---|" * len(KS)]
        for name in ("baseline=none", "baseline=moving_average", "default"):
            for beta in BETAS:
                cells = [
                    f"{r['variance_trace']:.4f}"
                    for k in KS
                    for r in report["results"]
                    if r["toy"] == toy["name"] and r["variant"] == name and r["k"] == k and r["beta"] == beta
                ]
                label = "leave_one_out (default)" if name == "default" else name.split("=")[1]
                lines.append(f"| {label} | {beta} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["### What the other KL placements are unbiased for (uniform toy, beta = 0.1)", "",
              "| kl_mode | k | target | verdict | max abs z | rejected / coords |", "|---|---|---|---|---|---|"]
    targets = {"loss_k1": "grad E[r] (no KL gradient at all)",
               "loss_k3": "grad E[r] - beta * grad sum_y sg(pi) sum_t k3_t",
               "reward_k1_not_detached": "grad J - beta * grad sum_y sg(pi) (log pi)^2 / 2"}
    for r in report["kl_targets"]:
        lines.append(f"| {r['kl_mode']} | {r['k']} | {targets[r['kl_mode']]} | {r['verdict']} | "
                     f"{r['max_abs_z']:.1f} | {r['num_rejected']} / {r['num_coords']} |")
    lines.append("")
    lines += ["### False-alarm calibration of the default", "",
              "| toy | k | beta | repetitions x minibatches | family rejections at 0.05 | at 1e-3 | "
              "coords with abs z > 1.96 | sd of z |", "|---|---|---|---|---|---|---|---|"]
    for c in report["calibration"]:
        lines.append(
            f"| {c['toy']} | {c['k']} | {c['beta']} | {c['repetitions']} x {c['minibatches']} | "
            f"{c['family_rejections_at_0.05']} | "
            f"{c['family_rejections_at_1e-3']} | {c['coord_fraction_abs_z_gt_1.96']} | {c['coord_sd_of_z']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minibatches", type=int, default=50_000, help="independent minibatches per cell")
    parser.add_argument("--alpha", type=float, default=1e-3, help="family-wise false-alarm rate (Bonferroni)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="10x fewer minibatches and repetitions")
    parser.add_argument("--markdown", help="also write the markdown tables to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny tensors: more threads only contend
    n = args.minibatches // 10 if args.quick else args.minibatches
    start = time.perf_counter()
    uniform, binary = make_toy(rewards="uniform"), make_toy(rewards="binary")
    results = run_grid(uniform, "uniform", list(VARIANTS), n, args.seed, args.alpha)
    results += run_grid(binary, "binary", list(BINARY_VARIANTS), n, args.seed, args.alpha)
    targets = kl_targets(uniform, n, args.seed, args.alpha)
    reps, cal_n = (10, 2_000) if args.quick else (100, 20_000)
    calibration = [
        calibrate(uniform, "uniform", 2, 0.1, reps, cal_n, args.seed),
        calibrate(binary, "binary", 4, 0.0, reps, cal_n, args.seed),
    ]
    report = {
        "config": {
            "minibatches_per_cell": n, "alpha_familywise": args.alpha, "seed": args.seed,
            "prompts_per_minibatch": uniform.num_prompts, "ema_decay": 0.9, "grpo_eps": 1e-4,
            "torch": torch.__version__,
        },
        "toys": [describe(uniform, "uniform"), describe(binary, "binary")],
        "results": results,
        "kl_targets": targets,
        "calibration": calibration,
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(report, indent=1))
    table = markdown(report)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
