"""Every off-policy correction against the exact gradient on completions of up to 8 tokens: bias and variance.

On the toy of ``rloo_lightning/verify/exactness_long.py`` (3 prompts, completions of up to 8 tokens over {a, b} and
EOS, exact by enumeration) each correction of ``model.correction`` is drawn on the module's own ``training_step``
(``off_policy_draws``): at lag 0 with a sampler whose logits are the policy's plus ``scale * N(0, 1)``
(``perturbed_table``, seed 1) or that samples at another temperature (``--sampler-temperatures``),
at lag 1 or 2 through the pipeline with the policy moved by the same perturbation between
the step that sampled and the step that trains (at lag 2 the rollout is the one step 0 sampled two steps ahead, and
step 2 trains on it: the same distance, through the pipeline's K = 2 positions and seeds). Every correction of a
cell sees the same samples (seed 0).

    python -m experiments.offpolicy_family.measure --lags 0 --scales 0.1 0.3 0.5     # one record per (lag, scale)
    python -m experiments.offpolicy_family.measure --lags 0 --sampler-temperatures 0.8  # sampling at 0.8, not 0.7
    python -m experiments.offpolicy_family.measure --table                          # the table of every record
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import warnings
from pathlib import Path

import torch

from experiments.async_exactness.measure import mismatch
from rloo_lightning.verify.exactness import perturbed_table
from rloo_lightning.verify.exactness_long import (
    bias_and_variance, make_long_toy, mass_outside, mean_lengths, off_policy_sample, off_policy_target,
)

RECORDS = Path(__file__).with_name("records")
SCALES = (0.1, 0.3, 0.5)
BETA = 0.1
# name -> model.correction (docs/correction.md: each one's formula and source). Bounds: verl's cap 2 for the weights
# and the product ratio; rllm's IcePop band [0.5, 5]; a +-10 % band for the geometric ratio (a per-token scale).
CORRECTIONS: dict[str, dict] = {
    "none": {"level": "none"},
    "token TIS, cap 2 (auto's default)": {"level": "token", "cap": 2.0},
    "token, uncapped": {"level": "token", "cap": None},
    "IcePop: token mask [0.5, 5]": {"level": "token", "mode": "mask", "lower": 0.5, "cap": 5.0},
    "sequence IS, uncapped": {"level": "sequence", "cap": None},
    "Seq-TIS, cap 2": {"level": "sequence", "cap": 2.0},
    "Seq-MIS: sequence mask [0.5, 2]": {"level": "sequence", "mode": "mask", "cap": 2.0},
    "geometric weight, cap 2": {"level": "geometric", "cap": 2.0},
    "Geo-Mask [0.9, 1.1]": {"level": "geometric", "mode": "reject", "lower": 0.9, "cap": 1.1},
    "Geo-Mask [0.5, 2]": {"level": "geometric", "mode": "reject", "lower": 0.5, "cap": 2.0},
    "token TIS + geometric reject [0.9, 1.1]": {"level": "token", "cap": 2.0, "reject": "geometric",
                                                "reject_lower": 0.9, "reject_upper": 1.1},
    "token TIS + sequence reject [0.5, 2]": {"level": "token", "cap": 2.0, "reject": "sequence"},
    "TOPR": {"level": "topr"},
}


# the filters' bands whose dropped mass each record states: (ratio, lower, upper)
BANDS = (("sequence", 0.5, 2.0), ("geometric", 0.9, 1.1), ("geometric", 0.5, 2.0))


def other_table(toy, scale: float, temperature: float | None = None):
    """The table that is not the policy's: the policy's logits plus ``scale * N(0, 1)`` (``perturbed_table``, seed 1),
    or (``temperature``) the policy's logits scaled so that sampling at the toy's temperature samples at
    ``temperature``: a sampler at another temperature than the policy's log-probs (lag 0 only)."""
    return perturbed_table(toy, scale) if temperature is None else toy.policy_table * toy.temperature / temperature


def record_name(lag: int, scale: float, temperature: float | None) -> str:
    return f"lag{lag}_" + (f"scale{scale}" if temperature is None else f"temperature{temperature}") + ".json"


def distance(toy, lag: int, other) -> dict:
    """The exact distance between the sampler and the policy of a cell whose other table is ``other``, by enumeration
    (averaged over the prompts): KL(pi_s || pi_theta) over whole completions, E_s[w^2] and P_s(w > 2)
    (experiments/async_exactness), the sampler's mean length, and the mass each filter band of ``BANDS`` drops."""
    sampler, policy = (other, toy.policy_table) if lag == 0 else (toy.policy_table, other)
    out = mismatch(dataclasses.replace(toy, policy_table=sampler), policy)
    out["mean_length_sampler"] = float(mean_lengths(toy, sampler).mean())
    for kind, lower, upper in BANDS:
        out[f"sampler_mass_{kind}_ratio_outside_{lower}_{upper}"] = mass_outside(toy, sampler, policy, kind, lower,
                                                                                upper)
    return out


def cell(toy, lag: int, scale: float, temperature: float | None, names: list[str], draws: int, repeats: int,
         seed: int, alpha: float) -> dict:
    """One (lag, scale or sampler temperature): the exact distance between sampler and policy, then each correction's
    bias and variance."""
    other = other_table(toy, scale, temperature)
    exact = off_policy_target(toy, other, lag, BETA)  # one target for every correction of the cell
    results = {}
    for name in names:
        start = time.perf_counter()
        sample = off_policy_sample(toy, other, lag, draws, {"correction": CORRECTIONS[name]}, repeats, seed)
        results[name] = {**bias_and_variance(sample, exact, alpha), "seconds": round(time.perf_counter() - start, 1)}
    return {"lag": lag, "scale": scale, "sampler_temperature": temperature, **distance(toy, lag, other),
            "draws": draws, "repeats": repeats, "k": 4, "beta": BETA, "prompts": len(toy.prompts),
            "max_len": toy.max_len, "seed": seed, "alpha": alpha, "corrections": results}


def merged(old: dict, new: dict) -> dict:
    """``new``'s corrections added to ``old``'s record of the same cell (same draws, samples and toy): a correction
    measured later joins the others, drawn on the same samples; ``old`` is replaced when the cell differs."""
    same = ("draws", "repeats", "seed", "max_len", "alpha", "beta", "sampler_temperature")
    if any(old.get(key) != new[key] for key in same):
        return new
    corrections = {**old["corrections"], **new["corrections"]}
    return {**old, **new, "corrections": {name: corrections[name] for name in CORRECTIONS if name in corrections},
            "wall_s": round(old.get("wall_s", 0) + new["wall_s"], 1)}


def table(records: list[dict]) -> str:
    """One markdown table of ``records`` (sorted by lag, scale)."""
    lines = ["| lag | sampler | seq KL | correction | unbiased | max abs z | relative bias (debiased) | noise floor | "
             "relative variance |", "|---|---|---|---|---|---|---|---|---|"]
    for rec in sorted(records, key=lambda r: (r["lag"], r.get("sampler_temperature") or 0, r["scale"])):
        temperature = rec.get("sampler_temperature")
        sampler = f"scale {rec['scale']}" if temperature is None else f"T {temperature}"
        for name, r in rec["corrections"].items():
            lines.append(f"| {rec['lag']} | {sampler} | {rec['sequence_kl_sampler_to_policy']:.3f} | {name} | "
                         f"{'yes' if r['unbiased'] else '**no**'} | {r['max_abs_z']:.1f} | "
                         f"{r['relative_bias_debiased']:.3f} | {r['relative_bias_noise_floor']:.3f} | "
                         f"{r['relative_variance']:.3f} |")
    return "\n".join(lines)


def records_in(folder: Path, pattern: str) -> list[dict]:
    """The records of ``folder`` whose names match ``pattern``, in name order."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob(pattern))]


def drawing_toy(max_len: int, out: Path):
    """The toy, set up for drawing: one thread (the tensors are tiny), the module's ``self.log`` warnings off (no
    trainer), the records' folder made."""
    warnings.filterwarnings("ignore", message=".*self.log.*")
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    return make_long_toy(max_len=max_len)


def stamped(rec: dict, start: float) -> dict:
    """``rec`` with its wall time since ``start`` and the torch that drew it."""
    rec.update(wall_s=round(time.perf_counter() - start, 1), torch=torch.__version__, torch_threads=1)
    return rec


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 1], choices=[0, 1, 2])
    parser.add_argument("--scales", type=float, nargs="+", default=list(SCALES))
    parser.add_argument("--sampler-temperatures", type=float, nargs="+",
                        help="instead of --scales (lag 0 only): the sampler samples at these temperatures, the "
                             "policy's log-probs stay at the toy's 0.7")
    parser.add_argument("--corrections", nargs="+", choices=list(CORRECTIONS), default=list(CORRECTIONS))
    parser.add_argument("--draws", type=int, default=300, help="training steps (independent draws) per cell")
    parser.add_argument("--repeats", type=int, default=16, help="copies of each prompt in a batch")
    parser.add_argument("--max-len", type=int, default=8, help="the toy's longest completion")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's stream (the same for every correction)")
    parser.add_argument("--alpha", type=float, default=1e-3, help="family-wise false-alarm rate (Bonferroni)")
    parser.add_argument("--out", type=Path, default=RECORDS, help="folder of the records, one per (lag, scale)")
    parser.add_argument("--table", action="store_true", help="print the table of the records in --out; draw nothing")
    parser.add_argument("--distances", action="store_true",
                        help="recompute the exact distances (no draws) of every record in --out, and write them there")
    args = parser.parse_args(argv)
    if args.sampler_temperatures and args.lags != [0]:
        parser.error("--sampler-temperatures is a sampler that is not pi_theta: --lags 0 only")
    if args.distances:
        records = records_in(args.out, "lag*_*.json")
        for rec in records:
            toy, temperature = make_long_toy(max_len=rec["max_len"]), rec.get("sampler_temperature")
            rec.update(distance(toy, rec["lag"], other_table(toy, rec["scale"], temperature)))
            (args.out / record_name(rec["lag"], rec["scale"], temperature)).write_text(json.dumps(rec, indent=1) + "\n")
        return records
    if args.table:
        records = records_in(args.out, "lag*_*.json")
        print(table(records))
        return records
    toy = drawing_toy(args.max_len, args.out)
    records = []
    cells = [(0.0, t) for t in args.sampler_temperatures] if args.sampler_temperatures else \
        [(scale, None) for scale in args.scales]
    for lag in args.lags:
        for scale, temperature in cells:
            start = time.perf_counter()
            rec = stamped(cell(toy, lag, scale, temperature, args.corrections, args.draws, args.repeats, args.seed,
                               args.alpha), start)
            path = args.out / record_name(lag, scale, temperature)
            rec = merged(json.loads(path.read_text()), rec) if path.exists() else rec
            path.write_text(json.dumps(rec, indent=1) + "\n")
            records.append(rec)
    print(table(records))
    return records


if __name__ == "__main__":
    main()
