"""The anchors' variants as RLOOModule options, each checked against its source's formula written out here.

The formulas are spelled out with explicit loops over sequences and tokens (not through
``rloo_lightning.algo.kl`` / ``advantages`` / ``losses``), on a real rollout of the tiny model, and compared with
the module's advantages, loss value and gradient.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from rloo_lightning import RLOOModule
from module_helpers import REWARD, configured_module, scored_rollout

from rloo_lightning.data import PromptDataModule

K = 3


def _module(model_dir: str, **groups) -> RLOOModule:
    """``configured_module`` with k = K and kl.beta = 0.2 unless ``kl`` says otherwise."""
    m = configured_module(model_dir, k=K, **{**groups, "kl": {"beta": 0.2, **groups.get("kl", {})}})
    with torch.no_grad():  # move the policy off the reference so that the KL terms are not 0
        gen = torch.Generator().manual_seed(0)
        for p in m.policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return m


_rollout = scored_rollout


def _logps(module, rollout):
    """Policy log-probs with grad, reference log-probs without, both ``[B, T]`` (0 past the end)."""
    logp, _ = module.logprobs(module.policy, rollout)
    if not module.ref is not None:
        return logp, None
    with torch.no_grad():
        ref = module.reference_logprobs(rollout, [slice(None)])
    return logp, ref


def _loo(values: list[float]) -> list[float]:
    k = len(values)
    return [v - (sum(values) - v) / (k - 1) for v in values]


def _grads(module) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in module.policy.parameters()]
    module.policy.zero_grad(set_to_none=True)
    return out


def _compare(module, rollout, expected_loss_fn):
    """Module loss/gradient vs ``expected_loss_fn(logp, ref, mask)`` on the same rollout."""
    loss, _ = module.rollout_loss(rollout)
    loss.backward()
    got = _grads(module)
    logp, ref = _logps(module, rollout)
    expected = expected_loss_fn(logp, ref, rollout.completion_mask)
    expected.backward()
    want = _grads(module)
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    assert any(g.abs().max() > 1e-5 for g in want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)


def _k3(lp: float, rf: float) -> float:
    return math.exp(rf - lp) - (rf - lp) - 1.0


def test_k3_in_the_reward_before_the_baseline(tiny_model_dir):
    """kl.estimator=k3, placement reward: R_i = r_i - beta * sum_t k3_t, then leave-one-out."""
    module = _module(tiny_model_dir, kl={"estimator": "k3"})
    rollout = _rollout(module)
    module.rollout_loss(rollout)
    logp, ref = _logps(module, rollout)
    mask = rollout.completion_mask
    B, T = mask.shape
    shaped = []
    for i in range(B):
        kl = sum(_k3(logp[i, t].item(), ref[i, t].item()) for t in range(T) if mask[i, t])
        shaped.append(rollout.rewards[i].item() - 0.2 * kl)
    expected = [a for g in range(B // K) for a in _loo(shaped[g * K:(g + 1) * K])]
    torch.testing.assert_close(rollout.advantages, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_openrlhf_token_reward_placement_with_token_mean(tiny_model_dir):
    """OpenRLHF rloo: A_i = r_i - mean_{j!=i} r_j on the raw reward; R_t = -beta*k1_t + [t=last]*A_i;
    G_t = sum_{t'>=t} R_t'; loss = sum_{i,t} -G_t logp_t / (number of completion tokens)."""
    module = _module(tiny_model_dir, kl={"placement": "token_reward"}, update={"loss_aggregation": "token_mean"})
    rollout = _rollout(module)

    def expected(logp, ref, mask):
        B, T = mask.shape
        r = rollout.rewards.tolist()
        adv = [a for g in range(B // K) for a in _loo(r[g * K:(g + 1) * K])]
        total, tokens = 0.0, 0
        for i in range(B):
            n = int(mask[i].sum())
            rewards = [-0.2 * (logp[i, t].item() - ref[i, t].item()) + (adv[i] if t == n - 1 else 0.0)
                       for t in range(n)]
            for t in range(n):
                total = total - sum(rewards[t:]) * logp[i, t]
                tokens += 1
        return total / tokens

    _compare(module, rollout, expected)


def test_kl_as_a_loss_term_k3_with_seq_mean_token_mean(tiny_model_dir):
    """GRPO / verl use_kl_loss: LOO on the raw reward; loss = mean_i [sum_t (-A_i logp_t + beta*k3_t) / n_i],
    with k3's gradient through logp."""
    module = _module(tiny_model_dir, kl={"placement": "loss", "estimator": "k3"},
                     update={"loss_aggregation": "seq_mean_token_mean"})
    rollout = _rollout(module)

    def expected(logp, ref, mask):
        B = mask.shape[0]
        r = rollout.rewards.tolist()
        adv = [a for g in range(B // K) for a in _loo(r[g * K:(g + 1) * K])]
        total = 0.0
        for i in range(B):
            n = int(mask[i].sum())
            d = ref[i, :n] - logp[i, :n]
            total = total + ((-adv[i] * logp[i, :n]).sum() + 0.2 * (torch.exp(d) - d - 1).sum()) / n
        return total / B

    _compare(module, rollout, expected)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_sum_norm"])
def test_aggregations_by_hand(tiny_model_dir, mode):
    """token_mean: sum -A_i logp_it / N_tok; seq_mean_token_sum_norm (Dr.GRPO): / (B * max_new_tokens)."""
    module = _module(tiny_model_dir, update={"loss_aggregation": mode}, kl={"beta": 0.0})
    rollout = _rollout(module)

    def expected(logp, ref, mask):
        B = mask.shape[0]
        r = rollout.rewards.tolist()
        adv = [a for g in range(B // K) for a in _loo(r[g * K:(g + 1) * K])]
        total = sum(-adv[i] * logp[i, : int(mask[i].sum())].sum() for i in range(B))
        return total / (mask.sum() if mode == "token_mean" else B * 6)

    _compare(module, rollout, expected)


@pytest.mark.slow  # over ~5 s (the fast loop: pytest -m "not slow")
@pytest.mark.parametrize("options", [
    {"update": {"loss_aggregation": "token_mean"}},
    {"kl": {"placement": "token_reward"}, "update": {"loss_aggregation": "seq_mean_token_mean"}},
    {"kl": {"placement": "loss", "estimator": "k3"}, "update": {"loss_aggregation": "seq_mean_token_sum_norm"}},
])
def test_variants_are_micro_batch_invariant(tiny_model_dir, options):
    grads = []
    for micro in (None, 5):
        module = _module(tiny_model_dir, **{**options, "update": {**options["update"], "micro_batch_size": micro}})
        loss, _ = module.rollout_loss(_rollout(module))
        module.on_before_backward(loss)
        loss.backward()
        grads.append(_grads(module))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_baselines_by_hand_and_the_group_mean_identity(tiny_model_dir):
    rollout_of = {}
    for baseline in ("leave_one_out", "group_mean", "group_mean_std", "none"):
        module = _module(tiny_model_dir, advantage={"baseline": baseline}, kl={"beta": 0.0})
        rollout = _rollout(module)
        module.rollout_loss(rollout)
        rollout_of[baseline] = rollout
    r = rollout_of["none"].rewards.tolist()
    assert rollout_of["none"].advantages.tolist() == pytest.approx(r)  # vanilla REINFORCE: A = r
    grpo = []
    for g in range(len(r) // K):
        group = r[g * K:(g + 1) * K]
        mean = sum(group) / K
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (K - 1))  # Bessel, as torch.std / TRL
        grpo += [(x - mean) / (std + 1e-4) for x in group]
    assert rollout_of["group_mean_std"].advantages.tolist() == pytest.approx(grpo, rel=1e-5)
    # group mean (Dr.GRPO) = (k-1)/k x leave-one-out: the same direction, a learning-rate change
    torch.testing.assert_close(rollout_of["group_mean"].advantages,
                               rollout_of["leave_one_out"].advantages * (K - 1) / K, rtol=1e-5, atol=1e-7)


def test_moving_average_baseline_uses_earlier_batches_only(tiny_model_dir):
    module = _module(tiny_model_dir, advantage={"baseline": "moving_average", "baseline_decay": 0.5}, kl={"beta": 0.0})
    first = _rollout(module)
    module.rollout_loss(first)
    assert first.advantages.tolist() == pytest.approx(first.rewards.tolist())  # no history: b = 0
    second = _rollout(module)
    second.rewards = second.rewards + 1.0
    module.rollout_loss(second)
    b = first.rewards.mean().item()  # bias-corrected EMA after one batch = its mean
    assert second.advantages.tolist() == pytest.approx((second.rewards - b).tolist(), rel=1e-5)
    state = module.advantage_estimator.moving_average.state_dict()
    assert state["num_updates"] == 2
    # EMA: 0.5*(0.5*m1) + 0.5*m2, bias-corrected by 1 - 0.25
    m1, m2 = first.rewards.mean().item(), second.rewards.mean().item()
    assert module.advantage_estimator.moving_average.value == pytest.approx((0.25 * m1 + 0.5 * m2) / 0.75, rel=1e-6)


def test_whitening_normalisation_and_advantage_clip(tiny_model_dir):
    module = _module(tiny_model_dir, advantage={"whiten": True}, shaping={"mask_truncated_completions": True})
    rollout = _rollout(module)
    rollout.truncated[:] = False
    rollout.truncated[1] = True  # one dropped row stays at advantage 0 and out of the statistics
    module.rollout_loss(rollout)
    kept = rollout.advantages[rollout.keep]
    assert rollout.advantages[1] == 0
    assert kept.mean().abs() < 1e-5 and (kept.std() - 1).abs() < 1e-3
    module = _module(tiny_model_dir, advantage={"normalize_rewards": True, "baseline": "none", "clip": [-0.5, 0.5]},
                     kl={"beta": 0.0})
    rollout = _rollout(module)
    module.rollout_loss(rollout)
    r = rollout.rewards
    z = (r - r.mean()) / (r.std() + 1e-4)
    torch.testing.assert_close(rollout.advantages, z.clamp(-0.5, 0.5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("clip_mode", ["sequence", "token"])
def test_second_update_on_a_rollout_is_the_clipped_surrogate(tiny_model_dir, clip_mode):
    """TRL: loss = mean_i -min(rho_i A_i, clip(rho_i, 1-e_lo, 1+e_hi) A_i), rho_i = exp(sum_t logp - old);
    verl (token): sum_{i,t} -min(rho_it A_i, clip(rho_it) A_i) / N_tok with dual clip max(., -c A) for A < 0."""
    update = {"updates_per_rollout": 2, "clip_mode": clip_mode, "clip_eps_low": 0.1, "clip_eps_high": 0.15}
    if clip_mode == "token":
        update.update(loss_aggregation="token_mean", dual_clip=1.5)
    module = _module(tiny_model_dir, update=update, kl={"beta": 0.0})
    rollout = _rollout(module)
    first, _ = module.rollout_loss(rollout)
    old = rollout.old_logp.clone()
    assert old is not None and rollout.clip_stats == {}  # the first update is plain REINFORCE (ratio 1)
    with torch.no_grad():  # an optimizer step happened in between
        gen = torch.Generator().manual_seed(9)
        for p in module.policy.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    adv = rollout.advantages.tolist()

    def expected(logp, ref, mask):
        B = mask.shape[0]
        if clip_mode == "sequence":
            total = 0.0
            for i in range(B):
                n = int(mask[i].sum())
                rho = torch.exp((logp[i, :n] - old[i, :n]).sum())
                total = total - torch.minimum(rho * adv[i], rho.clamp(0.9, 1.15) * adv[i])
            return total / B
        total, tokens = 0.0, 0
        for i in range(B):
            for t in range(int(mask[i].sum())):
                rho = torch.exp(logp[i, t] - old[i, t])
                term = torch.maximum(-rho * adv[i], -rho.clamp(0.9, 1.15) * adv[i])
                if adv[i] < 0:
                    term = torch.minimum(term, torch.tensor(-1.5 * adv[i]))
                total, tokens = total - (-term), tokens + 1
        return total / tokens

    _compare(module, rollout, expected)
    assert set(rollout.clip_stats) >= {"clip_low", "clip_high", "clip_region"}


def test_bad_parity_options_name_the_option(tiny_model_dir):
    cases = [({"advantage": {"baseline": "max"}}, "advantage.baseline must be one of"),
             ({"kl": {"estimator": "k4"}}, "kl.estimator must be one of"),
             ({"kl": {"placement": "after"}}, "kl.placement must be one of"),
             ({"update": {"loss_aggregation": "mean"}}, "update.loss_aggregation must be one of"),
             ({"update": {"updates_per_rollout": 0}}, "update.updates_per_rollout must be >= 1"),
             ({"update": {"dual_clip": 3.0}}, "update.dual_clip must be > 1 and needs update.clip_mode='token'"),
             ({"update": {"clip_eps_low": 1.0}}, "update.clip_eps_low must be in [0, 1)"),
             ({"kl": {"ref_sync_steps": 4, "beta": 0.0}}, "kl.ref_sync_steps needs a reference of its own"),
             ({"advantage": {"clip": [1, -1]}}, "advantage.clip must be [low, high]"),
             ({"advantage": {"baseline_decay": 1.0}}, "advantage.baseline_decay must be in [0, 1)"),
             ({"update": {"updates_per_rollout": 2}, "kl": {"placement": "token_reward"}},
              "use update.clip_mode='token'")]
    for options, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            RLOOModule(tiny_model_dir, rewards={"funcs": [REWARD]}, **options)


# -- through Lightning ---------------------------------------------------------------------------
class _Record(Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        ro = pl_module.reuse.stored
        self.rows.append({"prompts": list(batch["prompt"]),
                          "completions": list(ro.completions) if ro is not None else None,
                          "clip": "train/clip_region" in trainer.callback_metrics})


def _fit(model_dir, root, max_steps, ckpt_path=None, callbacks=(), **groups):
    module = RLOOModule(model_dir, rewards={"funcs": [REWARD]}, sampling={"k": 4, "max_new_tokens": 6},
                        validation={"at_start": False}, optimizer=lambda p: torch.optim.SGD(p, lr=0.5), **groups)
    repeat = groups.get("update", {}).get("updates_per_rollout", 1)  # what the CLI links
    data = PromptDataModule(tokenizer_name_or_path=model_dir, task="reverse", batch_size=4, num_train_rows=32,
                            num_val_rows=4, max_new_tokens=6, repeat_batches=repeat)
    trainer = Trainer(accelerator="cpu", max_steps=max_steps, limit_val_batches=0, logger=False,
                      default_root_dir=str(root), enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_train_steps=1, save_top_k=-1),
                                 *callbacks])
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module


@pytest.mark.slow  # fits (~8 s)
def test_updates_per_rollout_reuses_each_rollout_and_resumes_mid_way(tiny_model_dir, tmp_path):
    record = _Record()
    full = _fit(tiny_model_dir, tmp_path / "full", 4, callbacks=[record],
                update={"updates_per_rollout": 2, "clip_mode": "token"})
    rows = record.rows
    assert rows[0]["prompts"] == rows[1]["prompts"] != rows[2]["prompts"] == rows[3]["prompts"]
    assert rows[0]["completions"] == rows[1]["completions"] != rows[2]["completions"] == rows[3]["completions"]
    assert not rows[0]["clip"] and rows[1]["clip"]  # clip fractions are logged from the first reuse on
    # resume from the checkpoint after step 3 (one update done on the second rollout): the same end
    ckpt = tmp_path / "full" / "ckpt" / "epoch=0-step=3.ckpt"
    assert "rloo_rollout" in torch.load(ckpt, weights_only=True)
    resumed = _fit(tiny_model_dir, tmp_path / "resumed", 4, ckpt_path=str(ckpt),
                   update={"updates_per_rollout": 2, "clip_mode": "token"})
    for a, b in zip(full.policy.parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow  # fits (~8 s)
def test_ref_sync_mixes_the_policy_into_the_reference_and_is_checkpointed(tiny_model_dir, tmp_path):
    """kl.ref_sync_steps=1: at the start of step 1, ref = alpha * policy_after_step_0 + (1 - alpha) * initial."""
    module = _fit(tiny_model_dir, tmp_path / "a", 2, kl={"beta": 0.1, "ref_sync_steps": 1, "ref_sync_alpha": 0.25})
    first = tmp_path / "a" / "ckpt" / "epoch=0-step=1.ckpt"  # written after step 0, before the mix
    ckpt = torch.load(first, weights_only=True)
    start = RLOOModule(tiny_model_dir, rewards={"funcs": [REWARD]}, kl={"beta": 0.1})
    start.configure_model()
    names = [n for n, _ in start.policy.named_parameters()]
    for name, ref, init in zip(names, module.reference.parameters(), start.policy.parameters()):
        after_step_0 = ckpt["state_dict"][f"policy.{name}"]
        assert torch.equal(ckpt["rloo_reference"][name], init.detach())
        torch.testing.assert_close(ref, 0.25 * after_step_0 + 0.75 * init.detach())
    assert any(not torch.equal(r, p) for r, p in zip(module.reference.parameters(), start.policy.parameters()))
    # a run resumed from that checkpoint mixes at the same point and ends with the same reference
    resumed = _fit(tiny_model_dir, tmp_path / "b", 2, ckpt_path=str(first),
                   kl={"beta": 0.1, "ref_sync_steps": 1, "ref_sync_alpha": 0.25})
    for a, b in zip(resumed.reference.parameters(), module.reference.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(resumed.policy.parameters(), module.policy.parameters()):
        assert torch.equal(a, b)
