"""Reward functions for the reward tests (tests/test_rewards_*.py), importable by reward worker processes.

Workers rebuild functions from their import paths (``"reward_helpers.length_reward"``) in a new
interpreter; they find this module because pytest puts ``tests/helpers/`` on ``sys.path`` (pyproject's
``pythonpath``) before any worker starts, and workers inherit the parent's ``sys.path``. Keep this module light:
no torch import, so that a worker imports it in milliseconds. Also the reward tests' two helpers, :func:`batch` and
:func:`assert_close` (torch imported inside).
"""

from __future__ import annotations

import math
import os
import time


def batch(completions, prompts=None, **columns):
    """Arguments of RewardSet.score for these completions."""
    prompts = prompts or [f"p{i}" for i in range(len(completions))]
    ids = [[3] * len(c) for c in completions]
    return prompts, list(completions), ids, columns


def assert_close(actual, expected):
    import torch

    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.tensor(expected, dtype=torch.float32), equal_nan=True)


def length_reward(prompts, completions, completion_ids, **columns):
    return [float(len(c)) for c in completions]


def answer_match(prompts, completions, completion_ids, answer):
    """Names the one column it reads, no **kwargs: other columns are not passed."""
    return [float(c == a) for c, a in zip(completions, answer)]


def trl_style(completions, **kwargs):
    """TRL's calling convention: keywords only, columns in kwargs."""
    assert "prompts" in kwargs and "completion_ids" in kwargs
    return [float(len(c)) + len(kwargs["answer"][i]) for i, c in enumerate(completions)]


def none_for_empty(prompts, completions, completion_ids, **columns):
    return [None if not c else 1.0 for c in completions]


def wrong_count(prompts, completions, completion_ids, **columns):
    return [1.0] * (len(completions) - 1)


def returns_nan(prompts, completions, completion_ids, **columns):
    return [math.nan if c == "bad" else 0.0 for c in completions]


def returns_text(prompts, completions, completion_ids, **columns):
    return ["high" for _ in completions]


def raises(prompts, completions, completion_ids, **columns):
    if any(c == "boom" for c in completions):
        raise KeyError("boom")
    return [0.5 for _ in completions]


def two_args(prompts, completions):
    return [0.0 for _ in completions]


def needs_solution(prompts, completions, completion_ids, solution):
    return [float(c == s) for c, s in zip(completions, solution)]


def sleepy(prompts, completions, completion_ids, **columns):
    """Sleeps a minute on a completion that says "sleep" (a verifier stuck on one input)."""
    if any("sleep" in c for c in completions):
        time.sleep(60)
    return [float(len(c)) for c in completions]


def crash(prompts, completions, completion_ids, **columns):
    """Kills its own process on "crash" (a segfaulting verifier)."""
    if any(c == "crash" for c in completions):
        os._exit(3)
    return [1.0 for _ in completions]


def pid(prompts, completions, completion_ids, **columns):
    return [float(os.getpid()) for _ in completions]


class Scaled:
    """A class configured by init_args: ``factor * len(completion)``."""

    def __init__(self, factor: float = 1.0) -> None:
        self.factor = factor

    def __call__(self, prompts, completions, completion_ids, **columns):
        return [self.factor * len(c) for c in completions]


class NeedsArgs:
    def __init__(self, x):
        self.x = x

    def __call__(self, prompts, completions, completion_ids, **columns):
        return [self.x for _ in completions]


NOT_CALLABLE = 3


class FailsInWorker:
    """Builds in the training process, fails in a worker (e.g. a dependency only the parent has)."""

    def __init__(self) -> None:
        import multiprocessing

        if multiprocessing.parent_process() is not None:
            raise ImportError("no verifier here")

    def __call__(self, prompts, completions, completion_ids, **columns):
        return [0.0 for _ in completions]


def coarse_length(prompts, completions, completion_ids, **columns):
    """1.0 for a completion of more than 3 characters, else 0.0: many groups come out all equal."""
    return [float(len(c) > 3) for c in completions]


def constant(prompts, completions, completion_ids, **columns):
    """The same reward for everything: no group is ever informative."""
    return [0.5 for _ in completions]


def numeric_text(prompts, completions, completion_ids, **columns):
    return ["0.5" for _ in completions]


def always_none(prompts, completions, completion_ids, **columns):
    return [None for _ in completions]

