"""Callbacks: zero-variance filter, KL monitor/controller, loggers, export, and their resume state."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_harness import CONFIGS, Proc, make_env, run_cli
from lightning.pytorch import Trainer

from rloo_lightning import RLOOModule
from rloo_lightning.callbacks import KLMonitor, SampleLogger, ZeroVarianceFilter
from rloo_lightning.algo.advantages import group_std, informative_groups
from rloo_lightning.callbacks.kl import adaptive_beta
from rloo_lightning.data import collate_prompts



def _module(model_dir: str, beta: float = 0.05, k: int = 3) -> RLOOModule:
    module = RLOOModule(model_dir, rewards={"funcs": ["rloo_lightning.tasks.reverse.reward"]},
                        sampling={"k": k, "max_new_tokens": 6}, kl={"beta": beta})
    module.configure_model()
    module.log = lambda *args, **kwargs: None  # no Lightning loop in these unit tests
    return module


def _perturb(module: RLOOModule, scale: float) -> None:
    """Move the policy away from the reference, so that KL != 0."""
    with torch.no_grad():
        for p in module.policy.parameters():
            p.add_(scale * torch.randn_like(p))


def _rollout(module: RLOOModule, prompts: list[str], rewards: list[float]):
    tok = module.tokenizer
    batch = collate_prompts([{"input_ids": tok(p)["input_ids"], "prompt": p, "columns": {}} for p in prompts],
                            tok.pad_token_id)
    rollout = module.sample(batch, module.cfg.sampling.k, seed=123)
    rollout.rewards = torch.tensor(rewards)
    rollout.scores = {"reward": rollout.rewards.clone()}
    return rollout


def _rows(rollout, rows: list[int]):
    """A copy of ``rollout`` restricted to ``rows`` (tensors and lists alike)."""
    idx = torch.tensor(rows)
    fields = {}
    for f in dataclasses.fields(rollout):
        v = getattr(rollout, f.name)
        if isinstance(v, torch.Tensor):
            v = v[idx]
        elif isinstance(v, list):
            v = [v[i] for i in rows]
        elif isinstance(v, dict):
            v = {n: (x[idx] if isinstance(x, torch.Tensor) else [x[i] for i in rows]) for n, x in v.items()}
        fields[f.name] = v
    return type(rollout)(**fields)


def _grads(module: RLOOModule, rollout, callbacks: list) -> tuple[torch.Tensor, list[torch.Tensor]]:
    module.trainer = Trainer(callbacks=callbacks, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    module.policy.zero_grad()
    loss, _ = module.rollout_loss(rollout)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in module.policy.parameters()]


def test_informative_groups_and_group_std():
    values = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 2.0, float("nan"), 2.0, float("nan"), 3.0, float("nan")])
    # groups: equal; spread; equal up to a NaN; a single valid value
    assert informative_groups(values, 3).tolist() == [False, True, False, False]
    assert informative_groups(torch.tensor([0.0, 0.05, 1.0, 1.0]), 2, atol=0.1).tolist() == [False, False]
    stds = group_std(values, 3)
    # group 1: mean 0.5, deviations -0.5, 0.5, 0 -> var 1/6
    assert stds.tolist() == pytest.approx([0.0, (1 / 6) ** 0.5, 0.0, 0.0])


def test_filter_gradient_equals_dropping_groups_by_hand(tiny_model_dir):
    module = _module(tiny_model_dir)
    rollout = _rollout(module, ["abc=", "bca=", "hgf="], [0.2, 0.9, 0.4, 0.5, 0.5, 0.5, 1.0, 0.0, 0.3])
    loss_f, grads_f = _grads(module, dataclasses.replace(rollout), [ZeroVarianceFilter()])
    by_hand = _rows(rollout, [0, 1, 2, 6, 7, 8])
    loss_h, grads_h = _grads(module, by_hand, [])
    assert torch.allclose(loss_f, loss_h, atol=1e-6)
    for gf, gh in zip(grads_f, grads_h):
        torch.testing.assert_close(gf, gh, atol=1e-6, rtol=1e-5)
    # and it does change the gradient compared with no filter (the dropped group's KL term)
    _, grads_none = _grads(module, dataclasses.replace(rollout), [])
    assert any(not torch.allclose(a, b) for a, b in zip(grads_f, grads_none))


def test_a_rollout_hook_may_replace_the_reward_the_baseline_sees(tiny_model_dir):
    # The hook contract: on_rollout may replace baseline_rewards (and drop rows); the advantages follow its values,
    # the task reward stays as scored.
    from rloo_lightning.algo.advantages import leave_one_out_advantages
    from rloo_lightning.callbacks import RolloutHook

    class Replace(RolloutHook):
        def on_rollout(self, trainer, pl_module, rollout):
            assert rollout.baseline_rewards is not None and rollout.keep.all()
            rollout.baseline_rewards = torch.tensor([1.0, 0.0, 0.0, 3.0, 0.0, 0.0])
            rollout.keep[5] = False

    module = _module(tiny_model_dir)
    rollout = _rollout(module, ["abc=", "bca="], [0.2, 0.9, 0.4, 0.5, 0.1, 0.3])
    _grads(module, rollout, [Replace()])
    want = leave_one_out_advantages(torch.tensor([1.0, 0.0, 0.0, 3.0, 0.0, float("nan")]), 3)
    torch.testing.assert_close(rollout.advantages, want)
    assert rollout.rewards.tolist() == pytest.approx([0.2, 0.9, 0.4, 0.5, 0.1, 0.3])
    assert rollout.loss_mask[5].sum() == 0 and rollout.loss_mask[0].sum() > 0


def test_filter_all_dropped_gives_zero_loss_that_touches_the_graph(tiny_model_dir):
    module = _module(tiny_model_dir)
    rollout = _rollout(module, ["abc=", "bca="], [0.5] * 6)
    loss, grads = _grads(module, rollout, [ZeroVarianceFilter()])
    assert loss.item() == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads)  # backward ran, every param got a (zero) grad


def test_filter_signal_baseline_keeps_groups_whose_kl_differs(tiny_model_dir):
    module = _module(tiny_model_dir)
    _perturb(module, 0.05)
    rollout = _rollout(module, ["abc=", "bca="], [0.5] * 6)
    flt = ZeroVarianceFilter(signal="baseline")
    _grads(module, rollout, [flt])
    # r is constant but r - beta*KL is not (sampled completions differ): nothing dropped
    assert rollout.keep.all() and flt.dropped_groups == 0 and flt.seen_groups == 2
    with pytest.raises(ValueError, match="signal"):
        ZeroVarianceFilter(signal="kl")


def test_adaptive_beta_direction_and_clip():
    assert adaptive_beta(0.1, kl=2.0, target=1.0, horizon=100, num_samples=10) > 0.1
    assert adaptive_beta(0.1, kl=0.5, target=1.0, horizon=100, num_samples=10) < 0.1
    assert adaptive_beta(0.1, kl=1.0, target=1.0, horizon=100, num_samples=10) == pytest.approx(0.1)
    # error clipped to +-0.2 (Ziegler et al. 2019)
    assert adaptive_beta(0.1, kl=100.0, target=1.0, horizon=100, num_samples=10) == pytest.approx(0.1 * 1.02)
    assert adaptive_beta(0.1, kl=0.0, target=1.0, horizon=100, num_samples=10) == pytest.approx(0.1 * 0.98)


@pytest.mark.parametrize("target, direction", [(1e-6, 1), (1e6, -1)])
def test_kl_monitor_moves_module_beta(tiny_model_dir, target, direction):
    module = _module(tiny_model_dir)
    _perturb(module, 0.05)
    rollout = _rollout(module, ["abc=", "bca="], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    before = float(module.beta)
    monitor = KLMonitor(target=target, horizon=10)
    _grads(module, rollout, [monitor])
    assert rollout.kl.abs().sum() > 0
    assert (float(module.beta) - before) * direction > 0
    assert "beta" in module.state_dict()  # a checkpointed buffer


def test_kl_monitor_limit_stops_with_step_and_excess(tiny_model_dir):
    module = _module(tiny_model_dir)
    _perturb(module, 0.5)
    rollout = _rollout(module, ["abc=", "bca="], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    monitor = KLMonitor(limit=-1e9, on_limit="stop")
    with pytest.warns(UserWarning, match=r"exceeds the limit .* by .* at step 0; stopping"):
        _grads(module, rollout, [monitor])
    assert module.trainer.should_stop and monitor.limit_hits[0][0] == 0
    with pytest.raises(ValueError, match="on_limit"):
        KLMonitor(on_limit="explode")


def test_kl_monitor_without_a_reference_names_the_grouped_option():
    module = SimpleNamespace(cfg=SimpleNamespace(kl=SimpleNamespace(beta=0.0)))
    with pytest.raises(ValueError, match=r"model\.kl\.beta = 0 loads none; set model\.kl\.beta > 0") as err:
        KLMonitor().setup(None, module, "fit")
    assert "model.beta" not in str(err.value)  # the flat name is no option any more


def test_sample_logger_table(tiny_model_dir):
    module = _module(tiny_model_dir)
    rollout = _rollout(module, ["a|c=", "bca="], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    _grads(module, rollout, [])
    table = SampleLogger(num_rows=4).table(rollout)
    lines = table.splitlines()
    assert lines[0] == "| prompt | completion | reward | score/reward | advantage |"
    assert len(lines) == 2 + 4
    assert "a\\|c=" in lines[2]  # pipes escaped


# -- end to end through the CLI, with ModelCheckpoint / EarlyStopping / LearningRateMonitor ----------

def _fit(name: str, tmp: Path, cache: Path, max_steps: int, extra: list[str] = ()) -> Proc:
    """The CLI with the quickstart + callbacks configs (the warm-started tiny:reverse model); raises on failure."""
    args = ["fit", "--config", CONFIGS / "quickstart.yaml", "--config", CONFIGS / "callbacks.yaml",
            "--trainer.max_steps", max_steps, "--trainer.val_check_interval", "2", "--trainer.default_root_dir", tmp,
            "--trainer.enable_progress_bar", "false", "--data.num_train_rows", "256", "--data.num_val_rows", "16",
            "--trainer.callbacks+=rloo_lightning.callbacks.SampleLogger", "--trainer.callbacks.every_n_steps=2",
            *extra]
    return run_cli(name, args, tmp, make_env(cache), timeout=600)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, _cache_dir):
    tmp = tmp_path_factory.mktemp("cb_fit")
    _fit("fit", tmp, _cache_dir, 4)
    return tmp


@pytest.mark.slow
def test_tensorboard_has_scalars_histograms_text(fitted):
    from rloo_lightning.runtime.tensorboard_logs import read_tags

    tags = read_tags(fitted / "lightning_logs" / "version_0")
    for tag in ["train/filtered_groups", "train/kl_seq_mean", "train/kl_seq_q90", "train/kl_token_mean",
                "train/beta", "train/group_reward_std_mean", "train/zero_variance_fraction",
                "train/score/reward_std", "val/reward", "lr-AdamW"]:
        assert tag in tags["scalars"], tag
    for tag in ["hist/reward", "hist/advantage", "hist/group_reward_std", "hist/score/reward"]:
        assert tag in tags["histograms"], tag
    assert any(t.startswith("samples") for t in tags["tensors"])


@pytest.mark.slow
def test_export_loads_and_generates(fitted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = fitted / "lightning_logs" / "version_0" / "hf_model"
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("abc=", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]


@pytest.mark.slow
def test_callback_state_survives_resume(fitted, _cache_dir):
    ckpt_dir = fitted / "lightning_logs" / "version_0" / "checkpoints"
    state = torch.load(ckpt_dir / "last.ckpt", map_location="cpu", weights_only=True)  # no pickled code
    filt = next(v for k, v in state["callbacks"].items() if k.startswith("ZeroVarianceFilter"))
    assert filt["seen_groups"] == 4 * 16  # 4 steps x batch_size 16 prompts
    assert "beta" in state["state_dict"]
    _fit("resumed", fitted, _cache_dir, 6, ["--ckpt_path", str(ckpt_dir / "last.ckpt")])
    last = sorted((fitted / "lightning_logs").glob("version_*/checkpoints/last.ckpt"))[-1]
    state = torch.load(last, map_location="cpu", weights_only=True)
    filt = next(v for k, v in state["callbacks"].items() if k.startswith("ZeroVarianceFilter"))
    assert state["global_step"] == 6
    assert filt["seen_groups"] == 6 * 16  # counted on from the restored 64, not from 0


@pytest.mark.parametrize(("limit", "expected"), [(None, 5), (1.0, 5), (2, 2), (0.4, 2), (0, 0)])
def test_validate_at_start_honours_limit_val_batches(limit, expected):
    """The validation before the first update covers what every later one does: ``limit_val_batches`` batches."""
    from types import SimpleNamespace

    from rloo_lightning.callbacks.base import ValidateAtStart

    batches = [{"input_ids": torch.zeros(1, 1)} for _ in range(5)]
    seen = []

    def evaluate_batch(batch, batch_idx):
        seen.append(batch_idx)
        return {"reward": torch.tensor([1.0])}

    module = SimpleNamespace(device=torch.device("cpu"), transfer_batch_to_device=lambda b, d, i: b,
                             evaluate_batch=evaluate_batch, print=lambda *a: None)
    trainer = SimpleNamespace(global_step=0, limit_val_batches=limit, loggers=[],
                              datamodule=SimpleNamespace(val_dataloader=lambda: batches))
    ValidateAtStart().on_train_start(trainer, module)
    assert seen == list(range(expected))
