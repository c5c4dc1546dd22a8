"""Callbacks: the rollout hook, validation at step 0, filtering, KL control, statistics, export."""

from rloo_lightning.callbacks.base import RolloutHook, ValidateAtStart
from rloo_lightning.callbacks.checkpoint import FinalCheckpoint
from rloo_lightning.callbacks.export import HFExport
from rloo_lightning.callbacks.filter import ZeroVarianceFilter
from rloo_lightning.callbacks.kl import KLMonitor
from rloo_lightning.callbacks.predict import PredictionWriter
from rloo_lightning.callbacks.progress import StepProgressBar
from rloo_lightning.callbacks.stats import RewardVarianceLogger, SampleLogger

__all__ = ["RolloutHook", "ValidateAtStart", "FinalCheckpoint", "HFExport", "ZeroVarianceFilter", "KLMonitor",
           "PredictionWriter", "RewardVarianceLogger", "SampleLogger", "StepProgressBar"]
