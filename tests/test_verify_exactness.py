"""RLOOModule's training step, run on an enumerable toy, is an unbiased estimator of grad J; bugs are caught.

``rloo_lightning.verify.exactness`` gives the exact gradient of ``J = E[r] - beta * KL(pi || pi_ref)`` by
enumeration, and draws estimates from ``RLOOModule.training_step`` itself (its masks, reward
scoring, log-probs, KL, baseline and loss). A Bonferroni-corrected z-test (family-wise false-alarm
rate 1e-3) compares them; seeds are fixed. ``test_planted_bug_is_caught`` edits the training path
one realistic bug at a time and checks that the exactness test, or a named fast test, fails.
"""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

import rloo_lightning.environments.sampler as sampler_py
import rloo_lightning.module as module_py
import rloo_lightning.rewards.reward_set as reward_set_py
import rloo_lightning.rollout as rollout_py
import rloo_lightning.update as update_py
import rloo_lightning.verify.exactness_multiturn as exactness_multiturn_py
from rloo_lightning import forward as forward_py
from rloo_lightning.algo import advantages as advantages_py
from rloo_lightning.algo import kl as kl_py
from rloo_lightning.algo import losses as losses_py
from rloo_lightning.verify.exactness import (
    TableSampler,
    check_training_step,
    completion_code,
    completion_probabilities,
    enumerate_completions,
    make_toy,
    toy_batch,
    toy_module,
)
from rloo_lightning.verify.exactness_multiturn import (
    check_multiturn_step,
    exact_multiturn_objective,
    make_multiturn_toy,
)

pytestmark = pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")

DRAWS = 300  # x 3 prompts x 16 repeats x k = 4: 57,600 sampled completions per check, about 2 s


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """The tensors are tiny (conftest's ``one_thread``)."""


@pytest.fixture(scope="module")
def toy():
    return make_toy()


# -- the exact side and the sampler ------------------------------------------------------------------
def test_enumeration_is_the_whole_distribution(toy):
    completions = enumerate_completions(toy)
    assert len(completions) == 1 + 2 + 4 + 8  # EOS, xEOS, xyEOS, xyz (truncated)
    assert len({completion_code(y, toy.emit) for y in completions}) == 15
    torch.testing.assert_close(completion_probabilities(toy).sum(1), torch.ones(3, dtype=torch.float64))


def test_sampler_draws_from_the_enumerated_distribution(toy):
    """Otherwise the exact comparison would test the wrong distribution."""
    n = 20_000
    batch = toy_batch(toy, n)
    config = type("C", (), {"temperature": toy.temperature, "max_new_tokens": toy.max_len})()
    ids = TableSampler(toy, seed=3).generate(None, toy.tokenizer, batch["input_ids"], batch["attention_mask"],
                                              config, 0)
    enumerated = enumerate_completions(toy)
    index = {completion_code(y, toy.emit): c for c, y in enumerate(enumerated)}
    codes = [index[completion_code([t for t in row if t in toy.emit][: _length(row, toy)], toy.emit)]
             for row in ids.tolist()]
    freq = torch.zeros(3, len(enumerated), dtype=torch.float64)
    for row, c in enumerate(codes):
        freq[row // n, c] += 1.0 / n
    p = completion_probabilities(toy)
    z = (freq - p) / (p * (1 - p) / n).sqrt()
    assert z.abs().max() < 4.5  # Bonferroni over 45 cells at ~1e-3 family-wise


def _length(row: list[int], toy) -> int:
    return row.index(toy.eos_id) + 1 if toy.eos_id in row else toy.max_len


def test_toy_logits_depend_on_position_ids_and_the_previous_token(toy):
    """What makes dropped position ids and shifted logits visible: left padding changes the default positions."""
    module = toy_module(toy)
    batch = toy_batch(toy, 1)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with_ids = module.policy(ids, mask, position_ids=positions).logits
    without = module.policy(ids, mask).logits
    assert torch.equal(with_ids[2], without[2])  # the longest prompt has no padding
    assert not torch.equal(with_ids[0, -1], without[0, -1])  # the padded one is shifted
    shifted = torch.cat([ids[:, :1], ids[:, :-1]], 1)
    assert not torch.equal(module.policy(shifted, mask, position_ids=positions).logits[:, -1], with_ids[:, -1])


# -- the training step is unbiased, and biased options are measured as biased -------------------------
@pytest.mark.parametrize("options", [
    {},  # the paper's default: k = 4, beta = 0.1, k1 in the reward, leave-one-out, sequence sum
    {"sampling": {"k": 2}, "kl": {"beta": 0.0}},
    {"update": {"micro_batch_size": 40}},  # micro-batched: the same estimator
    {"advantage": {"baseline": "none"}},  # vanilla REINFORCE: unbiased, higher variance
    {"kl": {"beta": 0.1, "placement": "token_reward"}},  # OpenRLHF's placement with k1: unbiased
], ids=["default", "k2-beta0", "micro-batched", "no-baseline", "token-reward-kl"])
def test_training_step_is_unbiased(toy, options):
    result = check_training_step(toy, DRAWS, options=options)
    assert result.unbiased, result


@pytest.mark.parametrize("options", [
    {"advantage": {"baseline": "group_mean_std"}},  # GRPO's std division
    {"kl": {"beta": 0.3, "estimator": "k3"}},  # k3 in the reward
    {"update": {"loss_aggregation": "token_mean"}},  # length-weighted
], ids=["grpo-std", "k3-in-reward", "token-mean"])
def test_biased_options_are_measured_as_biased(toy, options):
    assert not check_training_step(toy, DRAWS, options=options).unbiased


# -- named fast checks of what the exactness test cannot see ----------------------------------------
def check_advantages_are_leave_one_out_within_each_prompt(toy) -> None:
    """A wrong grouping keeps the estimator unbiased (the baseline is still independent of y_i), so the
    exactness test cannot see it: the advantages of a fixed rollout are checked by hand."""
    module = toy_module(toy, {"kl": {"beta": 0.0}, "sampling": {"k": 4}})
    rollout = module.sample(toy_batch(toy, 1), 4, seed=0)
    rollout.rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 4.0, 4.0, 5.0, 1.0, 1.0, 1.0])
    module.rollout_loss(rollout)
    expected = torch.tensor([1 - 11 / 3, 2 - 10 / 3, 3 - 3, 6 - 2, 0 - 8 / 3, 0 - 8 / 3, 4 - 4 / 3, 4 - 4 / 3,
                             5 - 1, 1 - 7 / 3, 1 - 7 / 3, 1 - 7 / 3])
    torch.testing.assert_close(rollout.advantages, expected)


def check_missing_reward_is_left_out_of_the_baseline(toy) -> None:
    """A reward function's None is a missing reward: out of its group's baseline, advantage 0 (not a 0 reward)."""
    module = toy_module(toy, {"kl": {"beta": 0.0}})
    values = iter([1.0, None, 3.0, 5.0] * 3)
    module.rewards.funcs[0] = lambda prompts, completions, completion_ids, **c: [next(values) for _ in prompts]
    rollout = module.sample(toy_batch(toy, 1), 4, seed=0)
    rollout.scores, rollout.rewards = module.score(rollout)
    module.rollout_loss(rollout)
    torch.testing.assert_close(rollout.advantages, torch.tensor([1 - 4.0, 0.0, 3 - 3.0, 5 - 2.0] * 3))


def test_advantages_are_leave_one_out_within_each_prompt(toy):
    check_advantages_are_leave_one_out_within_each_prompt(toy)


def test_missing_reward_is_left_out_of_the_baseline(toy):
    check_missing_reward_is_left_out_of_the_baseline(toy)


# -- planted bugs ---------------------------------------------------------------------------------------
def _mutated(func, *edits: tuple[str, str]):
    """``func`` recompiled from its source with each ``old -> new`` edit applied (each must occur)."""
    source = textwrap.dedent(inspect.getsource(func))
    for old, new in edits:
        assert old in source, f"{func.__qualname__} no longer contains {old!r}: update the planted bug"
        source = source.replace(old, new)
    namespace: dict = {}
    exec(compile(source, f"<planted bug in {func.__qualname__}>", "exec"), func.__globals__, namespace)
    return namespace[func.__name__]


def _self_inclusive_baseline(rewards, k):
    groups = rewards.view(-1, k)
    return (groups - groups.nanmean(1, keepdim=True)).reshape(-1)


def _regrouped(leave_one_out):
    """Groups of k taken across prompts (rows i, i+N, ...) instead of the k samples of one prompt."""
    def wrong(rewards, k):
        n = rewards.numel() // k
        return leave_one_out(rewards.view(k, n).t().reshape(-1), k).view(n, k).t().reshape(-1)
    return wrong


# name -> [(owner, attribute, make(original) -> replacement)]; each edit is where the training path runs it.
BUGS = {
    "baseline includes the sample": [(advantages_py, "leave_one_out_advantages", lambda f: _self_inclusive_baseline)],
    "wrong grouping": [(advantages_py, "leave_one_out_advantages", _regrouped)],
    "mask drops EOS": [(rollout_py, "completion_mask", lambda f: _mutated(
        f, ("return (eos_before == 0).float()", "return ((eos_before == 0) & ~is_eos).float()")))],
    "mask keeps a pad": [(rollout_py, "completion_mask", lambda f: _mutated(
        f, ("return (eos_before == 0).float()", "return (torch.nn.functional.pad(eos_before, (1, 0))[:, :-1] == 0)"
                                                ".float()")))],
    "KL not detached": [
        (update_py.PolicyUpdate, "detached_logprobs", lambda f: _mutated(
            f, ("return self._kept[0].detach()", "return self._kept[0]"))),
        (losses_py.PolicyLoss, "__call__", lambda f: _mutated(f, ("-advantages.detach()", "-advantages")))],
    "KL sign flipped": [(kl_py, "fold_kl", lambda f: _mutated(f, ("rewards - beta * kl", "rewards + beta * kl")))],
    "log-probs at temperature 1": [(module_py.RLOOModule, "logprobs", lambda f: _mutated(
        f, ("self.cfg.sampling.temperature", "1.0")))],
    "logits shifted by one": [(forward_py, "completion_logits", lambda f: _mutated(
        f, ("return out.logits[:, :-1]", "return out.logits[:, 1:]")))],
    "position ids dropped": [(forward_py, "completion_logits", lambda f: _mutated(
        f, ("position_ids=mask_positions(attn)", "position_ids=None")))],
    "token mean instead of sequence sum": [(losses_py.PolicyLoss, "__call__", lambda f: _mutated(
        f, ("loss = aggregate_token_loss(per_token, mask, self.aggregation,",
            "loss = aggregate_token_loss(per_token, mask, 'token_mean',")))],
    "advantage of the unshaped reward": [(module_py.RLOOModule, "rollout_loss", lambda f: _mutated(
        f, ("self.advantage_estimator(rollout.baseline_rewards,", "self.advantage_estimator(rollout.rewards,")))],
    "missing reward counted as 0": [(reward_set_py, "to_floats", lambda f: _mutated(
        f, ("out.append(math.nan)", "out.append(0.0)")))],
}
NAMED_CHECKS = [check_advantages_are_leave_one_out_within_each_prompt, check_missing_reward_is_left_out_of_the_baseline]


def _caught(toy) -> list[str]:
    """Which checks fail: the exactness test of the default step, then the named fast checks."""
    failed = []
    try:
        if not check_training_step(toy, DRAWS).unbiased:
            failed.append("exactness")
    except Exception as err:  # a bug that crashes the step is caught too
        failed.append(f"exactness raised {type(err).__name__}")
    for check in NAMED_CHECKS:
        try:
            check(toy)
        except Exception:
            failed.append(check.__name__)
    return failed


def test_the_checks_pass_without_a_planted_bug(toy):
    assert _caught(toy) == []


@pytest.mark.parametrize("bug", list(BUGS))
def test_planted_bug_is_caught(toy, bug, monkeypatch):
    for owner, attribute, make in BUGS[bug]:
        monkeypatch.setattr(owner, attribute, make(getattr(owner, attribute)))
    assert _caught(toy), f"planted bug {bug!r} passed every check"


# -- a sampler that is not pi_theta: the importance correction -----------------------------------------------
@pytest.mark.parametrize("correction, unbiased", [
    ({}, False),  # samples from pi_s, no correction: biased
    ({"level": "sequence", "cap": None}, True),  # plain sequence importance weights: unbiased
    ({"level": "sequence", "cap": 1.0}, False),  # truncated (TIS) at 1: biased, as documented
    ({"level": "token", "cap": None}, False),  # per-token weights: biased (the mismatch is not per-token only)
    ({"level": "sequence", "mode": "mask", "cap": 1.5}, False),  # masked outside [1/1.5, 1.5]: biased
], ids=["uncorrected", "sequence-is", "sequence-tis-1", "token-is", "sequence-mask"])
def test_importance_correction_against_a_perturbed_sampler(toy, correction, unbiased):
    from rloo_lightning.verify.exactness import perturbed_table

    result = check_training_step(toy, DRAWS, options={"correction": correction}, sampler_table=perturbed_table(toy))
    assert result.unbiased == unbiased, result


# -- multi-turn: a stochastic environment between two policy turns ----------------------------------------
@pytest.fixture(scope="module")
def multiturn_toy():
    return make_multiturn_toy()


def test_multiturn_enumeration_is_the_whole_distribution(multiturn_toy):
    """beta = 0 and every reward 1: J is the total probability of the episodes (turn 1 alone, or with a turn 2)."""
    import dataclasses

    mt = multiturn_toy
    ones = dataclasses.replace(mt, first_reward=torch.zeros_like(mt.first_reward),
                               final_reward=torch.ones_like(mt.final_reward))
    ended = sum(float(_context_probability(mt, p, y)) for p in range(3) for y in enumerate_completions(mt.toy)
                if y[-1] == mt.toy.eos_id) / 3
    torch.testing.assert_close(exact_multiturn_objective(ones, 0.0).item(), ended)


def _context_probability(mt, p, y):
    ids = mt.toy.tokenizer(mt.toy.prompts[p], add_special_tokens=False)["input_ids"]
    return torch.exp(exactness_multiturn_py._context_logprob(mt.toy.policy_table, mt.toy, ids, y))


@pytest.mark.slow  # over ~5 s (the fast loop: pytest -m "not slow")
def test_multiturn_training_step_is_unbiased(multiturn_toy):
    """The default (k = 4, beta = 0.1); the single-turn tests cover the other k and beta (the suite's time budget)."""
    result = check_multiturn_step(multiturn_toy, DRAWS)
    assert result.unbiased, result


def _environment_tokens_as_policy_tokens(monkeypatch, loss: bool, kl: bool):
    """Plant: the loss (``loss``) and / or the KL (``kl``) cover the environment's tokens too."""
    sample, last = sampler_py.EpisodeSampler.sample, {}

    def widened(self, *args, **kwargs):
        rollout = sample(self, *args, **kwargs)
        last["context"] = rollout.episodes.context_mask
        if loss:
            rollout.completion_mask = rollout.episodes.context_mask
        return rollout

    monkeypatch.setattr(sampler_py.EpisodeSampler, "sample", widened)
    if kl:
        fold = kl_py.fold_kl  # what KLTerm.fold calls
        monkeypatch.setattr(kl_py, "fold_kl", lambda rewards, logp, ref, mask, *a: fold(
            rewards, logp, ref, last["context"], *a))


@pytest.mark.slow  # over ~5 s (the fast loop: pytest -m "not slow")
@pytest.mark.parametrize("loss,kl", [(True, True), (False, True)], ids=["trains-on-env-tokens", "env-tokens-kl"])
def test_multiturn_steps_that_count_environment_tokens_are_measured_as_biased(multiturn_toy, monkeypatch, loss, kl):
    _environment_tokens_as_policy_tokens(monkeypatch, loss, kl)
    # Training on them is caught at |z| = 75 with 100 draws; the KL alone at |z| = 5.1 (threshold 4.2): all 300.
    assert not check_multiturn_step(multiturn_toy, 100 if loss else DRAWS).unbiased
