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

__all__ = ["EnvStep", "Environment", "EnvironmentConfigError", "Message", "PolicyTurn"]


class EnvironmentConfigError(ValueError):
    """An environment or a tool is configured wrongly: it cannot be imported, its ``init_args`` do not fit, its
    chat template cannot carry its messages, or ``data.tools`` differs from its tools. Raised before training."""


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
        text: their decoded text, without the tokenizer's control tokens (end-of-turn, BOS, padding, unknown).
            Every other token is kept as text, so a call marker that the tokenizer marks special (``<tool_call>``)
            reaches the environment.
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

    What is checked (anything else fails the episode, as ``environment.on_error`` says): ``observation`` is a
    :class:`Message` whose ``role`` is a plain name (letters, digits, ``_ . -``) and whose ``content`` is a ``str``,
    or None; ``reward`` is a finite number (NaN is an error, never a silent missing reward); ``done`` is a bool.

    The observation's content is data: special tokens in it are encoded as plain text, and it is cut to
    ``environment.max_reply_tokens`` tokens.

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

    Each call runs within ``environment.timeout`` seconds, in a thread, up to ``environment.workers`` episodes'
    calls at a time: keep an episode's state on its object (not in globals or on the class), so that concurrent
    episodes do not share it. A call past the timeout is abandoned (the object is never called again, not even
    :meth:`close`); one that raises or returns something malformed ends its episode as ``environment.on_error``
    says. Once a call has timed out, the rollout's other calls share one more timeout in all (hung calls do not
    add up; ``environment.timeout``): a call may then be failed without starting.

    Attributes:
        metric_names: the numbers :meth:`metrics` reports per episode, logged as ``train/<name>`` (their mean
            over the step's episodes). Declared on the class, so that every rank logs the same names.
    """

    metric_names: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def check_init_args(cls, init_args: dict) -> None:
        """Check ``environment.init_args`` before any model is loaded; raise :class:`EnvironmentConfigError`.

        The default checks that the class's constructor accepts them. Override it to check more (as
        :class:`~rloo_lightning.environments.tools.ToolEnvironment` imports its tools); call ``super()`` first.
        """
        import inspect

        try:
            inspect.signature(cls).bind(**init_args)
        except TypeError as err:
            raise EnvironmentConfigError(f"environment.init_args {init_args!r} do not fit {cls.__name__}: {err}"
                                         ) from None

    @classmethod
    def check_data(cls, init_args: dict, datamodule) -> None:
        """Check the environment against the data module before any model is loaded (default: nothing); raise
        :class:`EnvironmentConfigError`. ``ToolEnvironment`` refuses a ``data.tools`` that lists other tools."""

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
        """A reward added once the episode is over (default 0). It must be a finite number.

        ``truncated`` is True when the episode was cut, by any of the kinds of ``cut_by``: a turn that reached
        ``sampling.max_new_tokens`` without an end-of-turn token, ``environment.max_turns``, or the context budget.
        The environment still scores a cut episode. Not called for an episode that failed.
        """
        return 0.0

    def metrics(self) -> dict[str, float]:
        """This episode's values of :attr:`metric_names` (a name left out counts 0), read once it is over; not
        read for an episode that failed (its metrics are left out of the step's means)."""
        return {}

    def close(self) -> None:
        """Release what the episode holds. Called once it is over, also after an error."""
