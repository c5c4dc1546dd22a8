"""Embedded tasks: prompts generated in code and a verifiable reward, with no download.

A task gives the quickstart and the tests a dataset (``make_rows``), a prompt-dependent
reward in [0, 1], and a tiny offline model (``tiny:<name>`` as a model path) that is built,
briefly warm-started with supervised learning, and cached on first use.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rloo_lightning.models import cache_dir

__all__ = ["Task", "get_task", "TASKS"]


@dataclass(frozen=True)
class Task:
    """An embedded task.

    Attributes:
        name: the name used in ``tiny:<name>`` and ``PromptDataModule(task=...)``.
        make_rows: ``(n, seed) -> rows``; each row has ``prompt`` and the columns its reward reads.
        reward: a reward function (see :mod:`rloo_lightning.rewards`).
        build_tiny_model: ``(directory) -> None``; saves a tokenizer and a warm-started model there
            (None for tasks meant for real pretrained models).
        version: bump when the builder changes, so that stale caches are not reused.
    """

    name: str
    make_rows: Callable[[int, int], list[dict]]
    reward: Callable[..., list[float | None]]
    build_tiny_model: Callable[[Path], None] | None
    version: int = 1

    def tiny_model_dir(self) -> Path:
        """Build the tiny model once (atomically: concurrent ranks may race) and return its directory."""
        if self.build_tiny_model is None:
            raise ValueError(f"task {self.name!r} has no tiny model: use a real model with it")
        final = cache_dir() / f"tiny-{self.name}-v{self.version}"
        if (final / "config.json").exists():
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        try:
            self.build_tiny_model(tmp)
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / "config.json").exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final


def get_task(name: str) -> Task:
    """The embedded task called ``name``; ``ValueError`` listing the valid names otherwise."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; embedded tasks: {sorted(TASKS)}")
    return TASKS[name]


from rloo_lightning.tasks import arithmetic, reverse  # noqa: E402  (the task modules need Task defined)

TASKS: dict[str, Task] = {t.name: t for t in (reverse.TASK, arithmetic.TASK)}
