"""rloo_lightning: RLOO post-training for causal LMs with PyTorch Lightning."""

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
