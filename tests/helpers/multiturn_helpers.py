"""Environments for the multi-turn tests, importable by path (``tests/helpers/`` is on ``PYTHONPATH`` in CLI runs)."""

from __future__ import annotations

import random

from rloo_lightning.environments import EnvStep, Environment, Message
from rloo_lightning.environments.tools import ToolEnvironment
from rloo_lightning.tasks.reverse import score


class OneShot(Environment):
    """One turn, scored by the reverse task's reward: single-turn RLOO written as an environment."""

    def reset(self, row, seed):
        self.answer, self.last = row["answer"], ""

    def step(self, turn):
        self.last = turn.text
        return EnvStep(done=True)

    def final_reward(self, truncated):
        return score(self.last, self.answer)


class Noisy(Environment):
    """Replies a random letter (from the episode's seed) after each turn, for ``turns`` turns; rewards the turn's
    length. ``turns_by_rank``: rank r plays ``turns_by_rank[r]`` turns (ranks with different turn counts); each
    episode's turn count is appended to ``log`` (one line ``rank turns``) when it closes."""

    def __init__(self, turns: int = 3, turns_by_rank: list | None = None, log: str | None = None,
                 fail_at: int | None = None) -> None:
        self.default_turns, self.turns_by_rank = turns, turns_by_rank
        self.log, self.fail_at, self.taken = log, fail_at, 0

    def reset(self, row, seed):
        import torch.distributed as dist

        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.turns = self.turns_by_rank[self.rank] if self.turns_by_rank else self.default_turns
        self.rng, self.seed, self.row = random.Random(seed), seed, row

    def step(self, turn):
        self.taken += 1
        if turn.index == self.fail_at:
            raise ValueError("the simulator crashed")
        if turn.index + 1 >= self.turns:
            return EnvStep(reward=len(turn.text) / 8, done=True)
        return EnvStep(observation=Message("user", self.rng.choice("abcdefgh")), reward=len(turn.text) / 8)

    def close(self):
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{self.rank} {self.taken}\n")


class NoisyTools(ToolEnvironment):
    """A ``ToolEnvironment`` whose every tool message ends in a letter drawn from the episode's seed: a resume
    that reseeded the environment, or replayed a call differently, would show in the transcript."""

    def reset(self, row, seed):
        super().reset(row, seed)
        self.rng = random.Random(seed)

    def step(self, turn):
        step = super().step(turn)
        if step.observation is not None:
            step.observation = Message("tool", f"{step.observation.content} ~{self.rng.choice('abcdefgh')}")
        return step
