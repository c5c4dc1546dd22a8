"""A run's TensorBoard log read back: its scalars as ``{tag: {step: value}}``, or every scalar event in order.

The one reader of the tests, the benchmarks and the studies (``from rloo_lightning.runtime.tensorboard_logs import
read_scalars``). TensorBoard is imported when a log is read, not with this module.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

__all__ = ["ScalarEvent", "read_events", "read_scalars", "read_tags"]


class ScalarEvent(NamedTuple):
    """One logged value: when it was written (seconds since the epoch), its step and its value."""

    wall_time: float
    step: int
    value: float


def _accumulator(log_dir: str | os.PathLike) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: every event, not a reservoir sample
    acc.Reload()
    return acc


def read_events(log_dir: str | os.PathLike) -> dict[str, list[ScalarEvent]]:
    """Every scalar event of each tag in ``log_dir`` (one run's folder, e.g. ``lightning_logs/version_0``), in the
    order written: a step logged twice is there twice."""
    acc = _accumulator(log_dir)
    return {tag: [ScalarEvent(e.wall_time, e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def read_scalars(log_dir: str | os.PathLike) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of the scalars in ``log_dir``; where a step was logged twice, its last value."""
    return {tag: {e.step: e.value for e in events} for tag, events in read_events(log_dir).items()}


def read_tags(log_dir: str | os.PathLike) -> dict[str, list[str]]:
    """The tags in ``log_dir`` by kind (``"scalars"``, ``"histograms"``, ``"tensors"``, ...), as TensorBoard lists
    them."""
    return dict(_accumulator(log_dir).Tags())
