"""Environments for multi-turn episodes: the interface (:mod:`.base`), tool use (:mod:`.tools`), and the embedded
``guess`` task's environment (:mod:`.guess`)."""

from rloo_lightning.environments.base import EnvironmentConfigError, EnvStep, Environment, Message, PolicyTurn

__all__ = ["EnvStep", "Environment", "EnvironmentConfigError", "Message", "PolicyTurn"]
