"""A sampler that is not exactly pi_theta, in RLOOModule: the correction options, the engine's log-probs, the
mismatch diagnostics and importance weights in the step, through rollout reuse and dynamic sampling.
"""

from __future__ import annotations

import pytest
import torch

from module_helpers import PROMPTS, configured_module, prompt_batch
from rloo_lightning.config import CorrectionArgs
from rloo_lightning.engines import HFGenerateEngine


@pytest.mark.parametrize("bad, match", [
    ({"level": "seq"}, "correction.level must be one of"),
    ({"mode": "clip"}, "correction.mode must be one of"),
    ({"cap": 0}, "correction.cap must be > 0"),
    ({"cap": 2.0, "lower": 3.0}, r"correction.lower must be in \[0, correction.cap\)"),
    ({"level": "token", "reject": "product"}, "correction.reject must be one of"),
    ({"level": "token", "reject": "geometric", "reject_upper": 0}, "correction.reject_upper must be > 0"),
    ({"level": "token", "reject": "geometric", "reject_upper": 1.01, "reject_lower": 1.02},
     r"correction.reject_lower must be in \[0, correction.reject_upper\)"),
    ({"level": "topr", "mode": "mask"}, "correction.level 'topr' truncates at 1"),
    ({"reject": "geometric"}, "correction.reject filters a correction's weights: set correction.level"),
    ({"level": "none", "reject": "sequence"}, "correction.reject filters a correction's weights"),
])
def test_bad_correction_options(bad, match):
    with pytest.raises(ValueError, match=match):
        CorrectionArgs(**bad)


def test_correction_refuses_kl_in_the_loss(tiny_model_dir):
    from rloo_lightning import RLOOModule

    with pytest.raises(ValueError, match="correction.level needs kl.placement"):
        RLOOModule(tiny_model_dir, rewards={"funcs": ["rloo_lightning.tasks.reverse.reward"]},
                   kl={"placement": "loss"}, correction={"level": "sequence"})


# -- the engine's log-probs and the module ---------------------------------------------------------------------
@pytest.mark.parametrize("sampler_temperature", [None, 2.0])
def test_engine_logprobs_are_those_of_the_distribution_it_sampled(tiny_model_dir, sampler_temperature):
    """The reported log pi_s equals the training forward's log-probs at the sampler's temperature."""
    engine = HFGenerateEngine(return_logprobs=True, sampler_temperature=sampler_temperature)
    module = configured_module(tiny_model_dir, k=4, generation_engine=engine, kl={"beta": 0.0})
    rollout = module.sample(prompt_batch(module.tokenizer), 4, seed=3)
    assert rollout.sampler_logp is not None and rollout.sampler_logp.shape == rollout.completion_ids.shape
    module.eval()
    with torch.no_grad():
        at_sampler = module.logprobs(module.policy, rollout)[0] if sampler_temperature is None else (
            _logprobs_at(module, rollout, sampler_temperature))
    mask = rollout.completion_mask.bool()
    torch.testing.assert_close(rollout.sampler_logp[mask], at_sampler[mask], rtol=0, atol=1e-4)
    assert (rollout.sampler_logp[~mask] == 0).all()
    if sampler_temperature is None:  # the fp32 engine is pi_theta: the diagnostics say so
        rollout.mismatch, _ = module.correct_sampler(rollout, module.logprobs(module.policy, rollout)[0].detach())
        k3, ratio = rollout.mismatch["mismatch/kl_k3"], rollout.mismatch["mismatch/ratio_outside_0.9_1.1"]
        assert float(k3[0] / k3[1]) < 1e-8 and float(ratio[0]) == 0


def _logprobs_at(module, rollout, temperature):
    from rloo_lightning.forward import sequence_logprobs

    return sequence_logprobs(module.policy, rollout, slice(None), temperature, False)[0]


def test_diagnostics_and_sequence_weights_in_the_step(tiny_model_dir):
    """A sampler at temperature 2 against pi_theta at 1: material mismatch, logged; the loss is w_i * A_i."""
    engine = HFGenerateEngine(sampler_temperature=2.0)
    module = configured_module(tiny_model_dir, k=4, generation_engine=engine, kl={"beta": 0.0},
                               correction={"level": "sequence", "cap": None})
    rollout = module.sample(prompt_batch(module.tokenizer), 4, seed=3)
    rollout.rewards = torch.rand(len(PROMPTS) * 4, generator=torch.Generator().manual_seed(0))
    loss, _ = module.rollout_loss(rollout)
    logp = module.logprobs(module.policy, rollout)[0].detach()
    mask = rollout.completion_mask
    weights = torch.exp(((logp - rollout.sampler_logp) * mask).sum(1))
    torch.testing.assert_close(rollout.is_weights, weights)
    expected = -(weights * rollout.advantages * (logp * mask).sum(1)).sum() / mask.shape[0]
    torch.testing.assert_close(loss.detach(), expected)
    kl_k3 = rollout.mismatch["mismatch/kl_k3"]
    assert float(kl_k3[0] / kl_k3[1]) > 1e-3  # temperature 2 vs 1 (the random tiny model is near uniform)
    metrics = module.log_train_metrics(rollout, torch.zeros_like(mask), loss.detach())
    assert {"train/mismatch/kl_k1", "train/mismatch/ratio_outside_0.5_2.0", "train/correction/weight_mean"} <= set(
        metrics)


def _expected_weights(correction: dict, logp, sampler_logp, mask):
    """The weights of each option of the 2026 family, written out again from their formulas (docs/correction.md)."""
    log_r = (logp - sampler_logp) * mask
    product, geometric = log_r.sum(1).exp(), (log_r.sum(1) / mask.sum(1)).exp()
    lower, upper = correction.get("lower", 0.5), correction.get("cap", 2.0)
    if correction["level"] == "geometric" and correction.get("mode") == "reject":  # Geo-Mask
        return ((geometric >= lower) & (geometric <= upper)).float()
    if correction["level"] == "geometric":
        return geometric.clamp(max=upper)
    if correction["level"] == "topr":
        return product.clamp(max=1.0)
    token = log_r.exp().clamp(max=upper) * mask  # token TIS, the sequence dropped by its geometric ratio
    lo, hi = correction["reject_lower"], correction["reject_upper"]
    return token * ((geometric >= lo) & (geometric <= hi)).float()[:, None]


@pytest.mark.parametrize("correction", [
    {"level": "geometric", "cap": 1.05},
    {"level": "geometric", "mode": "reject", "lower": 0.95, "cap": 1.02},
    {"level": "token", "reject": "geometric", "reject_lower": 0.95, "reject_upper": 1.02},
    {"level": "topr"},
], ids=["geometric-tis", "geo-mask", "token-tis-geometric-reject", "topr"])
def test_the_2026_family_in_the_step(tiny_model_dir, correction):
    """Each new option's weights and loss on the real step, against its formula; TOPR weights negative advantages
    only. A masked sequence or token stays in the denominator (here 1/B): the weight is 0, the count unchanged."""
    engine = HFGenerateEngine(sampler_temperature=1.3)
    module = configured_module(tiny_model_dir, k=4, generation_engine=engine, kl={"beta": 0.0},
                               correction=correction)
    rollout = module.sample(prompt_batch(module.tokenizer), 4, seed=3)
    rollout.rewards = torch.rand(len(PROMPTS) * 4, generator=torch.Generator().manual_seed(0))
    loss, _ = module.rollout_loss(rollout)
    logp = module.logprobs(module.policy, rollout)[0].detach()
    mask = rollout.completion_mask
    weights = _expected_weights(correction, logp, rollout.sampler_logp, mask)
    torch.testing.assert_close(rollout.is_weights, weights)
    adv = rollout.advantages
    if correction["level"] == "topr":
        weighted = torch.where(adv >= 0, adv, adv * weights)[:, None]
    else:
        weighted = adv[:, None] * (weights[:, None] if weights.dim() == 1 else weights)
    torch.testing.assert_close(loss.detach(), -(weighted * logp * mask).sum() / mask.shape[0])
    if correction.get("mode") == "reject" or "reject" in correction:  # the bounds drop something, keep something
        on = weights if weights.dim() == 1 else weights.amax(1)
        assert 0 < int((on == 0).sum()) < len(on)


def test_reused_rollout_keeps_the_sampler_weights(tiny_model_dir):
    """updates_per_rollout > 1: w = pi_theta_old / pi_s, fixed at the first update; the clipped ratio does the rest."""
    engine = HFGenerateEngine(sampler_temperature=1.5)
    module = configured_module(tiny_model_dir, k=4, generation_engine=engine, kl={"beta": 0.0},
                               correction={"level": "token"}, update={"updates_per_rollout": 2, "clip_mode": "token"})
    rollout = module.sample(prompt_batch(module.tokenizer), 4, seed=3)
    rollout.rewards = torch.rand(len(PROMPTS) * 4, generator=torch.Generator().manual_seed(0))
    module.rollout_loss(rollout)
    first = rollout.is_weights.clone()
    assert rollout.old_logp is not None
    with torch.no_grad():
        for p in module.policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    module.rollout_loss(rollout)  # the second update on the stored rollout
    torch.testing.assert_close(rollout.is_weights, first)


@pytest.mark.parametrize("correction", [{"level": "topr"}, {"level": "geometric", "mode": "reject"},
                                        {"level": "token", "reject": "geometric", "reject_lower": 0.9}])
def test_reused_rollout_with_the_2026_family(tiny_model_dir, correction):
    """updates_per_rollout > 1 with each new option: the weights are fixed at the first update, as for TIS."""
    update = {"updates_per_rollout": 2, "clip_mode": "token" if correction["level"] == "token" else "sequence"}
    module = configured_module(tiny_model_dir, k=4, generation_engine=HFGenerateEngine(sampler_temperature=1.5),
                               kl={"beta": 0.0}, correction=correction, update=update)
    rollout = module.sample(prompt_batch(module.tokenizer), 4, seed=3)
    rollout.rewards = torch.rand(len(PROMPTS) * 4, generator=torch.Generator().manual_seed(0))
    module.rollout_loss(rollout)
    first = rollout.is_weights.clone()
    with torch.no_grad():
        for p in module.policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    loss, _ = module.rollout_loss(rollout)
    torch.testing.assert_close(rollout.is_weights, first)
    assert torch.isfinite(loss)


def test_dynamic_sampling_keeps_each_samples_sampler_logprobs(tiny_model_dir):
    """Groups picked from several rounds carry their own log pi_s, padded like their ids."""
    from rloo_lightning.rollout import concat_groups

    module = configured_module(tiny_model_dir, k=2, generation_engine=HFGenerateEngine(return_logprobs=True))
    batch = prompt_batch(module.tokenizer)
    a, b = module.sample(batch, 2, seed=1), module.sample(batch, 2, seed=2)
    for r in (a, b):
        r.rewards = torch.zeros(r.completion_ids.shape[0])
    joined = concat_groups([(a, [1]), (b, [0, 3])], module.tokenizer.pad_token_id)
    width = joined.completion_ids.shape[1]
    for rows, (source, group) in zip([slice(0, 2), slice(2, 4), slice(4, 6)], [(a, 1), (b, 0), (b, 3)]):
        original = source.sampler_logp[group * 2: group * 2 + 2]
        torch.testing.assert_close(joined.sampler_logp[rows, : original.shape[1]], original)
        assert (joined.sampler_logp[rows, original.shape[1]: width] == 0).all()


def test_an_engine_returning_misshapen_logprobs_is_named(tiny_model_dir):
    class Misshapen(HFGenerateEngine):
        def generate(self, *args):
            ids = super().generate(*args)
            return ids, torch.zeros(ids.shape[0], ids.shape[1] + 1)

    module = configured_module(tiny_model_dir, k=2, generation_engine=Misshapen())
    with pytest.raises(ValueError, match=r"Misshapen.generate returned log-probs of shape"):
        module.sample(prompt_batch(module.tokenizer), 2, seed=1)


def test_a_correction_needs_an_engine_that_reports_logprobs_to_train(tiny_model_dir):
    from rloo_lightning import RLOOModule
    from rloo_lightning.verify.exactness import TableSampler, make_toy, toy_batch, toy_module

    module = RLOOModule(tiny_model_dir, rewards={"funcs": ["rloo_lightning.tasks.reverse.reward"]},
                        correction={"level": "sequence"})
    for stage in ("validate", "test", "predict"):  # nothing is trained: the correction is not used
        module.setup(stage)
    with pytest.raises(ValueError, match="correction.level='sequence' needs an engine that reports its log-probs; "
                                         "DecodeLoopEngine does not"):
        module.setup("fit")
    # an engine that cannot say in advance: the first rollout without log-probs stops the step
    toy = make_toy()
    module = toy_module(toy, {"correction": {"level": "token"}})
    assert isinstance(module.engine, TableSampler)
    with pytest.raises(ValueError, match="TableSampler returned no log-probs"):
        module.training_step(toy_batch(toy, 1), 0)


def test_episode_weights_cover_the_policys_tokens_only():
    """Multi-turn episodes: the geometric mean and the product run over the policy's turns (completion_mask), never
    over the environment's reply (on context_mask only), whose log-ratio would be meaningless."""
    from rloo_lightning.verify.exactness import perturbed_table, toy_batch, toy_module
    from rloo_lightning.verify.exactness_multiturn import make_multiturn_toy

    mt = make_multiturn_toy()
    seen = {}
    for level in ("geometric", "sequence"):
        options = {"rewards": {}, "correction": {"level": level, "cap": None},
                   "environment": {"class_path": "rloo_lightning.verify.exactness_multiturn.ToyEnvironment",
                                   "init_args": {"toy": id(mt)}, "max_turns": 2, "reply_format": "{content}"}}
        module = toy_module(mt.toy, options, sampler_table=perturbed_table(mt.toy))
        correct = module.correct_sampler

        def spy(rollout, logp, correct=correct):
            seen.update(rollout=rollout, logp=logp.detach())
            return correct(rollout, logp)

        module.correct_sampler = spy
        module.training_step(toy_batch(mt.toy, 2), 0)
        rollout, logp = seen["rollout"], seen["logp"]
        policy, context = rollout.completion_mask, rollout.episodes.context_mask
        assert ((context - policy) > 0).any()  # some environment tokens sit between the policy's turns
        log_r = torch.where(policy.bool(), logp - rollout.sampler_logp, torch.zeros_like(logp)).sum(1)
        expected = (log_r / policy.sum(1)).exp() if level == "geometric" else log_r.exp()
        torch.testing.assert_close(rollout.is_weights, expected)
