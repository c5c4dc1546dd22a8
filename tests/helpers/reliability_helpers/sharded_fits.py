"""The helper process pair of the sharded tests (``tests/test_models_sharding_runs.py``), run as a script:
``python sharded_fits.py helper --model DIR --out DIR --run NAME STRATEGY STEPS MICRO ...`` runs each fit in order
in one pair of processes (one start-up, one process group): a Trainer on fixed rollouts (``ddp_fixed_rollout``'s
module) under FSDP2, DDP or FSDP1, saving full gradients and weights; FSDP2's first probes generation.
``tests/helpers/`` is on the processes' ``PYTHONPATH`` (cli_harness).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


PROBE_TOKENS = 12
# The DDP tests' shapes (the fits here take them too): B prompts per rank, 64 rows
DDP_B = 4  # prompts per rank per step; the single process takes 2 * DDP_B
DDP_ROWS = 64


def _helper_main(argv: list[str]) -> None:  # pragma: no cover - runs in subprocesses
    import argparse

    from lightning.pytorch import seed_everything

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--run", nargs=4, action="append", required=True,
                        metavar=("NAME", "STRATEGY", "STEPS", "MICRO"),
                        help="one Trainer.fit, in order (STRATEGY: ddp, fsdp2 or fsdp1; MICRO 0: no micro-batches); "
                             "the first starts rank 1 and the process group, the others reuse them")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name, strategy, steps, micro in args.run:
        assert strategy in ("ddp", "fsdp2", "fsdp1"), strategy
        seed_everything(0)  # each run starts as it would in a process of its own
        _helper_fit(args.model, Path(args.out) / name, strategy, int(steps), int(micro) or None)


def _helper_fit(model_dir: str, out: Path, strategy_name: str, steps: int,
                micro_batch_size: int | None) -> None:  # pragma: no cover - runs in subprocesses
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from reliability_helpers.ddp_fixed_rollout import DropRows, FixedRolloutRLOO
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import GenerationConfig

    from rloo_lightning.data import PromptDataModule
    from rloo_lightning.module import RLOOModule
    from rloo_lightning.rollout import generate_rollout
    from rloo_lightning.models.sharding import gathered_for_generation, generation_path

    out.mkdir(parents=True, exist_ok=True)

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def sharded_now(policy) -> bool:
        """Some parameter of the policy is stored sharded (a DTensor shard, or an FSDP1 flat shard)."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(hasattr(p, "full_tensor") for p in policy.parameters()):
            return True
        units = [m for m in policy.modules() if isinstance(m, FullyShardedDataParallel)]
        # an FSDP1 unit whose unsharded flat parameter is not allocated holds only its shard
        return any(u._handle is not None and u._handle.uses_sharded_strategy and u._handle.needs_unshard()
                   for u in units)

    class Collectives(TorchDispatchMode):
        """Counts the collectives dispatched while active: every c10d op (all-gathers, all-reduces, ...),
        whichever Python API issued it (FSDP2 calls ``dist.all_gather_single``, transformers ``dist.all_reduce``)."""

        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
                self.n += 1
            return func(*args, **(kwargs or {}))

    class Probed(FixedRolloutRLOO):
        def probe(self, batch: dict) -> None:
            rank, policy, strategy = self.global_rank, self.policy, self.trainer.strategy
            counter = {"n": 0}
            seen = {}
            vocab = len(self.tokenizer)
            eos = self.eos_token_ids[0]
            base = dict(max_new_tokens=PROBE_TOKENS, pad_token_id=self.tokenizer.pad_token_id, do_sample=True,
                        temperature=1.0, top_k=0, top_p=1.0)
            if rank == 0:  # every token ends the completion: 1 token
                cfg = GenerationConfig(**base, eos_token_id=list(range(vocab)))
            else:  # EOS forbidden until the budget: PROBE_TOKENS tokens
                cfg = GenerationConfig(**base, eos_token_id=[eos], min_new_tokens=PROBE_TOKENS)
            engine = self.engine
            bound = engine.generate

            def counted(model, *a, **k):
                # The whole engine call is counted (the default decode loop runs the forwards itself); the
                # synced_gpus default that gathered_for_generation gave the policy's generate is recorded.
                seen["synced_gpus"] = getattr(model.generate, "keywords", {}).get("synced_gpus")
                with Collectives() as mode:
                    result = bound(model, *a, **k)
                counter["n"] += mode.n
                return result

            sharded_before = sharded_now(policy)
            engine.generate = counted
            saved = self.generation_config
            self.generation_config = cfg
            try:
                rollout = RLOOModule.sample(self, batch, 2, seed=123)  # through gathered_for_generation
            finally:
                self.generation_config = saved
                del engine.generate
            gathered, gathered_kwargs = counter["n"], dict(seen)
            # control: gather=False, the same different lengths: the policy stays sharded, every forward
            # all-gathers (the counter sees it) and synced_gpus=True keeps the ranks paired (no hang)
            counter["n"] = 0
            engine.generate = counted
            try:
                with gathered_for_generation(policy, strategy, gather=False):
                    ungathered = generate_rollout(policy, self.tokenizer, batch["input_ids"], batch["attention_mask"],
                                                  batch["prompt"], batch["columns"], 1, cfg, 7, engine=engine)
            finally:
                del engine.generate
            record = {
                "path": generation_path(policy, strategy),
                "sharded": sharded_before,
                "sharded_after": sharded_now(policy),
                "lengths": rollout.completion_mask.sum(1).long().tolist(),
                "gathered_collectives": gathered,
                "ungathered_collectives": counter["n"],
                "ungathered_lengths": ungathered.completion_mask.sum(1).long().tolist(),
                "generate_kwargs": gathered_kwargs,
                "ungathered_generate_kwargs": dict(seen),
            }
            (out / f"probe_rank{rank}.json").write_text(json.dumps(record))
            print(f"probe rank {rank}: {record}", flush=True)

        def training_step(self, batch, batch_idx):
            if self.global_step == 0 and strategy_name != "ddp":
                self.probe(batch)
            return super().training_step(batch, batch_idx)

        def on_before_optimizer_step(self, optimizer) -> None:
            RLOOModule.on_before_optimizer_step(self, optimizer)
            if strategy_name == "fsdp1":
                return
            grads = {n: full(p.grad).detach().clone() for n, p in self.policy.named_parameters() if p.grad is not None}
            torch.save(grads, out / f"full_grads_rank{self.global_rank}_step{self.global_step}.pt")
            if strategy_name == "ddp":  # and as ddp_fixed_rollout.py names them (the DDP tests read both)
                torch.save(grads, out / f"grads_rank{self.global_rank}_step{self.global_step}.pt")

        def on_train_end(self) -> None:
            if strategy_name == "fsdp1":
                return
            state = {n: full(v).detach().clone() for n, v in self.policy.state_dict().items()}
            torch.save(state, out / f"full_weights_rank{self.global_rank}.pt")
            if strategy_name == "ddp":
                torch.save(state, out / f"weights_rank{self.global_rank}.pt")

    module = Probed(
        model_dir, rewards={"funcs": ["rloo_lightning.tasks.reverse.reward"]},
        sampling={"k": 4, "max_new_tokens": 6}, kl={"beta": 0.05},
        update={"warmup_ratio": 0.0, "micro_batch_size": micro_batch_size}, validation={"at_start": False},
        out=str(out), optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
    )
    data = PromptDataModule(tokenizer_name_or_path=model_dir, task="reverse", batch_size=DDP_B,
                            num_train_rows=DDP_ROWS, num_val_rows=4, max_new_tokens=6)
    if strategy_name == "ddp":
        strategy = "ddp"
    elif strategy_name == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        class CPUFSDPStrategy(FSDPStrategy):
            """Lightning's FSDPStrategy on CPU, for this test: the accelerator connector refuses a CPU only for the
            exact type, and FSDP1 needs ``device_id=cpu`` where Lightning passes the device index (None on CPU)."""

            def _setup_model(self, model):
                from torch.distributed.fsdp import FullyShardedDataParallel

                return FullyShardedDataParallel(
                    module=model, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                    sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self.kwargs)

        strategy = CPUFSDPStrategy(auto_wrap_policy={LlamaDecoderLayer})
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, limit_val_batches=0,
        num_sanity_val_steps=0, log_every_n_steps=1, logger=CSVLogger(str(out), name="", version=""),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[DropRows(out, 1)],
    )
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":  # pragma: no cover
    if sys.argv[1:2] == ["helper"]:
        _helper_main(sys.argv[2:])
    else:
        sys.exit(f"usage: {sys.argv[0]} helper --model DIR --out DIR --run NAME ddp|fsdp2|fsdp1 STEPS MICRO ...")
