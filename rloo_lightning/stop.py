"""Moved to :mod:`rloo_lightning.runtime.sigterm`; this path will be removed."""
from rloo_lightning._moved import moved

__getattr__ = moved(__name__, "rloo_lightning.runtime.sigterm")
