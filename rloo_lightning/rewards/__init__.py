"""Rewards: the reward-function protocol and a weighted combination of reward functions.

A reward function is any callable

    fn(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **columns)
        -> list[float | None]

called once per rollout with one entry per completion (``B*k``, prompt-major), where
``columns`` are the dataset's extra columns, repeated so that ``columns[c][i]`` belongs to
completion ``i``. ``None`` means "no reward": the completion is left out of its group's
leave-one-out baseline and gets advantage 0.

How a function is called is read from its signature, once per set of column names and
before any function runs:

* ``fn(prompts, completions, completion_ids, **columns)``: every column is passed.
* ``fn(prompts, completions, completion_ids, answer)`` (no ``**kwargs``): only the columns it
  names are passed; a required parameter that is not a column is an error naming it.
* TRL-style ``fn(completions, **kwargs)`` (fewer than three positional parameters): called with
  keywords ``prompts=, completions=, completion_ids=`` and the columns.

A reward function is given (``RLOOModule(rewards={"funcs": [...]})``, ``--model.rewards.funcs``) as

* a callable;
* an import path ``"package.module.function"`` (a class there is instantiated with no
  arguments);
* ``{"class_path": "package.module.Class", "init_args": {...}}``: a class configured from YAML
  (``init_args`` on a function binds them with :func:`functools.partial`); an optional
  ``"name"`` key sets the name it is logged under (``train/score/<name>``).

Import paths execute that module's code. Built-in rule rewards are in
:mod:`rloo_lightning.rewards.builtin`, a reward model in :mod:`rloo_lightning.rewards.model`,
reward shaping (missing-EOS and overlong penalties, clipping) in
:mod:`rloo_lightning.algo.shaping`.
"""

from rloo_lightning.rewards.protocol import (
    RewardError,
    RewardFunction,
    RewardSpec,
    RewardTimeoutError,
    RewardWarning,
    call_plan,
    invoke,
    resolve_reward,
    to_floats,
)
from rloo_lightning.rewards.reward_set import RewardSet

__all__ = [
    "RewardFunction",
    "RewardSpec",
    "RewardError",
    "RewardTimeoutError",
    "RewardWarning",
    "resolve_reward",
    "RewardSet",
    "call_plan",
    "invoke",
    "to_floats",
]
