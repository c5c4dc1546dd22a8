"""Embedded tasks: prompts generated in code and a verifiable reward, with no download.

A task gives the quickstart and the tests a dataset (``make_rows``), a prompt-dependent
reward in [0, 1], and a tiny offline model (``tiny:<name>`` as a model path) that is built,
briefly warm-started with supervised learning, and cached on first use.
"""

from rloo_lightning.tasks.base import Task
from rloo_lightning.tasks.registry import TASKS, get_task

__all__ = ["Task", "get_task", "TASKS"]
