"""The registry of embedded tasks: :data:`TASKS` by name and :func:`get_task`."""

from __future__ import annotations

from rloo_lightning.tasks import arithmetic, guess, reverse
from rloo_lightning.tasks.base import Task

__all__ = ["TASKS", "get_task"]

TASKS: dict[str, Task] = {t.name: t for t in (reverse.TASK, arithmetic.TASK, guess.TASK)}


def get_task(name: str) -> Task:
    """The embedded task called ``name``; ``ValueError`` listing the valid names otherwise."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; embedded tasks: {sorted(TASKS)}")
    return TASKS[name]
