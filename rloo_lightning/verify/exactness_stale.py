"""Stale rollouts (``rollout.lag`` K >= 1) through the module's own pipeline, against the exact gradient.

:func:`check_stale_training_step` has step 0 submit its rollouts ahead from one table (``theta_0``) and step K train
on one of them with the policy at another (``theta_1``), against ``grad J`` at ``theta_1`` (the toy, the module and
the verdict of :mod:`rloo_lightning.verify.exactness`). Shapes as there: ``n`` draws, ``D`` coordinates.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import Tensor

from rloo_lightning.runtime import framework
from rloo_lightning.runtime.no_trainer import NoTrainer
from rloo_lightning.verify.exactness import (
    LiveTableSampler, Toy, ZTest, exact_gradient, toy_batch, toy_module, z_test,
)

__all__ = ["StaleRunTrainer", "ToyPrompts", "stale_step_draws", "stale_training_step_draws",
           "check_stale_training_step"]


class StaleRunTrainer(NoTrainer):
    """The few things of a trainer that the module's pipeline path reads, for a module driven by hand: the
    optimizer step ``global_step`` (the version the pipeline submits at and the step trains at), ``global_rank``,
    and the data module whose ``train_batch(position)`` the pipeline reads the prompts ahead from. One process,
    ``accumulate_grad_batches`` 1, no callbacks, no logger (the step's metrics land in ``callback_metrics``)."""

    global_rank = local_rank = 0
    log_every_n_steps = 0
    loggers: tuple = ()
    should_stop = False

    def __init__(self, datamodule) -> None:
        self.datamodule, self.global_step = datamodule, 0
        self.callback_metrics: dict = {}
        self.progress_bar_metrics: dict = {}


class ToyPrompts:
    """A data module for :class:`StaleRunTrainer`: the batch at every loader position holds every prompt
    ``repeats`` times (:func:`toy_batch`), with rows of its own (``row_index``), as the train loader would."""

    def __init__(self, toy: Toy, repeats: int) -> None:
        self.toy, self.repeats = toy, repeats

    def train_batch(self, position: int) -> dict:
        batch = toy_batch(self.toy, self.repeats)
        n = len(batch["prompt"])
        batch["row_index"] = torch.arange(position * n, (position + 1) * n)
        return batch


def _load_table(module, table: Tensor) -> None:
    """The policy's weights become ``table`` (what the optimizer steps between two weights would have made), and
    the engine is told, as ``on_train_batch_end`` tells it after an optimizer step."""
    with torch.no_grad():
        module.policy.table.copy_(table.to(module.policy.table.dtype))
    module.engine.on_weights_updated(module.policy)


def stale_step_draws(module, datamodule, theta_0: Tensor, theta_1: Tensor, num_draws: int) -> Tensor:
    """``[n, D]``: ``-grad`` of ``module.training_step``'s loss at optimizer step K (``rollout.lag``) with
    the policy at ``theta_1``, on the rollout that the module's pipeline sampled at step 0 from ``theta_0``.

    Each draw runs the pipeline from fit start: the module's :class:`~rloo_lightning.pipeline.RolloutPipeline` is
    started by its own ``on_fit_start`` under a :class:`StaleRunTrainer` at step 0; the policy holds ``theta_0``;
    step 0's ``training_step`` (its loss is dropped) submits positions ``0 .. K`` through the engine's ``submit``
    and takes position 0; the policy then holds ``theta_1``, the trainer is at step K, and step K's
    ``training_step`` submits positions ``K+1 .. 2K`` from ``theta_1`` and takes position K (``collect``). The
    rollout it trains on must be sampled at step 0 (checked). The engine must sample from the weights it is given
    (:class:`LiveTableSampler`); each draw's samples are fresh (its call counter). The module's trainer is restored
    afterwards, its pipeline emptied.
    """
    lag = module.cfg.rollout.lag
    if lag < 1:
        raise ValueError(f"stale_step_draws needs a module with rollout.lag >= 1, got {lag}")
    trainer, saved = StaleRunTrainer(datamodule), framework.module_trainer(module)
    module.trainer = trainer
    draws = []
    try:
        for _ in range(num_draws):
            trainer.global_step = 0
            _load_table(module, theta_0)
            with warnings.catch_warnings():  # an engine holding the toy is not stored: no checkpoint here
                warnings.filterwarnings("ignore", message="generation engine .* is not stored")
                module.on_fit_start()  # the pipeline started afresh, the engine told of the weights: as at fit start
            module.training_step(datamodule.train_batch(0), 0)  # step 0: submits positions 0 .. K from theta_0
            _load_table(module, theta_1)
            trainer.global_step = lag
            loss = module.training_step(datamodule.train_batch(lag), lag)  # position K: sampled at step 0
            if module.pipeline.weights_step_in_use != 0:
                raise RuntimeError(f"step {lag} trained on a rollout sampled at step "
                                   f"{module.pipeline.weights_step_in_use}, not on the one sampled at step 0")
            module.policy.table.grad = None
            module.on_before_backward(loss)
            loss.backward()
            draws.append(-module.policy.table.grad.reshape(-1).double())
    finally:
        module.trainer = saved
        module.pipeline.reset()  # the rollouts submitted ahead of step K are dropped: nothing trains on them
    return torch.stack(draws)


def stale_training_step_draws(toy: Toy, theta_1: Tensor, num_draws: int, repeats: int = 16,
                              options: dict | None = None, seed: int = 0, lag: int = 1) -> Tensor:
    """``[n, D]`` float64: :func:`stale_step_draws` of a toy module with ``rollout.lag`` ``lag`` (unless
    ``options["rollout"]`` sets it) and a :class:`LiveTableSampler`, from the toy's table (``theta_0``) to
    ``theta_1``."""
    options = {group: dict(values) for group, values in (options or {}).items()}
    options.setdefault("rollout", {}).setdefault("lag", lag)
    module = toy_module(toy, options, seed, engine=LiveTableSampler(toy, seed))
    return stale_step_draws(module, ToyPrompts(toy, repeats), toy.policy_table, theta_1, num_draws)


def check_stale_training_step(toy: Toy, theta_1: Tensor, num_draws: int = 200, repeats: int = 16,
                              options: dict | None = None, seed: int = 0, alpha: float = 1e-3,
                              lag: int = 1) -> ZTest:
    """Z-test :func:`stale_training_step_draws` against ``grad J`` at ``theta_1``, the weights the stale step
    updates (its target), not at ``theta_0``, the weights its samples come from: only a correct importance
    correction of the stale samples (``correction.level: sequence``, uncapped) is unbiased."""
    beta = float(((options or {}).get("kl") or {}).get("beta", 0.1))
    draws = stale_training_step_draws(toy, theta_1, num_draws, repeats, options, seed, lag)
    return z_test(draws, exact_gradient(dataclasses.replace(toy, policy_table=theta_1), beta), alpha)
