"""The environment interface: one episode per sample, stepped with the policy's turns.

An episode starts from its prompt row. The policy writes a turn. The environment answers with the next
observation, a message in a role such as ``user`` or ``tool``, or it ends the episode. It may give a reward
at each step, at the end, or both. Reward functions may still score the whole transcript.

RLOO's estimator carries over unchanged. The environment's replies do not depend on θ. For k episodes per
prompt, the leave-one-out advantage of each episode times the sum of ∇log π over the tokens the policy
sampled is therefore unbiased for ∇J. This is why only those tokens enter the loss and the KL.

A class given by ``model.environment.class_path`` is made once per episode, with ``init_args``:

.. code-block:: python

    class Guess(Environment):
        def reset(self, row, seed):
            self.answer, self.rng = row["answer"], random.Random(seed)

        def step(self, turn):
            if turn.text.strip() == self.answer:
                return EnvStep(reward=1.0, done=True)
            return EnvStep(observation=Message("user", "no, try again"))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

__all__ = ["EnvStep", "Environment", "Message", "PolicyTurn"]


@dataclass(frozen=True)
class Message:
    """A chat message: ``role`` (``user``, ``tool``, ...) and its text ``content``."""

    role: str
    content: str


@dataclass(frozen=True)
class PolicyTurn:
    """What the policy wrote in one turn.

    Attributes:
        token_ids: the sampled tokens, exactly as sampled, up to and including the end-of-turn token.
        text: their decoded text, without special tokens.
        index: the turn's number in its episode, from 0.
        ended: True if the turn ended with an end-of-turn token. False if it was cut by
            ``sampling.max_new_tokens``.
    """

    token_ids: tuple[int, ...]
    text: str
    index: int
    ended: bool


@dataclass
class EnvStep:
    """The environment's answer to one policy turn.

    Attributes:
        observation: the next message the policy sees. ``None`` ends the episode, as ``done`` does.
        reward: this step's reward. The episode's environment reward is the sum over its steps.
        done: the episode is over, and the policy writes no more turns.
        info: anything to keep with the step, such as a metric or a note for the transcript.
    """

    observation: Message | None = None
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


class Environment:
    """One episode. Subclass it and override :meth:`reset` and :meth:`step` (and :meth:`final_reward` if the
    episode's score comes at the end).

    An episode is seeded from (seed, rank, step, the prompt's dataset row index, the sample index). Draw every
    random choice from the seed :meth:`reset` receives. A resumed run then replays its episodes exactly.

    Attributes:
        metric_names: the numbers :meth:`metrics` reports per episode, logged as ``train/<name>`` (their mean
            over the step's episodes). Declared on the class, so that every rank logs the same names.
    """

    metric_names: ClassVar[tuple[str, ...]] = ()

    def reset(self, row: dict, seed: int) -> None:
        """Start the episode.

        Args:
            row: the prompt row. It holds ``prompt`` and every other column of the data set, plus
                ``row_index`` (the row's index in its source) and ``sample_index`` (0..k-1).
            seed: this episode's seed.
        """

    def step(self, turn: PolicyTurn) -> EnvStep:
        """Answer the policy's ``turn``."""
        raise NotImplementedError(f"{type(self).__name__}.step")

    def final_reward(self, truncated: bool) -> float:
        """A reward added once the episode is over (default 0).

        ``truncated`` is True when ``max_turns`` or the context budget cut the episode. The environment
        still scores a cut episode.
        """
        return 0.0

    def metrics(self) -> dict[str, float]:
        """This episode's values of :attr:`metric_names` (a name left out counts 0), read once it is over."""
        return {}

    def close(self) -> None:
        """Release what the episode holds. Called once it is over, also after an error."""
