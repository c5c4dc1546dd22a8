"""ReducedPrecisionEngine: a bf16 / int8 copy of the policy that reports its log-probs and follows the updates."""

from __future__ import annotations

import pytest
import torch

from module_helpers import configured_module, prompt_batch
from rloo_lightning.engines import ReducedPrecisionEngine, cpu_supports_bf16, reduced_precision
from rloo_lightning.forward import sequence_logprobs

needs_bf16 = pytest.mark.skipif(not cpu_supports_bf16(), reason="this CPU has no native bf16")


def _module(model_dir, engine, **groups):
    groups.setdefault("kl", {"beta": 0.0})
    return configured_module(model_dir, k=4, generation_engine=engine, **groups)


@needs_bf16
def test_bf16_copy_samples_and_reports_its_own_logprobs(tiny_model_dir):
    engine = ReducedPrecisionEngine("bfloat16")
    module = _module(tiny_model_dir, engine)
    rollout = module.sample(prompt_batch(module.tokenizer), 4, seed=1)
    assert next(engine.copy.parameters()).dtype == torch.bfloat16
    assert next(module.policy.parameters()).dtype == torch.float32  # the policy itself is untouched
    # the reported log pi_s is the bf16 copy's distribution (a full forward of the copy, up to bf16 rounding)
    with torch.no_grad():
        copy_logp = sequence_logprobs(engine.copy, rollout, slice(None), 1.0, False)[0].float()
        policy_logp = module.logprobs(module.policy, rollout)[0]
    mask = rollout.completion_mask.bool()
    torch.testing.assert_close(rollout.sampler_logp[mask], copy_logp[mask], rtol=0, atol=0.05)
    # bf16 is not pi_theta: the mismatch is measurable, and small
    gap = (policy_logp - rollout.sampler_logp)[mask].abs()
    assert 0 < gap.max() < 0.1


@needs_bf16
def test_copy_is_refreshed_once_after_each_optimizer_step(tiny_model_dir):
    engine = ReducedPrecisionEngine("bfloat16")
    module = _module(tiny_model_dir, engine)
    batch = prompt_batch(module.tokenizer)
    module.sample(batch, 4, seed=1)
    module.sample(batch, 4, seed=2)
    assert engine.refreshes == 1  # no update in between: the same copy
    with torch.no_grad():
        for p in module.policy.parameters():
            p.add_(0.05)
    engine.on_weights_updated(module.policy)
    assert engine.refreshes == 1  # lazy: at the next rollout
    module.sample(batch, 4, seed=3)
    assert engine.refreshes == 2
    for target, source in zip(engine.copy.state_dict().values(), module.policy.state_dict().values()):
        torch.testing.assert_close(target, source.to(torch.bfloat16))


def test_unsupported_setups_fail_at_setup_with_the_option_named(monkeypatch):
    with pytest.raises(RuntimeError, match="dtype=float16.*for GPUs"):
        ReducedPrecisionEngine("float16").check(torch.device("cpu"))
    monkeypatch.setattr(reduced_precision, "cpu_supports_bf16", lambda: False)
    with pytest.raises(RuntimeError, match="this CPU has no native bf16"):
        ReducedPrecisionEngine("bfloat16").check(torch.device("cpu"))
    with pytest.raises(ValueError, match="dtype must be one of"):
        ReducedPrecisionEngine("fp8")


@needs_bf16
def test_training_step_with_the_bf16_engine_logs_the_mismatch(tiny_model_dir):
    module = _module(tiny_model_dir, ReducedPrecisionEngine("bfloat16"), correction={"level": "token"})
    rollout = module.sample(prompt_batch(module.tokenizer), 4, seed=1)
    rollout.rewards = torch.rand(rollout.completion_ids.shape[0], generator=torch.Generator().manual_seed(0))
    loss, entropy = module.rollout_loss(rollout)
    metrics = module.log_train_metrics(rollout, entropy, loss)
    assert metrics["train/mismatch/kl_k3"] > 0 and rollout.is_weights.shape == rollout.completion_mask.shape


def test_int8_copy_through_torchao(tiny_model_dir):
    pytest.importorskip("torchao")
    engine = ReducedPrecisionEngine("int8")
    engine.check(torch.device("cpu"))
    module = _module(tiny_model_dir, engine)
    rollout = module.sample(prompt_batch(module.tokenizer), 4, seed=1)
    assert rollout.sampler_logp is not None
    assert "Int8" in type(engine.copy.model.layers[0].mlp.up_proj.weight).__name__
    mask = rollout.completion_mask.bool()
    with torch.no_grad():
        gap = (module.logprobs(module.policy, rollout)[0] - rollout.sampler_logp)[mask].abs()
    assert 0 < gap.max() < 0.5


@pytest.mark.slow  # a CLI subprocess
@needs_bf16
def test_cli_fit_with_the_bf16_engine_and_a_correction_logs_the_mismatch(tmp_path, _cache_dir):
    from cli_harness import CONFIGS, make_env, run_cli
    from rloo_lightning.runtime.tensorboard_logs import read_events

    engine = '{"class_path": "rloo_lightning.engines.ReducedPrecisionEngine", "init_args": {"dtype": "bfloat16"}}'
    run_cli("fit", ["fit", "--config", CONFIGS / "quickstart.yaml", "--trainer.max_steps", "3",
                    "--model.generation_engine", engine, "--model.correction.level", "sequence",
                    "--trainer.default_root_dir", tmp_path], tmp_path, make_env(_cache_dir))
    scalars = read_events(tmp_path / "lightning_logs" / "version_0")
    tags = set(scalars)
    assert {"train/mismatch/kl_k3", "train/mismatch/ratio_outside_0.9_1.1", "train/correction/weight_mean"} <= tags
    assert len(scalars["train/mismatch/kl_k3"]) == 3
