"""One update of ours and of TRL's ``RLOOTrainer`` on the same rollout from the same weights (SmolLM2, the
learning-parity hyperparameters): advantages, gradient and the AdamW step compared. Prints one JSON object.

    python -m experiments.trl_parity.parity_one_step --hf-dir DIR [--seed 0] [--out FILE]

Ours: ``RLOOModule.sample`` / ``score`` / ``rollout_loss`` on a batch of the arithmetic task, then
``torch.optim.AdamW`` (lr 5e-6, torch's weight decay) as ``configs/smollm2_arithmetic.yaml`` builds it. TRL:
an ``RLOOTrainer`` with ``experiments/learning_parity/learning_parity.py``'s ``trl_config``; its "old" and reference
log-probs from its own ``_get_per_token_logps_and_entropies``, the reward KL and leave-one-out advantages as
its ``_generate_and_score_completions`` forms them, its ``_compute_loss`` and backward, then its own optimizer
(``create_optimizer``: HF's parameter groups). The rollout (tokens and task rewards) is ours, fed to both.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from experiments.learning_parity import learning_parity as lp
    _hyper, trl_config = lp._hyper, lp.trl_config
    from trl import RLOOTrainer

    from benchmarks.bench_common import stand_in
    from benchmarks.bench_trl import trl_reward
    from rloo_lightning import RLOOModule
    from rloo_lightning.data import PromptDataModule

    h = _hyper()
    torch.manual_seed(args.seed)
    ours = RLOOModule(args.hf_dir, rewards={"funcs": [h["reward"]]},
                      sampling={"k": h["k"], "max_new_tokens": h["max_new_tokens"], "temperature": h["temperature"]},
                      kl={"beta": h["beta"]})
    ours.configure_model()
    stand_in(ours, "log", lambda *a, **k: None)
    data = PromptDataModule(tokenizer_name_or_path=args.hf_dir, task=h["task"], batch_size=h["prompts"],
                            num_train_rows=h["num_train_rows"], num_val_rows=32, max_new_tokens=h["max_new_tokens"],
                            seed=args.seed)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    rollout = ours.sample(batch, h["k"], seed=args.seed)
    rollout.scores, rollout.rewards = ours.score(rollout)
    ours.policy.train()
    loss, _ = ours.rollout_loss(rollout)
    loss.backward()
    g_ours = {n: p.grad.detach().clone() for n, p in ours.policy.named_parameters()}

    spec = dict(h, hf_dir=args.hf_dir, seed=args.seed, steps=1)
    config = trl_config(spec, Path(tempfile.mkdtemp()) / "trl")
    from datasets import Dataset

    trainer = RLOOTrainer(model=args.hf_dir, reward_funcs=trl_reward(spec), args=config,
                          train_dataset=Dataset.from_list([{"prompt": "x", "answer": "1"}] * 16),
                          processing_class=ours.tokenizer)
    model = trainer.model
    model.train()
    prompt_ids, prompt_mask = rollout.prompt_ids, rollout.prompt_mask
    completion_ids, completion_mask = rollout.completion_ids, rollout.completion_mask.long()
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    keep = completion_ids.shape[1]
    with torch.no_grad():
        old, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep, ids.shape[0])
        ref, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, keep, ids.shape[0])
    # as _generate_and_score_completions: k1 sequence KL from the "old" log-probs, in the reward; LOO baseline
    kl = ((old - ref) * completion_mask).sum(-1)
    rewards = rollout.rewards.float() - h["beta"] * kl
    grouped = rewards.view(-1, h["k"])
    base = (grouped.sum(1, keepdim=True) - grouped) / (h["k"] - 1)
    advantages = (grouped - base).view(-1)
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "old_logps": (old * completion_mask).sum(1),
              "advantages": advantages}
    trl_loss = trainer._compute_loss(model, inputs)
    trl_loss.backward()
    g_trl = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    def compare(a: dict, b: dict) -> dict:
        fa = torch.cat([a[n].flatten().double() for n in a])
        fb = torch.cat([b[n].flatten().double() for n in a])
        return {"norm_ours": fa.norm().item(), "norm_trl": fb.norm().item(),
                "rel_diff": ((fa - fb).norm() / fb.norm()).item(),
                "cosine": torch.nn.functional.cosine_similarity(fa, fb, dim=0).item()}

    out = {"rollout": {"rows": int(ids.shape[0]), "completion_tokens": int(completion_mask.sum()),
                       "task_reward_mean": rollout.rewards.float().mean().item()},
           "advantages_max_abs_diff": (rollout.advantages.float() - advantages).abs().max().item(),
           "kl_max_abs_diff": (rollout.kl.float() - kl).abs().max().item(),
           "loss": {"ours": loss.item(), "trl": trl_loss.item()},
           "gradient": compare(g_ours, g_trl)}

    before = {n: p.detach().clone() for n, p in ours.policy.named_parameters()}
    opt_ours = torch.optim.AdamW([p for p in ours.policy.parameters() if p.requires_grad], lr=h["lr"])
    opt_ours.step()
    step_ours = {n: p.detach() - before[n] for n, p in ours.policy.named_parameters()}
    before_trl = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt_trl = trainer.create_optimizer()
    out["trl_optimizer"] = {"class": type(opt_trl).__name__,
                            "groups": [{k: v for k, v in g.items() if k != "params"} | {"tensors": len(g["params"])}
                                       for g in opt_trl.param_groups]}
    opt_trl.step()
    step_trl = {n: p.detach() - before_trl[n] for n, p in model.named_parameters()}
    out["adamw_step"] = compare(step_ours, step_trl)
    text = json.dumps(out, indent=1, default=str)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
