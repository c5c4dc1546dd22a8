"""A sampler that truncates (top-p / top-k), against the exact gradient: what each correction estimates then.

vLLM (and any engine) sampling with ``top_p`` or ``top_k`` draws from pi_theta truncated to the kept tokens and
renormalised, and reports those renormalised log-probs; the trainer's log-probs are pi_theta's over the whole
vocabulary. On the toy of ``rloo_lightning/verify/exactness_long.py`` (completions of up to 8 tokens over {a, b} and
EOS), at lag 0, the engine samples from the policy's table truncated at each position as ``top_p`` / ``top_k`` would
truncate it (the dropped tokens' logits set to -1e4: probability 0) and reports its log-probs. Each correction's draws
of the module's own ``training_step`` are compared with two exact targets: ``grad J`` of pi_theta (the whole
vocabulary: what the package's estimator is for) and ``grad J`` of pi_theta truncated the same way (the mask held
fixed: the policy a truncated sampler actually runs).

    python -m experiments.offpolicy_family.truncation --top-p 0.8 0.9 --top-k 2 --draws 600   # one record per cell
    python -m experiments.offpolicy_family.truncation --table                                 # from the records
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from experiments.offpolicy_family.measure import BETA, CORRECTIONS, RECORDS, drawing_toy, records_in, stamped
from rloo_lightning.verify.exactness import completion_probabilities, exact_gradient, exact_objective
from rloo_lightning.verify.exactness_long import bias_and_variance, mean_lengths, off_policy_sample

DROPPED = -1e4  # a dropped token's logit: exp(-1e4 / T) is 0 in float64


def truncation_mask(toy, top_p: float | None = None, top_k: int | None = None) -> torch.Tensor:
    """``[*table.shape]``: 0 where a token is kept, ``DROPPED`` where ``top_p`` (the smallest set of most likely
    tokens whose probability reaches ``top_p``) or ``top_k`` (the ``top_k`` most likely) drops it, at the toy's
    temperature, per position and previous token."""
    probs = torch.softmax(toy.policy_table / toy.temperature, -1)
    order = probs.argsort(-1, descending=True)
    ranked = probs.gather(-1, order)
    keep_ranked = torch.ones_like(ranked, dtype=torch.bool)
    if top_p is not None:  # a token is kept when the mass ranked above it is below top_p
        keep_ranked &= (ranked.cumsum(-1) - ranked) < top_p
    if top_k is not None:
        keep_ranked[..., top_k:] = False
    keep = torch.zeros_like(keep_ranked).scatter(-1, order, keep_ranked)
    return torch.where(keep, 0.0, DROPPED).to(toy.policy_table.dtype)


def truncated_gradient(toy, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """``[D]``: the exact ``grad J`` of pi_theta truncated by ``mask`` (held fixed), with respect to pi_theta's
    table; the reference is truncated the same way (its KL is over the kept tokens)."""
    truncated = dataclasses.replace(toy, ref_table=toy.ref_table + mask)
    theta = toy.policy_table.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(exact_objective(truncated, beta, theta + mask), theta)  # the mask is a constant
    return grad.reshape(-1)


def record_name(top_p: float | None, top_k: int | None) -> str:
    return "truncation_" + (f"top_p{top_p}" if top_p is not None else f"top_k{top_k}") + ".json"


def cell(toy, top_p: float | None, top_k: int | None, names: list[str], draws: int, repeats: int, seed: int,
         alpha: float) -> dict:
    mask = truncation_mask(toy, top_p, top_k)
    sampler = toy.policy_table + mask
    full, truncated = exact_gradient(toy, BETA), truncated_gradient(toy, mask, BETA)
    results = {}
    for name in names:
        start = time.perf_counter()
        sample = off_policy_sample(toy, sampler, 0, draws, {"correction": CORRECTIONS[name]}, repeats, seed)
        results[name] = {"full": bias_and_variance(sample, full, alpha),
                         "truncated": bias_and_variance(sample, truncated, alpha),
                         "seconds": round(time.perf_counter() - start, 1)}
    p_s = completion_probabilities(dataclasses.replace(toy, policy_table=sampler))
    p_theta = completion_probabilities(toy)
    drawn = p_s > 0  # the completions the sampler can draw (a truncated sampler never draws the others)
    log_ratio = torch.where(drawn, p_theta.log() - p_s.log(), 0.0)
    dropped = round(float((mask < 0).double().mean()), 4)
    return {"top_p": top_p, "top_k": top_k, "dropped_share_of_table_entries": dropped,
            "sequence_kl_sampler_to_policy": float((p_s * -log_ratio).sum(1).mean()),
            "sequence_weight_second_moment": float((p_s * (2 * log_ratio).exp()).sum(1).mean()),
            "policy_mass_never_drawn": float((p_theta * ~drawn).sum(1).mean()),
            "mean_length_sampler": float(mean_lengths(toy, sampler).mean()),
            "targets_relative_gap": float((truncated - full).norm() / full.norm()),
            "draws": draws, "repeats": repeats, "k": 4, "beta": BETA, "prompts": len(toy.prompts),
            "max_len": toy.max_len, "seed": seed, "alpha": alpha, "corrections": results}


def table(records: list[dict]) -> str:
    lines = ["| sampler | seq KL | π_θ mass never drawn | correction | bias to full π_θ (unbiased?) | "
             "bias to truncated π_θ (unbiased?) | relative variance |", "|---|---|---|---|---|---|---|"]
    for rec in records:
        sampler = f"top-p {rec['top_p']}" if rec["top_p"] is not None else f"top-k {rec['top_k']}"
        for name, r in rec["corrections"].items():
            f, t = r["full"], r["truncated"]
            lines.append(f"| {sampler} | {rec['sequence_kl_sampler_to_policy']:.3f} | "
                         f"{rec['policy_mass_never_drawn']:.3f} | {name} | "
                         f"{f['relative_bias_debiased']:.3f} ({'yes' if f['unbiased'] else 'no'}) | "
                         f"{t['relative_bias_debiased']:.3f} ({'yes' if t['unbiased'] else 'no'}) | "
                         f"{f['relative_variance']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top-p", type=float, nargs="*", default=[0.8, 0.9])
    parser.add_argument("--top-k", type=int, nargs="*", default=[2])
    parser.add_argument("--corrections", nargs="+", choices=list(CORRECTIONS), default=list(CORRECTIONS))
    parser.add_argument("--draws", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=8, help="the toy's longest completion")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--alpha", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, default=RECORDS)
    parser.add_argument("--table", action="store_true", help="print the table of the records in --out; draw nothing")
    args = parser.parse_args(argv)
    if args.table:
        records = records_in(args.out, "truncation_*.json")
        print(table(records))
        return records
    toy = drawing_toy(args.max_len, args.out)
    records = []
    for top_p, top_k in [(p, None) for p in args.top_p] + [(None, k) for k in args.top_k]:
        start = time.perf_counter()
        rec = stamped(cell(toy, top_p, top_k, args.corrections, args.draws, args.repeats, args.seed, args.alpha), start)
        (args.out / record_name(top_p, top_k)).write_text(json.dumps(rec, indent=1) + "\n")
        records.append(rec)
    print(table(records))
    return records


if __name__ == "__main__":
    main()
