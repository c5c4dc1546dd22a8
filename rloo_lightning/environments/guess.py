"""The environment of the embedded ``guess`` task (:mod:`rloo_lightning.tasks.guess`)."""

from __future__ import annotations

from rloo_lightning.environments.base import EnvStep, Environment, Message, PolicyTurn
from rloo_lightning.tasks.guess import marks, score

__all__ = ["GuessEnvironment"]


class GuessEnvironment(Environment):
    """Guess the row's ``secret``; after each guess but the last, the guess's right letters (wrong ones as ``-``).

    The reward, given at the end, is the last guess's fraction of right positions (also for an episode that was
    cut: its last guess is scored).

    Args:
        guesses: guesses per episode (the reply after the last one is not given).
        feedback: ``positions`` (the right letters) or ``none``: a reply of one ``?`` per letter, which tells
            nothing (the control that shows the policy uses the reply).
    """

    def __init__(self, guesses: int = 2, feedback: str = "positions") -> None:
        if guesses < 1:
            raise ValueError(f"guesses must be >= 1, got {guesses}")
        if feedback not in ("positions", "none"):
            raise ValueError(f"feedback must be 'positions' or 'none', got {feedback!r}")
        self.guesses, self.feedback = guesses, feedback

    def reset(self, row: dict, seed: int) -> None:
        self.secret, self.last = row["secret"], ""

    def step(self, turn: PolicyTurn) -> EnvStep:
        self.last = turn.text
        if turn.index + 1 >= self.guesses:
            return EnvStep(done=True)
        reply = marks(turn.text, self.secret) if self.feedback == "positions" else "?" * len(self.secret)
        return EnvStep(observation=Message("user", reply))

    def final_reward(self, truncated: bool) -> float:
        return score(self.last, self.secret)
