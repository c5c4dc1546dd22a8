"""Do ``DecodeLoopEngine`` and HF ``generate`` sample the same distribution on SmolLM2 at T = 0.7?

    python -m experiments.sampler_checks.sampler_compare HF_DIR [ROUNDS] [--out FILE]    # prints one JSON object
    python -m experiments.sampler_checks.sampler_compare HF_DIR --first-token-draws 8192  # the goodness-of-fit test

One batch of 4 arithmetic prompts, 16 samples each, ``ROUNDS`` seeds (default 3) per engine: the per-token
log-prob and entropy along the sampled trajectories (scored by the training forward at the temperature), the
completion length, the task reward and the five commonest first tokens. A first look, not a test: the two
engines draw from different random streams.

``--first-token-draws N``: instead, N first tokens per prompt from each engine (``--engines``), through the
module's ``sample`` with one new token, against the exact ``softmax(logits / 0.7)`` of the prompt's training
forward: Pearson's chi-square per prompt (tokens of expected count < 5 pooled into one cell) with its p-value,
and the total-variation distance between the empirical and the exact distribution beside the TV distance
that exact draws of the same size give on average (simulated from the exact distribution).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def chi_square(counts, probs, min_expected: float = 5.0) -> dict:
    """Pearson's goodness of fit of ``counts [V]`` (n draws) to ``probs [V]``; cells of expected < 5 pooled."""
    import torch

    n = counts.sum()
    expected = n * probs.double()
    big = expected >= min_expected
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < min_expected:  # the pooled cell too small to stand alone: merge it into the smallest big cell
        obs, exp = obs[:-1], exp[:-1]
        obs[exp.argmin()] += counts[~big].sum()
        exp[exp.argmin()] += expected[~big].sum()
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(exp) - 1
    p = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()
    return {"chi2": round(stat.item(), 2), "df": df, "p_value": round(p, 4)}


def first_token_fit(module, batch, engines: dict, draws: int, chunk: int = 256) -> dict:
    """N first tokens per prompt from each engine against the exact tempered softmax (see the docstring)."""
    import torch

    from rloo_lightning.algo.logprobs import mask_positions
    from rloo_lightning.rollout import sampling_config

    temperature = module.generation_config.temperature
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        positions = mask_positions(mask)  # as the engines place a left-padded prompt
        logits = module.policy(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()
    probs = torch.softmax(logits / temperature, -1)
    one = sampling_config(max_new_tokens=1, eos_token_ids=module.generation_config.eos_token_id,
                          pad_token_id=module.generation_config.pad_token_id, temperature=temperature)
    saved = module.generation_config, module.engine
    out: dict = {"draws_per_prompt": draws, "temperature": temperature, "engines": {}}
    gen = torch.Generator().manual_seed(0)
    tv_exact = [sum(0.5 * (torch.bincount(torch.multinomial(p, draws, True, generator=gen), minlength=len(p)) / draws
                           - p).abs().sum().item() for _ in range(20)) / 20 for p in probs]
    try:
        module.generation_config = one
        for name, engine in engines.items():
            module.engine = engine
            counts = torch.zeros_like(probs, dtype=torch.long)
            for c in range(0, draws, chunk):
                rollout = module.sample(batch, min(chunk, draws - c), seed=5000 + c)
                first = rollout.completion_ids[:, 0].view(len(ids), -1)
                for i in range(len(ids)):
                    counts[i] += torch.bincount(first[i], minlength=probs.shape[1])
            tv = [0.5 * (counts[i] / draws - probs[i]).abs().sum().item() for i in range(len(ids))]
            out["engines"][name] = [
                {**chi_square(counts[i], probs[i]), "tv": round(tv[i], 4), "tv_of_exact_draws": round(tv_exact[i], 4),
                 "top_p": round(probs[i].max().item(), 4)} for i in range(len(ids))]
    finally:
        module.generation_config, module.engine = saved
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("hf_dir")
    parser.add_argument("rounds", nargs="?", type=int, default=3)
    parser.add_argument("--first-token-draws", type=int, default=0)
    parser.add_argument("--engines", nargs="+", default=["decode_loop", "hf_generate"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4, help="prompts of the batch (the records: 4)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    import torch

    from benchmarks.bench_common import stand_in
    from rloo_lightning import RLOOModule
    from rloo_lightning.data import PromptDataModule
    from rloo_lightning.engines.decode import DecodeLoopEngine
    from rloo_lightning.engines import HFGenerateEngine

    torch.set_num_threads(args.threads)
    hf_dir, rounds = args.hf_dir, args.rounds
    module = RLOOModule(hf_dir, rewards={"funcs": ["rloo_lightning.tasks.arithmetic.reward"]},
                        sampling={"k": 16, "max_new_tokens": args.max_new_tokens, "temperature": 0.7},
                        kl={"beta": 0.05})
    module.configure_model()
    stand_in(module, "log", lambda *a, **k: None)
    data = PromptDataModule(tokenizer_name_or_path=hf_dir, task="arithmetic", batch_size=args.rows,
                            num_train_rows=2000, num_val_rows=32, max_new_tokens=args.max_new_tokens)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    engines = {"decode_loop": DecodeLoopEngine(), "hf_generate": HFGenerateEngine()}
    if args.first_token_draws:
        _emit(first_token_fit(module, batch, {e: engines[e] for e in args.engines}, args.first_token_draws), args.out)
        return
    out = {}
    for name, engine in engines.items():
        module.engine = engine
        stats: dict[str, list] = {"logp": [], "entropy": [], "length": [], "reward": []}
        first: list[int] = []
        for seed in range(rounds):
            rollout = module.sample(batch, 16, seed=1000 + seed)
            rollout.scores, rollout.rewards = module.score(rollout)
            with torch.no_grad():
                logp, entropy = module.logprobs(module.policy, rollout, with_entropy=True)
            mask = rollout.completion_mask.float()
            stats["logp"].append(((logp * mask).sum() / mask.sum()).item())
            stats["entropy"].append(((entropy * mask).sum() / mask.sum()).item())
            stats["length"].append(mask.sum(1).mean().item())
            stats["reward"].append(rollout.rewards.float().mean().item())
            first += rollout.completion_ids[:, 0].tolist()
        out[name] = {key: [round(x, 4) for x in values] for key, values in stats.items()}
        out[name]["first_tokens"] = Counter(first).most_common(5)
    _emit(out, args.out)


def _emit(result: dict, out: Path | None) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
