"""DAPO's dynamic sampling (Yu et al. 2025): more prompt groups until the batch is informative."""

from __future__ import annotations

from collections.abc import Callable

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from rloo_lightning.algo.advantages import informative_groups
from rloo_lightning.config import DynamicSamplingArgs
from rloo_lightning.metrics import log_step_metrics
from rloo_lightning.rollout import Rollout, concat_groups, derive_seed
from rloo_lightning.runtime import framework

__all__ = ["fill_informative", "informative_rollout"]


def fill_informative(
    rollout: Rollout,
    num_groups: int,
    args: DynamicSamplingArgs,
    draw: Callable[[int], Rollout],
    reduce: Callable[[Tensor, str], Tensor],
    pad_token_id: int,
    step: int,
) -> tuple[Rollout, dict[str, float]]:
    """A scored rollout of ``num_groups`` groups whose rewards differ, drawing more rounds as needed.

    All ranks take part in every round while any rank is short (one all-reduce per round), so a
    sharded ``generate`` never waits on a rank that stopped early. When ``args.max_rounds`` extra
    rounds are used up, the batch is topped up with the first round's uninformative groups.

    Args:
        rollout: the step's scored rollout (``num_groups`` groups).
        draw: ``round -> scored rollout`` of ``num_groups`` fresh prompts (round 1, 2, ...).
        reduce: ``(tensor, op) -> tensor`` over data-parallel ranks (``op`` ``sum`` or ``max``).

    Returns:
        ``(rollout, {"train/dynamic_sampling_rounds": ..., "train/informative_groups": ...})``.
    """
    k = rollout.k
    parts, found, first_informative, rounds = [], 0, None, 0
    candidate = rollout
    while True:
        informative = informative_groups(candidate.rewards, k, args.atol)
        if first_informative is None:
            first_informative = informative
        take = informative.nonzero().flatten().tolist()[: num_groups - found]
        parts.append((candidate, take))
        found += len(take)
        short = reduce(torch.tensor(float(found < num_groups), device=rollout.rewards.device), "max")
        if short == 0 or rounds == args.max_rounds:
            break
        rounds += 1
        candidate = draw(rounds)
    counts = reduce(torch.tensor([float(first_informative.sum()), float(found), float(num_groups)],
                                 device=rollout.rewards.device), "sum")
    if counts[1] < counts[2]:
        rank_zero_warn(f"dynamic_sampling: step {step}: {int(counts[1])} of {int(counts[2])} groups (all ranks) "
                       f"informative after dynamic_sampling.max_rounds={args.max_rounds} extra rounds; the batch "
                       "is topped up with uninformative groups (advantage 0)")
    if found < num_groups:
        filler = (~first_informative).nonzero().flatten()
        parts.append((rollout, filler.tolist()[: num_groups - found]))
    stats = {"train/dynamic_sampling_rounds": float(rounds), "train/informative_groups": float(counts[0] / counts[2])}
    return concat_groups(parts, pad_token_id), stats


def informative_rollout(module, rollout: Rollout, num_groups: int) -> Rollout:
    """The training step's dynamic sampling: ``rollout`` filled by :func:`fill_informative` with extra rounds of
    prompts from the data module's ``sample_batch``, each sampled and scored by ``module`` (an ``RLOOModule``),
    seeded by (seed, rank, step, round); the rounds' statistics logged."""
    datamodule, cfg, step = module.run_by.datamodule, module.cfg, module.global_step
    if not hasattr(datamodule, "sample_batch"):
        raise ValueError("dynamic_sampling needs a data module with sample_batch(num_prompts, seed), "
                         "such as PromptDataModule")

    def draw(round_: int) -> Rollout:
        seed = derive_seed(cfg.sampling.seed, module.global_rank, "dynamic", step, round_)
        extra = module.batch_on_device(datamodule.sample_batch(num_groups, seed))
        candidate = module.sample(extra, cfg.sampling.k, module.sampling_seed(f"dynamic{round_}", step), in_step=True)
        # a reward failing on one rank ends every rank here, not that rank alone
        with module.ranks_agree("after scoring", signals=False):
            candidate.scores, candidate.rewards = module.score(candidate)
        return candidate

    rollout, stats = fill_informative(rollout, num_groups, cfg.dynamic_sampling, draw, module.reduce_across_ranks,
                                      module.tokenizer.pad_token_id, step)
    log_step_metrics(framework.module_trainer(module), stats, step)
    return rollout
