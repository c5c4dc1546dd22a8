"""Missing stays missing: a step with no reward logs ``train/reward`` NaN (not 0), ``train/reward_missing`` logs the
missing share every step, and a run with no reward for ``rewards.stop_after_missing_steps`` steps in a row stops
with an error naming the source."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import EarlyStopping
from test_metrics_step_logging import Recorder

from rloo_lightning import RLOOModule
from rloo_lightning.data import PromptDataModule
from rloo_lightning.metrics import MissingRewardWatch, step_means
from rloo_lightning.rewards import RewardError


def test_a_mean_over_nothing_is_nan_not_zero():
    sums = torch.tensor([[3.0, 2.0], [0.0, 0.0], [0.0, 4.0]])
    means = step_means(sums)
    assert means[0] == 1.5 and math.isnan(means[1]) and means[2] == 0.0


def _metrics(missing: float, **scores: float) -> dict[str, float]:
    return {"train/reward_missing": missing, **{f"train/score/{k}": v for k, v in scores.items()}}


def test_the_watch_stops_after_patience_steps_in_a_row_and_names_the_silent_function():
    watch = MissingRewardWatch(patience=3)
    for step in range(2):
        watch.update(_metrics(1.0, judge=math.nan, fmt=0.5), step)
    watch.update(_metrics(0.5, judge=0.2, fmt=0.5), 2)  # one reward came back: the count starts again
    for step in range(3, 5):
        watch.update(_metrics(1.0, judge=math.nan, fmt=0.5), step)
    with pytest.raises(RewardError, match=r"no reward in any of the last 3 training steps \(up to step 5\): no value "
                                          r"from reward function 'judge' .*rewards.stop_after_missing_steps 0"):
        watch.update(_metrics(1.0, judge=math.nan, fmt=0.5), 5)


def test_the_watch_names_the_environment_or_the_mix_and_zero_patience_never_stops():
    with pytest.raises(RewardError, match="the environment gave no reward"):
        MissingRewardWatch(1).update(_metrics(1.0, environment=math.nan), 0)
    with pytest.raises(RewardError, match="every completion missed at least one of 'a', 'b'"):
        MissingRewardWatch(1).update(_metrics(1.0, a=0.5, b=0.5), 0)
    never = MissingRewardWatch(0)
    for step in range(50):
        never.update(_metrics(1.0, a=math.nan), step)


def test_the_stop_names_the_prompts_of_its_last_step_and_no_warnings_that_may_not_exist():
    """The mix case warns nothing (no function was silent for a whole call): the error itself names the prompts."""
    prompts = [p for p in ("abc=", "bca=", "cab=", "x" * 100, "e=") for _ in range(2)]  # k = 2: each twice
    with pytest.raises(RewardError) as err:
        MissingRewardWatch(1).update(_metrics(1.0, a=0.5, b=0.5), 7, prompts)
    message = str(err.value)
    assert "the prompts of step 7: 'abc=', 'bca=', 'cab=' and 2 more. Nothing is learnt" in message, message
    assert "warnings above" not in message


def _fit(model_dir, tmp_path, funcs, max_steps, callbacks=(), **rewards):
    module = RLOOModule(model_dir, rewards={"funcs": funcs, **rewards}, sampling={"k": 2, "max_new_tokens": 4},
                        validation={"at_start": False})
    data = PromptDataModule(tokenizer_name_or_path=model_dir, task="reverse", batch_size=2, num_train_rows=16,
                            num_val_rows=2, max_new_tokens=4)
    recorder = Recorder()
    trainer = Trainer(accelerator="cpu", max_steps=max_steps, limit_val_batches=0, logger=recorder,
                      callbacks=list(callbacks), enable_progress_bar=False, enable_model_summary=False,
                      log_every_n_steps=1, default_root_dir=tmp_path)
    return trainer, module, data, recorder


def test_a_run_without_any_reward_logs_nan_and_stops_with_an_error_naming_the_function(tiny_model_dir, tmp_path):
    trainer, module, data, recorder = _fit(tiny_model_dir, tmp_path, ["reward_helpers.always_none"], 20,
                                           stop_after_missing_steps=3)
    with pytest.warns(UserWarning), pytest.raises(RewardError, match="last 3 training steps.*'always_none'") as err:
        trainer.fit(module, datamodule=data)
    assert sorted(recorder.values["train/reward"]) == [0, 1, 2]
    named = str(err.value).partition("the prompts of step 2: ")[2]  # the error names them, no warning may
    assert named.startswith("'") and named.split("'")[1] in {row["prompt"] for row in data.train_rows}, str(err.value)
    assert all(math.isnan(v) for v in recorder.values["train/reward"].values())
    assert recorder.values["train/reward_missing"] == {0: 1.0, 1: 1.0, 2: 1.0}


def test_with_the_stop_off_it_trains_on_and_early_stopping_on_a_finite_reward_stops_it(tiny_model_dir, tmp_path):
    trainer, module, data, recorder = _fit(tiny_model_dir, tmp_path, ["reward_helpers.always_none"], 4,
                                           stop_after_missing_steps=0)
    with pytest.warns(UserWarning):
        trainer.fit(module, datamodule=data)
    assert trainer.global_step == 4 and all(math.isnan(v) for v in recorder.values["train/reward"].values())
    early = EarlyStopping(monitor="train/reward", check_finite=True, check_on_train_epoch_end=True)
    trainer, module, data, recorder = _fit(tiny_model_dir, tmp_path / "early", ["reward_helpers.always_none"], 20,
                                           callbacks=[early], stop_after_missing_steps=0)
    with pytest.warns(UserWarning):
        trainer.fit(module, datamodule=data)
    assert trainer.global_step < 20 and early.stopped_epoch == 0 and trainer.should_stop


def test_a_present_reward_logs_no_missing_share(tiny_model_dir, tmp_path):
    trainer, module, data, recorder = _fit(tiny_model_dir, tmp_path, ["rloo_lightning.tasks.reverse.reward"], 2)
    trainer.fit(module, datamodule=data)
    assert recorder.values["train/reward_missing"] == {0: 0.0, 1: 0.0}
    assert all(math.isfinite(v) for v in recorder.values["train/reward"].values())
