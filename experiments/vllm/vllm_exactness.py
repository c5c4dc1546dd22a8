"""The exactness check with vLLM as the sampler: is ``RLOOModule.training_step`` with ``VLLMEngine`` an unbiased
estimator of the RLOO gradient, with and without the importance correction?

    python -m experiments.vllm.vllm_exactness --out experiments/vllm/vllm_exactness.json   # in the vllm env

A real (tiny, head size 32) Llama whose completions can be enumerated: a six-token vocabulary, two new tokens at
most, three prompts. The exact objective J = mean_p sum_y pi_theta(y|p) r(p, y) (beta = 0) and its gradient by
autograd over every completion; the sampled side is the module's training step with ``VLLMEngine`` sampling, ``-grad``
of its loss one draw (the z-test of :mod:`rloo_lightning.verify.exactness`, on the LM head's gradient). Cases: vLLM
at the module's temperature (fp32: vLLM ~ pi_theta) without and with the default correction, and vLLM at another
temperature (``sampler_temperature``, a known mismatch) without correction, with sequence weights uncapped
(unbiased in theory) and with the default token-level weights capped at 2 (biased in theory). Prints one JSON
object; ``--out`` writes it too.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from benchmarks.bench_common import emit_json, stand_in


PROMPTS = ("ab", "ba", "aab")
EOS, TEMPERATURE, MAX_NEW = 2, 1.0, 2
CASES = {  # name: (sampler_temperature, correction)
    "vllm, no correction": (None, {"level": "none"}),
    "vllm, default correction (token TIS, cap 2)": (None, {}),
    "vllm at T=1.6, no correction": (1.6, {"level": "none"}),
    "vllm at T=1.6, sequence weights, uncapped": (1.6, {"level": "sequence", "cap": None}),
    "vllm at T=1.6, token weights, cap 2": (1.6, {"level": "token", "cap": 2.0}),
}


def reward(prompts, completions, completion_ids, **columns) -> list[float]:
    """A fixed pseudo-random reward in [0, 1) of (prompt, completion up to its first EOS)."""
    out = []
    for p, ids in zip(prompts, completion_ids):
        ids = list(ids)
        ids = ids[: ids.index(EOS) + 1] if EOS in ids else ids[:MAX_NEW]
        key = PROMPTS.index(p) * 1000 + sum(t * 7**j for j, t in enumerate(ids)) * 10 + len(ids)
        out.append(((key * 2654435761) % 1009) / 1009)
    return out


def completions() -> list[list[int]]:
    """Every completion of at most ``MAX_NEW`` tokens over the six-token vocabulary, ended by EOS or the budget."""
    out = [[EOS]]
    for first in range(6):
        if first != EOS:
            out += [[first, second] for second in range(6)]
    return out


def exact_gradient(model, tok) -> torch.Tensor:
    """``grad J`` with respect to the LM head's weight, by enumeration (``[V * H]`` float64)."""
    model.zero_grad()
    total = 0.0
    for p in PROMPTS:
        prompt = tok(p, add_special_tokens=False)["input_ids"]
        seqs = completions()
        width = max(map(len, seqs))
        ids = torch.tensor([prompt + s + [0] * (width - len(s)) for s in seqs])
        logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1].float() / TEMPERATURE
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, len(prompt):, None]).squeeze(-1)
        mask = torch.tensor([[1.0] * len(s) + [0.0] * (width - len(s)) for s in seqs])
        seq_logp = (logp * mask).sum(1)
        r = torch.tensor(reward([p] * len(seqs), None, seqs))
        total = total + (seq_logp.exp() * r).sum() / len(PROMPTS)
    total.backward()
    grad = model.lm_head.weight.grad.reshape(-1).double().clone()
    model.zero_grad()
    return grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=8, help="copies of each prompt per batch (k samples each)")
    parser.add_argument("--cases", nargs="+", type=int, help="indices into the cases (default: all)")
    parser.add_argument("--out")
    args = parser.parse_args()
    from rloo_lightning import RLOOModule
    from rloo_lightning.data import collate_prompts
    from rloo_lightning.verify.exactness import z_test
    from rloo_lightning.rollout import derive_seed
    from rloo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama
    from rloo_lightning.engines.vllm import VLLMEngine

    tok = build_char_tokenizer("ab", model_max_length=16)  # <pad> <bos> <eos> <unk> a b
    model = build_tiny_llama(tok, hidden_size=64, num_layers=1, num_heads=2, max_position_embeddings=16, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(4)  # a peakier policy: the temperature mismatch is material
    model.config.tie_word_embeddings = False
    exact = exact_gradient(model, tok)
    rows = [{"input_ids": tok(p, add_special_tokens=False)["input_ids"], "prompt": p, "columns": {}}
            for p in PROMPTS for _ in range(args.repeats)]
    batch = collate_prompts(rows, tok.pad_token_id)
    results, chosen = {}, [list(CASES)[i] for i in (args.cases or range(len(CASES)))]
    for name in chosen:
        sampler_t, correction = CASES[name]
        start = time.time()
        engine = VLLMEngine(sampler_temperature=sampler_t)
        module = RLOOModule("tiny", rewards={"funcs": [reward]}, generation_engine=engine,
                            sampling={"k": 4, "max_new_tokens": MAX_NEW, "temperature": TEMPERATURE,
                                      "eos_token_ids": [EOS]},
                            kl={"beta": 0.0}, correction=correction, validation={"at_start": False})
        module.attach(model, tok)
        stand_in(module, "log", lambda *a, **kw: None)
        draws = []
        for i in range(args.draws):
            # Without a trainer global_step stays 0: each draw gets a seed of its own, as each step of a run does.
            stand_in(module, "sampling_seed", lambda stream, step, _i=i: derive_seed(0, stream, _i))
            loss = module.training_step(batch, i)
            model.zero_grad()
            loss.backward()
            draws.append(-model.lm_head.weight.grad.reshape(-1).double().clone())
        engine.close()
        test = z_test(torch.stack(draws), exact)
        results[name] = {"correction": module.cfg.correction.level, "cap": module.cfg.correction.cap,
                         "sampler_temperature": sampler_t, **dataclasses.asdict(test),
                         "seconds": round(time.time() - start, 1)}
        print(f"{name}: unbiased={test.unbiased} max|z|={test.max_abs_z:.2f} (crit {test.z_crit:.2f}) "
              f"relative bias {test.relative_bias:.3f}", file=sys.stderr)
    emit_json({"study": "vllm_exactness", "date": time.strftime("%Y-%m-%d"), "draws": args.draws,
               "repeats": args.repeats, "k": 4, "prompts": PROMPTS, "temperature": TEMPERATURE, "results": results},
              args.out)


if __name__ == "__main__":
    main()
