"""``rloo_lightning.runtime.tensorboard_logs``: a log Lightning's ``TensorBoardLogger`` wrote, read back."""

from __future__ import annotations

import torch
from lightning.pytorch.loggers import TensorBoardLogger

from rloo_lightning.runtime.tensorboard_logs import ScalarEvent, read_events, read_scalars, read_tags


def _log(tmp_path) -> str:
    logger = TensorBoardLogger(tmp_path, name="run")
    for step in range(3):
        logger.log_metrics({"train/a": 0.5 * step, "train/b": 1.0 + step}, step=step)
    logger.log_metrics({"train/a": 9.0}, step=2)  # step 2 again
    logger.experiment.add_histogram("hist/a", torch.arange(4.0), 0)
    logger.experiment.flush()
    return logger.log_dir


def test_scalars_by_tag_and_step_and_the_last_value_of_a_step_wins(tmp_path):
    assert read_scalars(_log(tmp_path)) == {"train/a": {0: 0.0, 1: 0.5, 2: 9.0}, "train/b": {0: 1.0, 1: 2.0, 2: 3.0}}


def test_events_keep_every_value_in_the_order_written_with_its_time(tmp_path):
    events = read_events(_log(tmp_path))
    assert [(e.step, e.value) for e in events["train/a"]] == [(0, 0.0), (1, 0.5), (2, 1.0), (2, 9.0)]
    assert all(isinstance(e, ScalarEvent) and e.wall_time > 0 for e in events["train/b"])
    assert [e.wall_time for e in events["train/a"]] == sorted(e.wall_time for e in events["train/a"])


def test_tags_by_kind(tmp_path):
    tags = read_tags(_log(tmp_path))
    assert sorted(tags["scalars"]) == ["train/a", "train/b"] and tags["histograms"] == ["hist/a"]
