"""System (b) of ``benchmarks/bench.py``: TRL's ``RLOOTrainer`` on the same work (needs the ``bench`` extra).

    python -m benchmarks.bench_trl --spec spec.json --out result.json

Configured to do the same work as ours: ``num_generations=k``, ``beta`` and ``learning_rate`` equal to ours,
``per_device_train_batch_size = prompts x k``, ``gradient_accumulation_steps=1``, ``num_iterations=1``,
``max_completion_length`` equal, ``temperature=1.0``, ``top_k=0``, ``top_p=1.0``,
``gradient_checkpointing=False``, ``use_cpu=True``, ``bf16=False``, ``use_vllm=False``, ``logging_steps=1``,
``report_to="none"``; and, so that the update is the same as ours (``MATCH_OURS``, unless the spec
says ``trl_own_defaults``): the quickstart's ``torch.optim.AdamW`` (not TRL's default fused kernel,
weight decay 0.01 as torch's default), no gradient clipping (Lightning's default), the constant
schedule with the same integer warm-up, dropout off. No checkpoints (``save_strategy="no"``).

The model is a local HF directory (TRL loads the policy and a second copy as the reference from it,
fp32); the dataset is the same task rows (chat ``messages`` when the tokenizer has a chat template,
as our ``use_chat_template: auto`` does); the reward is ours, wrapped for TRL's call.
Steps are timed from ``on_step_begin`` to ``on_step_end`` (generation, scoring, the no-grad policy
and reference forwards, forward + backward, optimizer and scheduler step).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.bench_common import Clock, child_args, reward_fn, train_rows, write_result


MATCH_OURS = {
    "optim": "adamw_torch",  # torch.optim.AdamW, as the quickstart (TRL's default: adamw_torch_fused)
    "weight_decay": 0.01,  # torch.optim.AdamW's default, which the quickstart keeps (HF default: 0.0)
    "max_grad_norm": 0.0,  # no clipping, as Lightning's default (HF default: 1.0); HF still computes the norm
    "disable_dropout": True,  # as our disable_dropout (no dropout in these models anyway)
}


def trl_dataset(spec: dict, tok):
    """The task's training rows as TRL's dataset: chat ``messages`` prompts when the tokenizer has a chat
    template (as our ``use_chat_template: auto``), every other column kept for the reward."""
    from datasets import Dataset

    chat = bool(tok.chat_template)
    return Dataset.from_list([
        {"prompt": [{"role": "user", "content": r["prompt"]}] if chat else r["prompt"],
         **{c: v for c, v in r.items() if c != "prompt"}}
        for r in train_rows(spec)
    ])


def trl_reward(spec: dict):
    """Our reward function, wrapped for TRL's call."""
    ours = reward_fn(spec)

    def reward(prompts, completions, completion_ids, **columns):
        # TRL passes chat completions as [{"role": "assistant", "content": text}]; ours takes the text.
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        for extra in ("trainer_state", "log_extra", "log_metric"):
            columns.pop(extra, None)
        return ours(prompts, texts, completion_ids, **columns)

    reward.__name__ = ours.__name__
    return reward


def main(argv: list[str] | None = None) -> None:
    args, spec = child_args(argv)

    import torch
    from transformers import TrainerCallback
    from trl import RLOOConfig, RLOOTrainer

    from rloo_lightning.models import load_tokenizer

    tok = load_tokenizer(spec["hf_dir"])
    dataset = trl_dataset(spec, tok)
    reward = trl_reward(spec)

    steps: dict[int, dict] = {}

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = Clock.now()

        def on_step_end(self, args, state, control, **kwargs):
            end = Clock.now()
            steps.setdefault(state.global_step, {})["total_s"] = end - self.start
            steps[state.global_step]["t_start"] = self.start

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                entry = steps.setdefault(state.global_step, {})
                entry["reward"] = logs["reward"]
                entry["mean_length"] = logs.get("completions/mean_length")
                entry["kl"] = logs.get("kl")
                entry["entropy"] = logs.get("entropy")

    match = {} if spec.get("trl_own_defaults") else dict(MATCH_OURS)
    if not spec.get("trl_own_defaults"):
        warmup = spec["warmup_steps_lr"]
        match.update(lr_scheduler_type="constant_with_warmup" if warmup > 0 else "constant", warmup_steps=warmup)
    B = spec["prompts"] * spec["k"]
    config = RLOOConfig(
        output_dir=str(Path(spec["workdir"]) / "trl"),
        num_generations=spec["k"],
        beta=spec["beta"],
        learning_rate=spec["lr"],
        per_device_train_batch_size=B,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],  # the quickstart's: 1.0
        top_k=0,
        top_p=1.0,
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,
        use_vllm=False,
        logging_steps=1,
        report_to="none",
        max_steps=spec["total_steps"],
        seed=spec["seed"],
        data_seed=spec["seed"],
        save_strategy="no",
        model_init_kwargs={"dtype": torch.float32},
        **match,
    )
    trainer = RLOOTrainer(model=spec["hf_dir"], reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tok, callbacks=[Timer()])
    trainer.train()

    results = []
    for step in sorted(steps):
        entry = steps[step]
        if "total_s" not in entry:
            continue
        length = entry.get("mean_length")
        results.append({"step": step - 1, "t_start": entry["t_start"], "total_s": entry["total_s"],
                        "tokens": round(length * B) if length is not None else None,
                        "reward": entry.get("reward"),
                        "metrics": {k: entry.get(k) for k in ("kl", "entropy", "mean_length")}})
    write_result(args.out, {"system": "b", "steps": results, "config": {
        k: (str(v) if not isinstance(v, (int, float, str, bool, type(None))) else v)
        for k, v in config.to_dict().items()
        if k in ("num_generations", "beta", "learning_rate", "per_device_train_batch_size", "optim",
                 "weight_decay", "max_grad_norm", "lr_scheduler_type", "warmup_steps", "max_completion_length",
                 "temperature", "top_k", "top_p", "num_iterations", "steps_per_generation", "generation_batch_size")
    }})


if __name__ == "__main__":
    main()
