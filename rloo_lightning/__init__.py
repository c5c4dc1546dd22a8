"""rloo_lightning: RLOO post-training for causal LMs with PyTorch Lightning."""
from rloo_lightning.objectives import (
    completion_mask,
    leave_one_out_advantages,
    masked_mean,
    masked_sum,
    pass_at_k,
    policy_loss,
    sequence_kl,
    token_entropy,
    token_logprobs,
)

__version__ = "0.1.0"
from rloo_lightning.callbacks import RolloutHook, ValidateAtStart
from rloo_lightning.data import PromptDataModule
from rloo_lightning.module import RLOOModule
from rloo_lightning.rewards import RewardSet
from rloo_lightning.rollout import Rollout

__all__ = [
    "RLOOModule",
    "PromptDataModule",
    "Rollout",
    "RolloutHook",
    "ValidateAtStart",
    "RewardSet",
    "leave_one_out_advantages",
    "token_logprobs",
    "token_entropy",
    "completion_mask",
    "masked_sum",
    "masked_mean",
    "sequence_kl",
    "policy_loss",
    "pass_at_k",
]
