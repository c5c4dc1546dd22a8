"""Moved to :mod:`rloo_lightning.engines.vllm`; this path will be removed."""
from rloo_lightning._moved import moved

__getattr__ = moved(__name__, "rloo_lightning.engines.vllm")
