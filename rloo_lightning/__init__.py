"""rloo_lightning: RLOO post-training for causal LMs with PyTorch Lightning."""

import gc as _gc

# Importing the package imports torch, lightning and transformers: about 360,000 objects, nearly none of them
# garbage, which the cyclic collector would scan over and over as they appear (836 collections, 6 of them full).
# Collecting is paused while they are imported, and resumed as it was: the import of rloo_lightning.cli takes
# 3.09 s instead of 3.52 s here (medians of 5; benchmarks/README.md, "The command's start and exit").
_collecting = _gc.isenabled()
_gc.disable()

try:
    from rloo_lightning.algo.advantages import leave_one_out_advantages
    from rloo_lightning.callbacks import RolloutHook, ValidateAtStart
    from rloo_lightning.config import (
        AdvantageArgs,
        DynamicSamplingArgs,
        KLArgs,
        PolicyArgs,
        PredictArgs,
        RewardArgs,
        SamplingArgs,
        ShapingArgs,
        UpdateArgs,
        ValidationArgs,
    )
    from rloo_lightning.data import PromptDataModule
    from rloo_lightning.algo.logprobs import completion_mask, masked_sum, token_entropy, token_logprobs
    from rloo_lightning.metrics import pass_at_k
    from rloo_lightning.module import RLOOModule
    from rloo_lightning.rewards import RewardSet
    from rloo_lightning.rollout import Rollout
finally:  # also when an import fails: a caller that goes on keeps its collector
    if _collecting:
        _gc.enable()

__version__ = "0.1.0"

__all__ = [
    "RLOOModule",
    "PromptDataModule",
    "Rollout",
    "RolloutHook",
    "ValidateAtStart",
    "RewardSet",
    "RewardArgs",
    "SamplingArgs",
    "ShapingArgs",
    "KLArgs",
    "AdvantageArgs",
    "UpdateArgs",
    "DynamicSamplingArgs",
    "ValidationArgs",
    "PolicyArgs",
    "PredictArgs",
    "leave_one_out_advantages",
    "token_logprobs",
    "token_entropy",
    "completion_mask",
    "masked_sum",
    "pass_at_k",
]
