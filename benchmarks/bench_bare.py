"""System (c) of ``benchmarks/bench.py``: the same RLOO step as a bare PyTorch loop, no framework.

    python -m benchmarks.bench_bare --spec spec.json --out result.json

Per step: sample k completions per prompt with HF ``generate`` and the same explicit sampling config
(``rloo_lightning.rollout.sampling_config``: every field set, KV cache on, seeded per step in a forked
RNG), decode, score with the task's reward, one policy forward with grad over prompt + completion
(logits kept for the completion positions only), ``token_logprobs`` and ``token_entropy`` as the
module uses them, one reference forward under ``no_grad``, sequence KL folded into the reward, the
leave-one-out advantages, the sequence-level REINFORCE loss, backward, AdamW step and the constant
(warm-up) schedule, and the module's training metrics (reward mean/std, zero-std groups, |advantage|,
completion length, clipped ratio, entropy, loss, KL), read back once per step.
"""

from __future__ import annotations

import copy

from benchmarks.bench_common import (
    Clock,
    child_args,
    encode_prompt,
    reward_fn,
    train_rows,
    write_result,
)


def main(argv: list[str] | None = None) -> None:
    args, spec = child_args(argv)

    import torch
    from transformers import GenerationConfig

    from rloo_lightning.algo.logprobs import completion_mask, token_entropy, token_logprobs
    from rloo_lightning.models import load_causal_lm, load_tokenizer
    from rloo_lightning.rollout import default_eos_ids, derive_seed, sampling_config

    seed, k, beta, temperature = spec["seed"], spec["k"], spec["beta"], spec["temperature"]
    n_prompts, steps = spec["prompts"], spec["total_steps"]
    torch.manual_seed(seed)
    model_dir = spec["hf_dir"]
    tok = load_tokenizer(model_dir)
    policy = load_causal_lm(model_dir, dtype=torch.float32)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    for model in (policy, reference):
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    policy.train()
    eos_ids = default_eos_ids(tok, policy.generation_config)
    gen_config = sampling_config(max_new_tokens=spec["max_new_tokens"], eos_token_ids=eos_ids,
                                 pad_token_id=tok.pad_token_id, temperature=temperature, top_k=0, top_p=1.0,
                                 repetition_penalty=1.0)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=spec["lr"])  # the quickstart's torch.optim.AdamW
    warmup = max(1, spec["warmup_steps_lr"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    reward = reward_fn(spec)

    rows = train_rows(spec)
    encoded = [encode_prompt(tok, r["prompt"]) for r in rows]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    per_epoch = len(rows) // n_prompts
    empty = GenerationConfig()

    results = []
    for step in range(steps):
        start = Clock.now()
        # -- batch: left-padded prompts ---------------------------------------------------------
        if step and step % per_epoch == 0:  # a new epoch: reshuffled as DistributedSampler does (seed + epoch)
            epoch = step // per_epoch
            order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        idx = order[(step % per_epoch) * n_prompts:(step % per_epoch + 1) * n_prompts]
        width = max(len(encoded[i]) for i in idx)
        ids = torch.full((n_prompts, width), tok.pad_token_id, dtype=torch.long)
        attn = torch.zeros((n_prompts, width), dtype=torch.long)
        for j, i in enumerate(idx):
            ids[j, width - len(encoded[i]):] = torch.tensor(encoded[i])
            attn[j, width - len(encoded[i]):] = 1
        prompt_ids, prompt_mask = ids.repeat_interleave(k, 0), attn.repeat_interleave(k, 0)

        # -- generation ---------------------------------------------------------------------------
        policy.eval()
        shipped, policy.generation_config = policy.generation_config, empty
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, 0, "train", step))
            out = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen_config)
        policy.generation_config = shipped
        policy.train()
        completion_ids = out[:, width:]
        mask = completion_mask(completion_ids, eos_ids)
        ended = (torch.isin(completion_ids, torch.tensor(eos_ids)) & mask.bool()).any(1)
        lengths = mask.sum(1).long()
        token_lists = [row[:n] for row, n in zip(completion_ids.tolist(), lengths.tolist())]
        texts = tok.batch_decode(token_lists, skip_special_tokens=True)

        # -- reward -------------------------------------------------------------------------------
        answers = [rows[i]["answer"] for i in idx for _ in range(k)]
        prompts = [rows[i]["prompt"] for i in idx for _ in range(k)]
        rewards = torch.tensor(reward(prompts, texts, token_lists, answer=answers), dtype=torch.float32)

        # -- policy forward (with grad) and reference forward (no grad) ------------------------------
        full = torch.cat([prompt_ids, completion_ids], 1)
        full_attn = torch.cat([prompt_mask, torch.ones_like(completion_ids)], 1)
        position_ids = (full_attn.cumsum(1) - 1).clamp(min=0)
        T = completion_ids.shape[1]
        logits = policy(input_ids=full, attention_mask=full_attn, position_ids=position_ids, use_cache=False,
                        logits_to_keep=T + 1).logits[:, :-1]
        logp = token_logprobs(logits, completion_ids, temperature)
        entropy = token_entropy(logits.detach(), temperature)
        del logits
        with torch.no_grad():
            ref_logits = reference(input_ids=full, attention_mask=full_attn, position_ids=position_ids,
                                   use_cache=False, logits_to_keep=T + 1).logits[:, :-1]
            ref_logp = token_logprobs(ref_logits, completion_ids, temperature)
            del ref_logits

        # -- KL into the reward, leave-one-out advantages, loss ----------------------------------------
        kl = ((logp.detach() - ref_logp) * mask).sum(1)
        shaped = (rewards - beta * kl).view(-1, k)
        advantages = (shaped - (shaped.sum(1, keepdim=True) - shaped) / (k - 1)).view(-1)
        loss = -(advantages * (logp * mask).sum(1)).sum() / advantages.shape[0]

        # -- update -------------------------------------------------------------------------------
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()

        # -- the module's training metrics, one read-back ---------------------------------------------
        with torch.no_grad():
            groups = rewards.view(-1, k)
            stds = groups.std(1, unbiased=False)
            metrics = torch.stack([
                rewards.mean(), stds.mean(), (stds == 0).float().mean(), advantages.abs().mean(),
                lengths.float().mean(), (~ended).float().mean(), (entropy * mask).sum() / mask.sum().clamp(min=1),
                loss.detach(), kl.mean(),
            ]).tolist()
        end = Clock.now()
        names = ["reward", "reward_std", "zero_std_groups", "advantage_abs", "completion_length",
                 "clipped_ratio", "entropy", "loss", "kl"]
        results.append({"step": step, "t_start": start, "total_s": end - start, "tokens": int(lengths.sum()),
                        "metrics": dict(zip(names, metrics))})
        results[-1]["reward"] = results[-1]["metrics"]["reward"]

    write_result(args.out, {"system": "c", "steps": results})


if __name__ == "__main__":
    main()
