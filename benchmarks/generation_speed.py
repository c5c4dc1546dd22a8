"""Generation variants measured one at a time on the benchmark's rollout, and whether each is still pi_theta.

    python -m benchmarks generation_speed --model DIR         # a Hugging Face directory (SmolLM2 rebuilt
                                                              # by benchmarks/bench.py's prepare step)
    python -m benchmarks generation_speed --model tiny:reverse --prompts 16 --max-new-tokens 8
    python -m benchmarks generation_speed --model DIR --variants plain,shared --reps 7

The rollout is the benchmark's: ``--prompts`` prompts of the embedded ``reverse`` task (the model's chat template,
as PromptDataModule applies it), each sampled ``--k`` times at temperature 1, no top-k / top-p, ``--max-new-tokens``
tokens, seeded. Variants (each one change against ``plain``, except ``shared+chunked_head``):

- ``plain``: ``HFGenerateEngine(share_prompt=False)``: ``generate`` prefills all ``N*k`` rows.
- ``shared``: the default engine: each distinct prompt prefilled once, its KV cache repeated over its k rows.
- ``static``: ``plain`` with ``cache_implementation="static"`` (a preallocated cache, no concatenation per step).
- ``compiled``: ``static`` with ``torch.compile`` of the decode step (transformers' CompileConfig, on CPU too);
  its compile time is in ``first_s``.
- ``chunked_head``: ``plain`` with the LM head computed in vocabulary chunks of 4,096 rows during decoding (the
  ``[16, 576] x [576, 49152]`` matmul runs at a fraction of the small-matmul rate in one piece).
- ``shared+chunked_head``: both.
- ``continuous``: transformers' continuous batching (``generate_batch``, paged attention), one request per row.

Timed calls are interleaved across variants (``--reps`` rounds, after one untimed call each: ``first_s``). For each
variant, one more call with the same seed returns the log-probs of the processed logits it sampled from, and those
are compared with the training forward's (``sequence_logprobs``, fp32): ``max_abs_logp_diff`` over the sampled
tokens. ``same_tokens_as_plain`` says whether its tokens equal ``plain``'s (the same random draws). Prints one JSON
object.
"""

from __future__ import annotations

import copy
import statistics
import time
import types

import torch

from benchmarks.bench_common import emit_json, rollout_parser


VARIANTS = ("plain", "shared", "static", "compiled", "chunked_head", "shared+chunked_head", "continuous", "loop",
            "loop_no_chunk")


def main(argv: list[str] | None = None) -> None:
    parser = rollout_parser(__doc__.splitlines()[0], reps=5)
    parser.add_argument("--variants", default=",".join(v for v in VARIANTS if v not in ("compiled", "continuous")))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from benchmarks.bench_common import task_prompts
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import CompileConfig

    from rloo_lightning.engines.decode import DecodeLoopEngine
    from rloo_lightning.engines.decode import _chunked_head as chunked_head
    from rloo_lightning.algo.logprobs import completion_mask
    from rloo_lightning.forward import sequence_logprobs
    from rloo_lightning.models import load_causal_lm, load_tokenizer, resolve_model_path
    from rloo_lightning.engines import HFGenerateEngine
    from rloo_lightning.rollout import Rollout, default_eos_ids, sampling_config

    path = resolve_model_path(args.model)
    tok, model = load_tokenizer(path), load_causal_lm(path, dtype=torch.float32)
    model.eval().requires_grad_(False)
    ids, mask, prompt_ids, prompt_mask = task_prompts(tok, args.prompts, args.k)
    width = ids.shape[1]
    eos = default_eos_ids(tok, model.generation_config)
    config = sampling_config(args.max_new_tokens, eos, tok.pad_token_id)
    model.generation_config = GenerationConfig()
    original_head = model.lm_head.forward

    def run(variant: str, logprobs: bool = False, seed: int = 1):
        cfg = copy.deepcopy(config)
        if variant in ("static", "compiled"):
            cfg.cache_implementation = "static"
        if variant == "compiled":
            cfg.compile_config = CompileConfig(fullgraph=False, dynamic=False)
            cfg.compile_config._compile_all_devices = True
        if variant == "continuous":
            return _continuous(model, prompt_ids, prompt_mask, cfg, seed, logprobs)
        if variant.startswith("loop"):
            engine = DecodeLoopEngine(return_logprobs=logprobs, chunk_head=variant == "loop")
            with torch.inference_mode():
                return engine.generate(model, tok, prompt_ids, prompt_mask, cfg, seed)
        if "chunked_head" in variant:
            model.lm_head.forward = types.MethodType(chunked_head, model.lm_head)
        engine = HFGenerateEngine(return_logprobs=logprobs, share_prompt=variant.startswith("shared"))
        try:
            with torch.inference_mode():
                return engine.generate(model, tok, prompt_ids, prompt_mask, cfg, seed)
        finally:
            model.lm_head.forward = original_head

    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    first, times = {}, {v: [] for v in variants}
    for v in variants:
        start = time.perf_counter()
        run(v)
        first[v] = time.perf_counter() - start
    for _ in range(args.reps):
        for v in variants:
            start = time.perf_counter()
            run(v)
            times[v].append(time.perf_counter() - start)

    results, plain_ids = {}, None
    for v in variants:
        out_ids, logp = run(v, logprobs=True)
        out_ids = out_ids.clone()
        m = completion_mask(out_ids, eos)
        rollout = Rollout(k=args.k, prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=out_ids,
                          completion_mask=m, truncated=m.all(1), prompts=[], completions=[])
        with torch.inference_mode():
            train_logp, _ = sequence_logprobs(model, rollout, temperature=1.0, share_prompt=False)
        diff = float(((train_logp - logp.float()).abs() * m).max())
        if v == "plain":
            plain_ids = out_ids
        results[v] = {
            "median_s": round(statistics.median(times[v]), 4), "times_s": [round(t, 4) for t in times[v]],
            "first_s": round(first[v], 3), "completion_tokens": int(m.sum()),
            "max_abs_logp_diff": diff, "within_1e-4": diff <= 1e-4,
            "same_tokens_as_plain": None if plain_ids is None else bool(torch.equal(out_ids, plain_ids)),
        }
    base = results.get("plain", {}).get("median_s")
    for r in results.values():
        r["speed_vs_plain"] = round(base / r["median_s"], 3) if base else None
    emit_json({"model": args.model, "rows": len(prompt_ids), "prompt_width": width,
               "max_new_tokens": args.max_new_tokens, "threads": args.threads, "reps": args.reps,
               "torch": torch.__version__, "variants": results}, args.out)


def _continuous(model, prompt_ids, prompt_mask, cfg, seed, logprobs):
    """transformers' continuous batching: one request per row (its own copy of the prompt), seeded globally."""
    inputs = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask)]
    cfg = copy.deepcopy(cfg)
    cfg.output_logits = logprobs
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate_batch(inputs=inputs, generation_config=cfg, progress_bar=False)
    ordered = [out[key] for key in sorted(out, key=lambda r: int(str(r).rsplit("_", 1)[-1]))]
    width = max(len(o.generated_tokens) for o in ordered)
    ids = torch.full((len(ordered), width), cfg.pad_token_id)
    for i, o in enumerate(ordered):
        ids[i, :len(o.generated_tokens)] = torch.tensor(o.generated_tokens)
    if not logprobs:
        return ids
    logp = torch.zeros(ids.shape)
    for i, o in enumerate(ordered):
        if getattr(o, "logits", None):
            lg = torch.stack([torch.as_tensor(x).reshape(-1) for x in o.logits]).float()
            logp[i, :lg.shape[0]] = torch.log_softmax(lg / cfg.temperature, -1).gather(
                1, ids[i, :lg.shape[0], None]).squeeze(1)
    return ids, logp


if __name__ == "__main__":
    main()
