"""Environments for multi-turn episodes: the interface (:mod:`.base`), the turn markers (:mod:`.turns`), the guarded
environment calls (:mod:`.calls`), the episode loop (:mod:`.episodes`), the sampler behind ``RLOOModule.sample``
(:mod:`.sampler`), tool use (:mod:`.tools`), and the embedded ``guess`` task's environment (:mod:`.guess`)."""

from rloo_lightning.environments.base import EnvironmentConfigError, EnvStep, Environment, Message, PolicyTurn

__all__ = ["EnvStep", "Environment", "EnvironmentConfigError", "Message", "PolicyTurn"]
