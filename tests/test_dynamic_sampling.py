"""Dynamic sampling (DAPO): more prompts until the batch has enough groups with differing rewards."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from rloo_lightning import RLOOModule
from rloo_lightning.callbacks import RolloutHook
from rloo_lightning.data import PromptDataModule
from rloo_lightning.rollout import Rollout, concat_groups
from rloo_lightning.algo.advantages import informative_groups

BATCH, K = 4, 4


def _rollout(prompt_widths, comp_width, k=2, offset=0):
    n = len(prompt_widths)
    B = n * k
    prompt_ids = torch.zeros(B, max(prompt_widths), dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for g, w in enumerate(prompt_widths):
        prompt_ids[g * k:(g + 1) * k, -w:] = 10 + g
        prompt_mask[g * k:(g + 1) * k, -w:] = 1
    return Rollout(
        k=k, prompt_ids=prompt_ids, prompt_mask=prompt_mask,
        completion_ids=torch.arange(B * comp_width).view(B, comp_width) + offset,
        completion_mask=torch.ones(B, comp_width), truncated=torch.zeros(B, dtype=torch.bool),
        prompts=[f"p{offset}_{g}" for g in range(n) for _ in range(k)],
        completions=[f"c{offset}_{i}" for i in range(B)], columns={"answer": [i for i in range(B)]},
        scores={"r": torch.arange(B, dtype=torch.float) + offset}, rewards=torch.arange(B, dtype=torch.float) + offset,
    )


def test_concat_groups_pads_prompts_left_and_completions_right():
    a, b = _rollout([2, 3], 2), _rollout([5], 4, offset=100)
    out = concat_groups([(a, [1]), (b, [0])], pad_token_id=0)
    assert out.prompts == ["p0_1", "p0_1", "p100_0", "p100_0"]
    assert out.prompt_ids.shape == (4, 5) and out.completion_ids.shape == (4, 4)
    assert out.prompt_mask[:2].tolist() == [[0, 0, 1, 1, 1]] * 2  # left padding grew
    assert out.completion_mask[:2].tolist() == [[1, 1, 0, 0]] * 2  # right padding, out of the mask
    assert out.completion_ids[:2, :2].tolist() == a.completion_ids[2:4].tolist()
    assert out.rewards.tolist() == [2.0, 3.0, 100.0, 101.0]
    assert out.columns["answer"] == [2, 3, 0, 1] and out.scores["r"].tolist() == out.rewards.tolist()


class _Seen(RolloutHook):
    def __init__(self):
        self.rollouts = []

    def on_rollout(self, trainer, pl_module, rollout):
        self.rollouts.append((rollout.prompts, rollout.rewards.clone()))


class _Metrics(Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _fit(model_dir, root, reward, max_steps=2, ckpt_path=None, callbacks=(), max_rounds=4):
    module = RLOOModule(model_dir, rewards={"funcs": [reward]}, sampling={"k": K, "max_new_tokens": 6},
                        validation={"at_start": False}, dynamic_sampling={"enabled": True, "max_rounds": max_rounds},
                        optimizer=lambda p: torch.optim.SGD(p, lr=1e-2))
    data = PromptDataModule(tokenizer_name_or_path=model_dir, task="reverse", batch_size=BATCH, num_train_rows=64,
                            num_val_rows=4, max_new_tokens=6)
    trainer = Trainer(accelerator="cpu", max_steps=max_steps, limit_val_batches=0, logger=False,
                      default_root_dir=str(root), enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_train_steps=1, save_top_k=-1),
                                 *callbacks])
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module


@pytest.mark.slow  # a fit of up to 8 rounds a step (~5 s)
def test_the_batch_is_made_of_informative_groups(tiny_model_dir, tmp_path):
    seen, metrics = _Seen(), _Metrics()
    _fit(tiny_model_dir, tmp_path, "reward_helpers.coarse_length", max_steps=3, callbacks=[seen, metrics],
         max_rounds=8)
    assert len(seen.rollouts) == 3
    for prompts, rewards in seen.rollouts:
        assert len(prompts) == BATCH * K  # the batch size is kept
        assert informative_groups(rewards, K).all()  # and every group has differing rewards
    rounds = [row["train/dynamic_sampling_rounds"] for row in metrics.rows]
    fractions = [row["train/informative_groups"] for row in metrics.rows]
    assert any(r > 0 for r in rounds) and all(f < 1 for f in fractions[:1])  # extra rounds were needed


def test_cap_on_rounds_warns_and_keeps_the_batch_size(tiny_model_dir, tmp_path):
    seen, metrics = _Seen(), _Metrics()
    with pytest.warns(UserWarning, match="dynamic_sampling: step 0: 0 of 4 groups .*max_rounds=2"):
        _fit(tiny_model_dir, tmp_path, "reward_helpers.constant", max_steps=1, callbacks=[seen, metrics],
             max_rounds=2)
    prompts, rewards = seen.rollouts[0]
    assert len(prompts) == BATCH * K
    assert metrics.rows[0]["train/dynamic_sampling_rounds"] == 2


def test_extra_prompts_are_drawn_again_on_resume(tiny_model_dir, tmp_path):
    full = _fit(tiny_model_dir, tmp_path / "full", "reward_helpers.coarse_length", max_steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = _fit(tiny_model_dir, tmp_path / "resumed", "reward_helpers.coarse_length", max_steps=3,
                       ckpt_path=str(tmp_path / "full" / "ckpt" / "epoch=0-step=1.ckpt"))
    for a, b in zip(full.policy.parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow  # a DDP subprocess
def test_dynamic_sampling_under_ddp_keeps_ranks_in_step(tmp_path, tiny_model_dir, _cache_dir):
    """Ranks needing different numbers of rounds all take part in each round (no hang, same step count)."""
    from cli_harness import make_env, start_cli
    from rloo_lightning.runtime.tensorboard_logs import read_scalars
    from run_helpers import _fit_args

    args = _fit_args(tmp_path, tiny_model_dir, 3, "--trainer.strategy", "ddp", "--trainer.devices", "2",
                     "--data.num_train_rows", "32", "--model.dynamic_sampling.enabled", "true",
                     "--model.dynamic_sampling.max_rounds", "3",
                     "--model.rewards.funcs", "[reward_helpers.coarse_length]")
    run = start_cli("ddp_dynamic", args, tmp_path, make_env(_cache_dir), timeout=240).wait()
    assert run.rc == 0, run.explain()
    scalars = read_scalars(tmp_path / "lightning_logs" / "version_0")
    assert sorted(scalars["train/dynamic_sampling_rounds"]) == [0, 1, 2]
    assert all(0 <= v <= 1 for v in scalars["train/informative_groups"].values())
