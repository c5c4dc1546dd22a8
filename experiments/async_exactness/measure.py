"""Stale rollouts through the module's own pipeline against the exact gradient: bias of each importance correction.

With ``rollout.lag`` K = 1, step 1 of a fit trains on the rollout that the module's
:class:`~rloo_lightning.pipeline.RolloutPipeline` submitted at step 0. The enumerable toy of
``rloo_lightning/verify/exactness.py`` makes that happen on the real ``training_step``
(:func:`~rloo_lightning.verify.exactness_stale.check_stale_training_step`): step 0 with the policy at ``theta_0``
(the toy's table) submits positions 0 and 1 through the engine's ``submit``; the policy then holds
``theta_1 = theta_0 + scale * N(0, 1)`` and step 1 trains on position 1's rollout, sampled from ``theta_0``. Each
draw is ``-grad`` of step 1's loss; the target is the exact ``grad J`` at ``theta_1``. For each scale and correction
this prints one JSON object (and writes it beside this file, or to ``--out``), then a markdown table.

    python -m experiments.async_exactness.measure            # 1000 draws per cell, 4 scales x 5 corrections
    python -m experiments.async_exactness.measure --quick    # 5x fewer draws; writes nothing unless --out
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
import warnings
from pathlib import Path

import torch

from rloo_lightning.verify.exactness import (
    LiveTableSampler,
    completion_probabilities,
    exact_gradient,
    make_toy,
    perturbed_table,
    toy_module,
    z_test,
)
from rloo_lightning.verify.exactness_stale import stale_training_step_draws

RECORD = Path(__file__).with_name("async_exactness.json")
SCALES = (0.1, 0.3, 0.5, 1.0)
LAG = 1
BETA = 0.1  # the harness's default kl.beta
# name -> the correction group ({}: the default, auto, which K >= 1 resolves to token-level TIS at cap 2).
CORRECTIONS: dict[str, dict] = {
    "none": {"level": "none"},
    "default (auto: token, truncate, cap 2)": {},
    "sequence, uncapped": {"level": "sequence", "cap": None},
    "sequence, truncate, cap 2": {"level": "sequence", "cap": 2.0},
    "token, uncapped": {"level": "token", "cap": None},
}


def mismatch(toy, theta_1: torch.Tensor) -> dict[str, float]:
    """The exact distance between the sampler pi_0 and the policy pi_1, by enumeration (averaged over prompts):
    the sequence KL(pi_0 || pi_1), and E_{pi_0}[w^2] (w = pi_1(y) / pi_0(y): 1 + chi^2, the variance factor of the
    uncapped sequence weights), and P_{pi_0}(w > 2) (the mass that a cap of 2 truncates)."""
    p0 = completion_probabilities(toy)
    p1 = completion_probabilities(dataclasses.replace(toy, policy_table=theta_1))
    w = p1 / p0
    return {"sequence_kl_sampler_to_policy": float((p0 * (p0 / p1).log()).sum(1).mean()),
            "sequence_weight_second_moment": float((p0 * w * w).sum(1).mean()),
            "sampler_mass_with_weight_above_2": float((p0 * (w > 2)).sum(1).mean())}


def measure(toy, theta_1: torch.Tensor, correction: dict, draws: int, repeats: int, seed: int,
            alpha: float) -> dict:
    """One cell: the draws of the stale step, the z-test against grad J at theta_1, and the bias in norms."""
    options = {"correction": correction} if correction else None
    start = time.perf_counter()
    sample = stale_training_step_draws(toy, theta_1, draws, repeats, options, seed, LAG)
    seconds = time.perf_counter() - start
    exact = exact_gradient(dataclasses.replace(toy, policy_table=theta_1), BETA)
    z = z_test(sample, exact, alpha)
    # |mean - exact|^2 = |bias|^2 + trace(cov) / n in expectation: the bias with the noise taken out, and the
    # relative bias an unbiased estimator would show with these draws (its noise floor).
    norm2 = float((sample.mean(0) - exact).pow(2).sum())
    floor2 = float(sample.var(0).sum()) / draws
    resolved = toy_module(toy, {"rollout": {"lag": LAG}, **(options or {})},
                          engine=LiveTableSampler(toy)).cfg.correction
    return {"correction_resolved": {"level": resolved.level, "mode": resolved.mode, "cap": resolved.cap},
            **dataclasses.asdict(z),
            "relative_bias_noise_floor": math.sqrt(floor2) / float(exact.norm()),
            "relative_bias_debiased": math.sqrt(max(0.0, norm2 - floor2)) / float(exact.norm()),
            "exact_grad_norm": float(exact.norm()),
            "seconds": round(seconds, 2)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=1000, help="stale training steps (independent draws) per cell")
    parser.add_argument("--repeats", type=int, default=16, help="copies of each prompt in a batch")
    parser.add_argument("--scales", type=float, nargs="+", default=list(SCALES),
                        help="theta_1 = theta_0 + scale * N(0, 1) (perturbed_table, seed 1)")
    parser.add_argument("--corrections", nargs="+", choices=list(CORRECTIONS), default=list(CORRECTIONS))
    parser.add_argument("--seed", type=int, default=0, help="the sampler's stream (the same for every cell)")
    parser.add_argument("--alpha", type=float, default=1e-3, help="family-wise false-alarm rate (Bonferroni)")
    parser.add_argument("--quick", action="store_true", help="5x fewer draws; no record unless --out")
    parser.add_argument("--out", type=Path, help=f"write the JSON here (default: {RECORD.name} beside this file)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*self.log.*")
    torch.set_num_threads(1)
    draws = args.draws // 5 if args.quick else args.draws
    out = args.out or (None if args.quick else RECORD)
    toy = make_toy()
    start = time.perf_counter()
    results = []
    for scale in args.scales:
        theta_1 = perturbed_table(toy, scale)
        cells = {name: measure(toy, theta_1, CORRECTIONS[name], draws, args.repeats, args.seed, args.alpha)
                 for name in args.corrections}
        results.append({"scale": scale, **mismatch(toy, theta_1), "corrections": cells})
    report = {"study": "async_exactness", "lag": LAG, "draws": draws, "repeats": args.repeats,
              "k": 4, "beta": BETA, "prompts": len(toy.prompts), "alpha": args.alpha, "seed": args.seed,
              "torch_threads": 1, "wall_s": round(time.perf_counter() - start, 1), "results": results}
    print(json.dumps(report))
    if out is not None:
        out.write_text(json.dumps(report, indent=1) + "\n")
    print("\n| scale | correction | unbiased | max abs z | relative bias | noise floor | debiased | scale fit | "
          "variance (trace) |\n|---|---|---|---|---|---|---|---|---|")
    for row in results:
        for name, r in row["corrections"].items():
            print(f"| {row['scale']} | {name} | {'yes' if r['unbiased'] else '**no**'} | {r['max_abs_z']:.1f} | "
                  f"{r['relative_bias']:.3f} | {r['relative_bias_noise_floor']:.3f} | "
                  f"{r['relative_bias_debiased']:.3f} | {r['scale']:.3f} | {r['variance_trace']:.5f} |")
    return report


if __name__ == "__main__":
    main()
