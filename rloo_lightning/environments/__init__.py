"""Environments for multi-turn episodes: the interface (:mod:`.base`)."""

from rloo_lightning.environments.base import EnvStep, Environment, Message, PolicyTurn

__all__ = ["EnvStep", "Environment", "Message", "PolicyTurn"]
