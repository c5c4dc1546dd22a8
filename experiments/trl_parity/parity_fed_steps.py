"""Several updates of ours and of TRL's ``RLOOTrainer`` fed the same rollouts, from the same weights (SmolLM2,
the learning-parity hyperparameters): each trainer's own loop, optimizer and schedule; the weights compared
after every step. Prints one JSON object.

    python -m experiments.trl_parity.parity_fed_steps --hf-dir DIR [--steps 8] [--seed 0] [--out FILE]

``experiments/trl_parity/parity_one_step.py`` compares one update; Adam's first step is ``g / |g|`` per coordinate,
blind to the gradient's scale, so a difference that builds up over steps (the optimizer's state, the schedule,
the loop) shows only here. The rollouts: ``--steps`` batches of the arithmetic task, sampled from the
initial policy with our sampler and scored by the task's reward. Ours: ``rloo-lightning fit`` with
``configs/smollm2_arithmetic.yaml`` (as ``experiments/learning_parity/learning_parity.py`` runs it), its ``sample``
returning the stored rollout of the step. TRL: ``RLOOTrainer`` with ``learning_parity.trl_config``, its ``_generate``
returning the stored prompt and completion ids and its ``_calculate_rewards`` the stored task rewards.
The trainers see the same tokens at every step; both are then off-policy after the first step, equally.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
import tempfile
from pathlib import Path


STATE: dict = {}  # the stored rollouts, the initial weights, the per-step records (one process)


def _save_step(model, path: Path) -> None:
    """The policy's weights after a step, fp32 on disk (a step of each system does not fit in memory twice)."""
    import torch

    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, path)


def _rows(ids, mask) -> list[list[int]]:
    """Each row's tokens where ``mask`` is set (a left-padded prompt's, a completion's up to its EOS)."""
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def _compare_deltas(ours_path: Path, model, init: dict) -> dict:
    """Weight change since the start (``init``: name -> tensor), ours (``ours_path``) against TRL's ``model``:
    norms, relative difference and cosine, accumulated per tensor in float64."""
    import torch

    ours = torch.load(ours_path)
    aa = bb = ab = dd = 0.0
    for n, p in model.named_parameters():
        init_n = init[n].double()
        a, b = ours[n].double() - init_n, p.detach().double() - init_n
        aa, bb, ab, dd = aa + a.square().sum().item(), bb + b.square().sum().item(), ab + (a * b).sum().item(), \
            dd + (a - b).square().sum().item()
    return {"delta_norm_ours": aa ** 0.5, "delta_norm_trl": bb ** 0.5, "rel_diff": (dd / bb) ** 0.5,
            "cosine": ab / (aa * bb) ** 0.5}


def ours_sampler(hf_dir: str, h: dict, seed: int):
    """Our module (its ``sample`` and ``score``) and the task's ``PromptDataModule`` for the learning-parity
    hyperparameters ``h`` (``learning_parity._hyper()``), set up: ``(module, data)``."""
    from rloo_lightning import RLOOModule
    from rloo_lightning.data import PromptDataModule

    module = RLOOModule(hf_dir, rewards={"funcs": [h["reward"]]},
                        sampling={"k": h["k"], "max_new_tokens": h["max_new_tokens"], "temperature": h["temperature"]},
                        kl={"beta": h["beta"]})
    module.configure_model()
    data = PromptDataModule(tokenizer_name_or_path=hf_dir, task=h["task"], batch_size=h["prompts"],
                            num_train_rows=h["num_train_rows"], num_val_rows=32, max_new_tokens=h["max_new_tokens"],
                            seed=seed)
    data.setup("fit")
    return module, data


def _fed_callback():
    import lightning.pytorch as L

    class FedRollouts(L.Callback):
        """Replaces the module's sampler by the stored rollouts; records the weights after each step."""

        def on_train_start(self, trainer, pl_module):
            from benchmarks.bench_common import stand_in

            def sample(batch, k, seed, greedy=False, in_step=False):  # RLOOModule.sample's, checked by stand_in
                STATE["fed"].append(pl_module.global_step)
                return copy.deepcopy(STATE["rollouts"][pl_module.global_step])

            stand_in(pl_module, "sample", sample)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            _save_step(pl_module.policy, STATE["work"] / f"ours_step{pl_module.global_step}.pt")
            STATE["ours_log"].append({k: float(trainer.callback_metrics[k]) for k in ("train/loss", "train/kl")})

    return FedRollouts


def __getattr__(name: str):  # `parity_fed_steps.FedRollouts` as a callback class path
    if name == "FedRollouts":
        return _fed_callback()
    raise AttributeError(name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    sys.modules.setdefault("parity_fed_steps", sys.modules[__name__])  # the CLI's callback path: this STATE

    import torch

    torch.set_num_threads(args.threads)
    from experiments.learning_parity import learning_parity as lp
    CONFIG, _hyper, trl_config = lp.CONFIG, lp._hyper, lp.trl_config
    from transformers import TrainerCallback
    from trl import RLOOTrainer

    from benchmarks.bench_common import emit_json, stand_in
    from benchmarks.bench_trl import trl_dataset, trl_reward
    from rloo_lightning.cli import main as cli_main

    h = _hyper()
    # -- the rollouts: our sampler on the initial policy, one batch of the task per step ----------------------
    sampler, data = ours_sampler(args.hf_dir, h, args.seed)
    rollouts = []
    with torch.no_grad():
        for step, batch in zip(range(args.steps), data.train_dataloader()):
            rollout = sampler.sample(batch, h["k"], seed=args.seed * 1000 + step)
            rollout.scores, rollout.rewards = sampler.score(rollout)
            rollouts.append(rollout)
    work = Path(tempfile.mkdtemp())
    STATE.update(rollouts=rollouts, init={n: p.detach().clone() for n, p in sampler.policy.named_parameters()},
                 ours_log=[], trl=[], trl_log=[], work=work, fed=[])
    tokenizer = sampler.tokenizer
    del sampler

    # -- ours: the CLI run of learning_parity.py, sampling replaced -------------------------------------------
    cli_main(["fit", "--config", str(CONFIG), "--model.model_name_or_path", args.hf_dir,
              "--model.policy.gguf_file", "null", "--trainer.max_steps", str(args.steps),
              "--trainer.limit_val_batches", "0", "--trainer.enable_checkpointing", "false",
              "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
              "--seed_everything", str(args.seed), "--data.seed", str(args.seed),
              "--trainer.default_root_dir", str(work), "--trainer.callbacks+=parity_fed_steps.FedRollouts"])
    if STATE["fed"] != list(range(args.steps)):  # the step took its rollout elsewhere than from `sample`
        raise SystemExit(f"ours' steps did not train on the stored rollouts: sample fed steps {STATE['fed']}")

    # -- TRL: its trainer and loop, generation and task rewards replaced --------------------------------------
    spec = dict(h, hf_dir=args.hf_dir, seed=args.seed, steps=args.steps)
    feed = iter(rollouts)
    current: dict = {}

    def generate(prompts):
        r = next(feed)
        current["rewards"] = r.rewards.float()
        prompt_ids, completion_ids = _rows(r.prompt_ids, r.prompt_mask), _rows(r.completion_ids, r.completion_mask)
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return prompt_ids, completion_ids, [[{"role": "assistant", "content": t}] for t in texts]

    class Record(TrainerCallback):
        def on_step_end(self, args_, state, control, model=None, **kwargs):
            ours = STATE["work"] / f"ours_step{state.global_step}.pt"
            STATE["trl"].append(_compare_deltas(ours, model, STATE["init"]))

        def on_log(self, args_, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                STATE["trl_log"].append({"loss": logs["loss"], "kl": logs.get("kl")})

    trainer = RLOOTrainer(model=args.hf_dir, reward_funcs=trl_reward(spec), args=trl_config(spec, work / "trl"),
                          train_dataset=trl_dataset(spec, tokenizer), processing_class=tokenizer, callbacks=[Record()])
    stand_in(trainer, "_generate", generate)  # TRL 1.16's signatures, checked
    stand_in(trainer, "_calculate_rewards",
             lambda inputs, prompts, completions, completion_ids_list: current["rewards"][:, None])
    trainer.train()

    steps = [{"step": i + 1, **cmp, "ours": STATE["ours_log"][i], "trl": STATE["trl_log"][i]}
             for i, cmp in enumerate(STATE["trl"])]
    shutil.rmtree(work)
    out = {"steps": steps, "rollout_rows": [int(r.completion_mask.shape[0]) for r in rollouts],
           "completion_tokens": [int(r.completion_mask.sum()) for r in rollouts],
           "task_reward_mean": [round(r.rewards.float().mean().item(), 4) for r in rollouts]}
    emit_json(out, args.out)


if __name__ == "__main__":
    main()
