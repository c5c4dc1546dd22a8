"""Train a few steps on FIXED rollouts, single-process or DDP (gloo, CPU), and save what is needed to compare.

    python ddp_fixed_rollout.py --model DIR --out DIR --devices 2 --batch-size 4 [--steps 2] [--micro-batch-size 3]

The completions are a deterministic function of (prompt text, sample index) -- token ids from a
``torch.Generator`` seeded by a SHA-256 of the prompt -- and the reward is the task's own
deterministic reward, so a single process on 2B prompts and 2 ranks on B prompts each see
exactly the same sequences. The optimizer is plain SGD (no warm-up), so an update is linear in the
gradient and a 1e-7 difference in the gradient stays a 1e-7 difference in the weights.

Written to ``--out``:
    grads_rank{r}_step{s}.pt   the policy gradients in ``on_before_optimizer_step`` (after DDP's
                               all-reduce: the gradient the optimizer uses), every rank
    weights_rank{r}.pt         the policy weights at the end, every rank
    prompts_rank{r}.jsonl      the prompts of each step on each rank
    kept_rank{r}.jsonl         the rows each rank kept at each step (see :class:`DropRows`)
    metrics.csv                the logged metrics (rank 0's CSVLogger)
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from rloo_lightning.callbacks import RolloutHook
from rloo_lightning.data import PromptDataModule
from rloo_lightning.module import RLOOModule
from rloo_lightning.algo.logprobs import completion_mask
from rloo_lightning.rollout import Rollout

LETTERS = "abcdefgh"


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def fixed_completion_ids(tokenizer, prompt: str, j: int, max_new_tokens: int, eos_id: int) -> list[int]:
    """``max_new_tokens`` ids: letters, then EOS and padding (or no EOS: a truncated completion)."""
    gen = torch.Generator().manual_seed(_hash(f"{prompt}|{j}"))
    letters = tokenizer.convert_tokens_to_ids(list(LETTERS))
    n = int(torch.randint(1, max_new_tokens + 1, (1,), generator=gen))
    ids = [letters[i] for i in torch.randint(0, len(letters), (n,), generator=gen).tolist()]
    if n < max_new_tokens:
        ids += [eos_id] + [tokenizer.pad_token_id] * (max_new_tokens - n - 1)
    return ids


class DropRows(RolloutHook):
    """From ``global_step >= from_step`` on, drop the rows (prompt, j) whose hash is 0 mod 3.

    A function of the prompt text, so the single process drops the same rows as the ranks; the
    ranks then keep unequal numbers of rows, which is what ``rloo_lightning.update.loss_denominators`` divides by.
    Records the number of rows each rank kept in ``kept_rank{r}.jsonl``.
    """

    def __init__(self, out: Path, from_step: int) -> None:
        self.out, self.from_step = out, from_step

    def on_rollout(self, trainer, pl_module, rollout) -> None:
        if trainer.global_step >= self.from_step:
            k = rollout.k
            drop = [_hash(f"drop|{p}|{i % k}") % 3 == 0 for i, p in enumerate(rollout.prompts)]
            rollout.keep = rollout.keep & ~torch.tensor(drop, device=rollout.keep.device)
        with open(self.out / f"kept_rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "kept": int(rollout.keep.sum())}) + "\n")


class FixedRolloutRLOO(RLOOModule):
    """RLOOModule whose ``sample()`` returns fixed completions; saves gradients and prompts."""

    def __init__(self, *args, out: str = ".", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.out = Path(out)

    def sample(self, batch: dict, k: int, seed: int, greedy: bool = False, in_step: bool = False) -> Rollout:
        T = self.cfg.sampling.max_new_tokens
        eos = self.eos_token_ids[0]
        rows = [fixed_completion_ids(self.tokenizer, p, j, T, eos) for p in batch["prompt"] for j in range(k)]
        completion_ids = torch.tensor(rows, device=self.device)
        mask = completion_mask(completion_ids, self.eos_token_ids)
        ended = (torch.isin(completion_ids, torch.tensor(self.eos_token_ids, device=self.device)) & mask.bool()).any(1)
        rollout = Rollout(
            k=k,
            prompt_ids=batch["input_ids"].repeat_interleave(k, dim=0),
            prompt_mask=batch["attention_mask"].repeat_interleave(k, dim=0),
            completion_ids=completion_ids,
            completion_mask=mask,
            truncated=~ended,
            prompts=[p for p in batch["prompt"] for _ in range(k)],
            completions=[],
            columns={name: [v for v in values for _ in range(k)] for name, values in batch["columns"].items()},
        )
        rollout.completions = self.tokenizer.batch_decode(rollout.completion_token_lists(), skip_special_tokens=True)
        with open(self.out / f"prompts_rank{self.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": self.global_step, "prompts": list(batch["prompt"])}) + "\n")
        return rollout

    def on_before_optimizer_step(self, optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
        grads = {n: p.grad.detach().clone() for n, p in self.policy.named_parameters() if p.grad is not None}
        torch.save(grads, self.out / f"grads_rank{self.global_rank}_step{self.global_step}.pt")

    def on_train_end(self) -> None:
        state = {n: v.detach().clone() for n, v in self.policy.state_dict().items()}
        torch.save(state, self.out / f"weights_rank{self.global_rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--num-train-rows", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--drop-from-step", type=int, default=1, help="DropRows from this step on")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seed_everything(0)
    torch.set_num_threads(1)

    lr = args.lr
    module = FixedRolloutRLOO(
        args.model, rewards={"funcs": ["rloo_lightning.tasks.reverse.reward"]},
        sampling={"k": 4, "max_new_tokens": 6}, kl={"beta": 0.05},
        update={"warmup_ratio": 0.0, "micro_batch_size": args.micro_batch_size}, validation={"at_start": False},
        out=str(out), optimizer=lambda params: torch.optim.SGD(params, lr=lr),
    )
    data = PromptDataModule(tokenizer_name_or_path=args.model, task="reverse", batch_size=args.batch_size,
                            num_train_rows=args.num_train_rows, num_val_rows=4, max_new_tokens=6)
    trainer = Trainer(
        accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.steps, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1,
        logger=CSVLogger(str(out), name="", version=""), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[DropRows(out, args.drop_from_step)],
    )
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":
    main()
