"""Moved to :mod:`rloo_lightning.verify.exactness_multiturn`; this path will be removed."""
from rloo_lightning._moved import moved

__getattr__ = moved(__name__, "rloo_lightning.verify.exactness_multiturn")
