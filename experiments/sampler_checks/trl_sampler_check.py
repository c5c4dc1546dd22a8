"""Does TRL's ``RLOOTrainer`` sample from ``softmax(logits / T)`` over the whole vocabulary, at every token of a
completion? Its own generation config, on the learning-parity hyperparameters (SmolLM2, arithmetic). Prints one
JSON object.

    python -m experiments.sampler_checks.trl_sampler_check --hf-dir DIR [--rows 16] [--seed 0] [--out FILE]

An ``RLOOTrainer`` is built as ``experiments/learning_parity/learning_parity.py`` builds it, and the policy generates
completions of ``--rows`` training prompts with ``trainer.generation_config``, as TRL's ``_generate`` calls ``generate``
(the model's shipped generation config merged in by transformers), asking only for the processed scores as well. Those
scores are what ``generate`` samples from. At every completion position up to the first EOS they are compared with
``log_softmax(logits / T)`` of one plain forward over prompt + completion: entries the logits processors set to ``-inf``
(a top-k, top-p or min-p cut would), and the largest log-probability difference over the whole vocabulary.
``experiments/sampler_checks/sampler_compare.py --first-token-draws`` tests the first token's draws; this covers every
position.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from experiments.learning_parity import learning_parity as lp
    _hyper, trl_config = lp._hyper, lp.trl_config
    from trl import RLOOTrainer

    from benchmarks.bench_common import emit_json, train_rows
    from benchmarks.bench_trl import trl_dataset, trl_reward
    from rloo_lightning.algo.logprobs import completion_mask, mask_positions
    from rloo_lightning.models import load_tokenizer

    h = _hyper()
    spec = dict(h, hf_dir=args.hf_dir, seed=args.seed, steps=1)
    tok = load_tokenizer(args.hf_dir)
    trainer = RLOOTrainer(model=args.hf_dir, reward_funcs=trl_reward(spec),
                          args=trl_config(spec, Path(tempfile.mkdtemp()) / "trl"),
                          train_dataset=trl_dataset(spec, tok), processing_class=tok)
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    config = copy.deepcopy(trainer.generation_config)
    config.output_scores = config.return_dict_in_generate = True

    rows = train_rows(dict(spec, num_train_rows=args.rows))
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                       add_generation_prompt=True) for r in rows]
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        out = model.generate(**enc, generation_config=config)
        P = enc["input_ids"].shape[1]
        completion = out.sequences[:, P:]
        attn = torch.cat([enc["attention_mask"], torch.ones_like(completion)], dim=1)
        logits = model(input_ids=out.sequences, attention_mask=attn, position_ids=mask_positions(attn)).logits
    scores = torch.stack(out.scores, dim=1).float()  # [B, T, V]: what generate sampled from
    exact = torch.log_softmax(logits[:, P - 1:-1].float() / h["temperature"], dim=-1)
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    live = completion_mask(completion, eos).bool()  # up to and including the first EOS
    diff = (torch.log_softmax(scores, dim=-1) - exact)[live]
    emit_json({
        "rows": completion.shape[0], "positions": int(live.sum()), "vocab": scores.shape[-1],
        "generation_config": {k: getattr(config, k) for k in ("do_sample", "temperature", "top_k", "top_p", "min_p",
                                                              "repetition_penalty", "eos_token_id")},
        "entries_set_to_minus_inf": int((~torch.isfinite(scores[live])).sum()),
        "max_abs_logprob_diff_whole_vocab": float(diff.abs().max()),
        "max_abs_logprob_diff_sampled_tokens": float((torch.log_softmax(scores, -1) - exact).gather(
            -1, completion[..., None]).squeeze(-1)[live].abs().max()),
    }, args.out)


if __name__ == "__main__":
    main()
