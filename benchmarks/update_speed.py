"""The update's forwards three ways on one sampled rollout: padded, shared prompts, packed.

    python -m benchmarks update_speed --model DIR             # SmolLM2 rebuilt by benchmarks/bench.py
    python -m benchmarks update_speed --model tiny:reverse --prompts 16 --max-new-tokens 8 --reps 30

One rollout of the benchmark's shape is sampled (the default engine; ``--prompts`` prompts of the ``reverse`` task x
``--k``, ``--max-new-tokens``), then, interleaved over ``--reps`` rounds, each variant's policy forward + backward
(log-probs with grad, a weighted sum backpropagated) and reference forward (no grad) is timed:

- ``padded``: what the module did before shared prompts: each row is its prompt (left-padded) and its completion
  (right-padded), the columns that are padding in every row cut (``update.share_prompt: false``).
- ``shared``: the default: each distinct prompt once, its KV cache serving its k completions.
- ``packed``: every row's real tokens (no padding) in one sequence, positions restarting per row, a
  block-diagonal causal mask (a 4D mask: CPU has no variable-length attention kernel, so attention runs over the
  whole packed length and masks what crosses rows).

Each variant's log-probs are checked against ``padded``'s (``max_abs_logp_diff`` over the completion tokens).
Prints one JSON object: median seconds per variant and phase, and the padding fraction of the padded batch.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.bench_common import emit_json, rollout_parser


def packed_logprobs(model, rollout, temperature: float) -> torch.Tensor:
    """``[B, T]`` log-probs from one packed forward: row i's real prompt and completion tokens back to back."""
    from rloo_lightning.algo.logprobs import token_logprobs

    pieces, positions, segments, targets = [], [], [], []
    lengths = rollout.completion_mask.sum(1).long().tolist()
    offset = 0
    for i, n in enumerate(lengths):
        prompt = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()]
        seq = torch.cat([prompt, rollout.completion_ids[i, :n]])
        pieces.append(seq)
        positions.append(torch.arange(len(seq)))
        segments.append(torch.full((len(seq),), i))
        # the logits at packed index offset + len(prompt) - 1 + t predict completion token t
        targets.append(offset + len(prompt) - 1 + torch.arange(n))
        offset += len(seq)
    ids, pos, seg = torch.cat(pieces)[None], torch.cat(positions)[None], torch.cat(segments)
    causal = torch.ones(len(seg), len(seg), dtype=torch.bool).tril()
    mask = (causal & (seg[:, None] == seg[None, :]))[None, None]  # True: may attend
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits[0]
    index = torch.cat(targets)
    flat = token_logprobs(logits[index][None], torch.cat([rollout.completion_ids[i, :n] for i, n in
                                                         enumerate(lengths)])[None], temperature)[0]
    out = torch.zeros(rollout.completion_ids.shape, dtype=flat.dtype)
    start = 0
    for i, n in enumerate(lengths):
        out[i, :n] = flat[start:start + n]
        start += n
    return out


def main(argv: list[str] | None = None) -> None:
    parser = rollout_parser(__doc__.splitlines()[0], reps=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import copy

    from benchmarks.bench_common import task_prompts
    from transformers import GenerationConfig

    from rloo_lightning.engines.decode import DecodeLoopEngine
    from rloo_lightning.algo.logprobs import completion_mask
    from rloo_lightning.forward import sequence_logprobs
    from rloo_lightning.models import load_causal_lm, load_tokenizer, resolve_model_path
    from rloo_lightning.rollout import Rollout, default_eos_ids, sampling_config

    path = resolve_model_path(args.model)
    tok, model = load_tokenizer(path), load_causal_lm(path, dtype=torch.float32)
    ids, mask, prompt_ids, prompt_mask = task_prompts(tok, args.prompts, args.k)
    width = ids.shape[1]
    eos = default_eos_ids(tok, model.generation_config)
    model.generation_config = GenerationConfig()
    with torch.inference_mode():
        out = DecodeLoopEngine().generate(model, tok, prompt_ids, prompt_mask,
                                          sampling_config(args.max_new_tokens, eos, tok.pad_token_id), seed=1)
    out = out.clone()
    m = completion_mask(out, eos)
    rollout = Rollout(k=args.k, prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=out, completion_mask=m,
                      truncated=m.all(1), prompts=[], completions=[])
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    model.train()
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0

    def logp(variant, net):
        if variant == "packed":
            return packed_logprobs(net, rollout, 1.0)
        return sequence_logprobs(net, rollout, temperature=1.0, share_prompt=variant == "shared")[0]

    def policy(variant):
        lp = logp(variant, model)
        (lp * m * torch.linspace(-1, 1, lp.shape[0])[:, None]).sum().backward()
        model.zero_grad(set_to_none=True)
        return lp.detach()

    def ref(variant):
        with torch.inference_mode():
            return logp(variant, reference).clone()

    variants = ["padded", "shared", "packed"]
    base = policy("padded")
    results = {}
    for v in variants:
        got = policy(v)
        ref(v)  # warm-up
        results[v] = {"max_abs_logp_diff": float(((got - base).abs() * m).max()), "policy_s": [], "reference_s": []}
    for _ in range(args.reps):
        for v in variants:
            for phase, fn in (("policy_s", policy), ("reference_s", ref)):
                start = time.perf_counter()
                fn(v)
                results[v][phase].append(time.perf_counter() - start)
    for r in results.values():
        for phase in ("policy_s", "reference_s"):
            r[f"{phase}_median"] = round(statistics.median(r[phase]), 4)
            r[phase] = [round(t, 4) for t in r[phase]]
    cut = int(prompt_mask.any(0).int().argmax())
    padded_cells = (prompt_mask[:, cut:].numel() + m[:, :int(m.sum(1).max())].numel())
    real = int(prompt_mask.sum() + m.sum())
    emit_json({"model": args.model, "rows": len(prompt_ids), "prompt_width": width - cut,
               "completion_tokens": int(m.sum()), "prompt_tokens_distinct": int(mask.sum()),
               "padding_fraction": round(1 - real / padded_cells, 4), "reps": args.reps,
               "threads": args.threads, "variants": results}, args.out)


if __name__ == "__main__":
    main()
