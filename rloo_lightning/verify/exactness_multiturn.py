"""The exactness check of :mod:`rloo_lightning.verify.exactness` for multi-turn episodes: two policy turns with a
stochastic environment between them.

:class:`MultiTurnToy` plays the single-turn toy as an episode (turn 1, a random one-token reply drawn from the
episode's seed, turn 2). :func:`exact_multiturn_objective` enumerates every ``(y1, reply, y2)`` for the exact
``J = E[episode reward] - beta * KL`` over the policy's tokens only; :func:`multiturn_step_draws` drives
``RLOOModule.training_step`` with the module's own multi-turn rollout (:class:`ToyEnvironment`), and
:func:`check_multiturn_step` z-tests the draws against the exact gradient, as the single-turn check does.
Shapes as in :mod:`rloo_lightning.verify.exactness`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor

from rloo_lightning.environments.base import EnvStep, Environment, Message, PolicyTurn
from rloo_lightning.verify.exactness import (
    Toy,
    ZTest,
    completion_code,
    enumerate_completions,
    make_toy,
    step_draws,
    toy_batch,
    toy_module,
    z_test,
)

__all__ = [
    "MultiTurnToy",
    "ToyEnvironment",
    "make_multiturn_toy",
    "exact_multiturn_objective",
    "exact_multiturn_gradient",
    "multiturn_step_draws",
    "check_multiturn_step",
]


@dataclass(frozen=True)
class MultiTurnToy:
    """The toy played as an episode: policy turn 1, a random reply from the environment, policy turn 2.

    Turn 1 is a completion ``y1`` of the toy (up to ``L`` tokens). If it ended with EOS, the environment pays
    ``first_reward[p, y1]`` and replies with one token, ``a`` with probability ``reply_prob[p, y1]`` else ``b``
    (drawn from the episode's seed: the reply does not depend on theta), and the policy writes ``y2`` after it;
    the episode then pays ``final_reward[p, y1, o, y2]``. A turn 1 cut at ``L`` tokens ends the episode with
    ``first_reward`` alone. The reply token is one the policy itself can emit, so a step that trains on it or
    counts its KL computes other numbers.

    Attributes:
        toy: the single-turn toy (prompts, policy and reference tables, temperature, ``L``).
        first_reward: ``[P, (W + 1) ** L]`` float64, by :func:`completion_code` of ``y1``.
        reply_prob: ``[P, (W + 1) ** L]`` float64, the probability of the reply ``a``.
        final_reward: ``[P, (W + 1) ** L, 2, (W + 1) ** L]`` float64.
    """

    toy: Toy
    first_reward: Tensor
    reply_prob: Tensor
    final_reward: Tensor

    @property
    def replies(self) -> tuple[int, int]:
        return self.toy.emit[0], self.toy.emit[1]  # the tokens a and b


_MULTITURN_TOYS: dict[int, MultiTurnToy] = {}  # ToyEnvironment's init_args name a toy by key


def make_multiturn_toy(prompts: tuple[str, ...] = ("x", "yz", "zxy"), max_len: int = 2, temperature: float = 0.7,
                       seed: int = 0) -> MultiTurnToy:
    """A random two-turn toy: the table covers prompt, two turns and the reply; rewards are U(0, 1); reply
    probabilities U(0.2, 0.8)."""
    base = make_toy(prompts, max_len, temperature, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    positions = max(len(p) for p in prompts) + 2 * max_len + 1
    shape = (positions, len(base.tokenizer), len(base.emit))
    policy = 0.5 * torch.randn(shape, generator=g, dtype=torch.float64)
    ref = policy + 0.35 * torch.randn(shape, generator=g, dtype=torch.float64)
    base = Toy(base.tokenizer, base.prompts, policy, ref, base.rewards, base.emit, max_len, temperature)
    codes = (len(base.emit) + 1) ** max_len
    P = len(prompts)
    toy = MultiTurnToy(base, torch.rand((P, codes), generator=g, dtype=torch.float64),
                       0.2 + 0.6 * torch.rand((P, codes), generator=g, dtype=torch.float64),
                       torch.rand((P, codes, 2, codes), generator=g, dtype=torch.float64))
    _MULTITURN_TOYS[id(toy)] = toy
    return toy


class ToyEnvironment(Environment):
    """The :class:`MultiTurnToy`'s environment; ``toy`` is the key :func:`make_multiturn_toy` registered it under."""

    def __init__(self, toy: int) -> None:
        self.mt = _MULTITURN_TOYS[toy]

    def reset(self, row: dict, seed: int) -> None:
        self.p, self.rng, self.y1, self.reply = self.mt.toy.prompts.index(row["prompt"]), random.Random(seed), None, 0

    def step(self, turn: PolicyTurn) -> EnvStep:
        toy, code = self.mt.toy, completion_code(list(turn.token_ids), self.mt.toy.emit)
        if turn.index == 0:
            self.y1 = code
            reward = float(self.mt.first_reward[self.p, code])
            if not turn.ended:
                return EnvStep(reward=reward, done=True)
            self.reply = 0 if self.rng.random() < float(self.mt.reply_prob[self.p, code]) else 1
            token = toy.tokenizer.convert_ids_to_tokens(self.mt.replies[self.reply])
            return EnvStep(observation=Message("user", token), reward=reward)
        return EnvStep(reward=float(self.mt.final_reward[self.p, self.y1, self.reply, code]), done=True)


def _context_logprob(table: Tensor, toy: Toy, context: list[int], completion: list[int]) -> Tensor:
    """``log pi(completion | context)`` by the toy's indexing (positions from 0 at the context's first token)."""
    prev, total = context[-1], torch.zeros((), dtype=table.dtype)
    for j, token in enumerate(completion):
        logits = table[len(context) - 1 + j, prev] / toy.temperature
        total = total + torch.log_softmax(logits, -1)[toy.emit.index(token)]
        prev = token
    return total


def exact_multiturn_objective(mt: MultiTurnToy, beta: float, policy_table: Tensor | None = None) -> Tensor:
    """``J = mean_p E[episode reward - beta * (KL of turn 1 + KL of turn 2)]`` by enumeration over ``y1``, the
    reply and ``y2`` (float64): the KL covers the policy's tokens only."""
    toy = mt.toy
    theta = toy.policy_table if policy_table is None else policy_table
    completions = enumerate_completions(toy)
    per_prompt = []
    for p, prompt in enumerate(toy.prompts):
        ids = toy.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        terms = []
        for y1 in completions:
            c1 = completion_code(y1, toy.emit)
            lp1 = _context_logprob(theta, toy, ids, y1)
            kl1 = lp1 - _context_logprob(toy.ref_table, toy, ids, y1)
            value = mt.first_reward[p, c1] - beta * kl1
            if y1[-1] == toy.eos_id:
                for o, token in enumerate(mt.replies):
                    q = mt.reply_prob[p, c1] if o == 0 else 1 - mt.reply_prob[p, c1]
                    context = ids + y1 + [token]
                    for y2 in completions:
                        lp2 = _context_logprob(theta, toy, context, y2)
                        kl2 = lp2 - _context_logprob(toy.ref_table, toy, context, y2)
                        value = value + q * lp2.exp() * (mt.final_reward[p, c1, o, completion_code(y2, toy.emit)]
                                                         - beta * kl2)
            terms.append(lp1.exp() * value)
        per_prompt.append(torch.stack(terms).sum())
    return torch.stack(per_prompt).mean()


def exact_multiturn_gradient(mt: MultiTurnToy, beta: float) -> Tensor:
    """``[D]`` float64: the exact gradient of :func:`exact_multiturn_objective` w.r.t. the policy table."""
    theta = mt.toy.policy_table.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(exact_multiturn_objective(mt, beta, theta), theta)
    return grad.reshape(-1)


def multiturn_step_draws(mt: MultiTurnToy, num_draws: int, repeats: int = 16, options: dict | None = None,
                         seed: int = 0) -> Tensor:
    """``[n, D]`` float64: ``-grad`` of ``RLOOModule.training_step``'s loss on ``n`` batches of episodes, played
    by the module's own multi-turn rollout with :class:`ToyEnvironment`. Each batch gets rows of its own
    (``row_index``), so its episodes are seeded afresh."""
    options = {group: dict(values) for group, values in (options or {}).items()}
    options.setdefault("rewards", {})
    options.setdefault("environment", {}).update(class_path="rloo_lightning.verify.exactness_multiturn.ToyEnvironment",
                                                 init_args={"toy": id(mt)}, max_turns=2, reply_format="{content}")
    return step_draws(toy_module(mt.toy, options, seed), toy_batch(mt.toy, repeats), num_draws, fresh_rows=True)


def check_multiturn_step(mt: MultiTurnToy, num_draws: int = 200, repeats: int = 16, options: dict | None = None,
                         seed: int = 0, alpha: float = 1e-3) -> ZTest:
    """The multi-turn training step's draws z-tested against the exact gradient of the episodes' objective."""
    beta = float(((options or {}).get("kl") or {}).get("beta", 0.1))
    return z_test(multiturn_step_draws(mt, num_draws, repeats, options, seed), exact_multiturn_gradient(mt, beta),
                  alpha)
