"""The training step's metrics reach the trainer without ``LightningModule.log`` (``metrics.log_step_metrics``):
the loggers get them at the steps Lightning writes ``self.log`` values, ``callback_metrics`` holds them for a
``monitor``, and the progress bar gets its keys."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger

from rloo_lightning import RLOOModule
from rloo_lightning.data import PromptDataModule
from rloo_lightning.metrics import log_step_metrics


class Recorder(Logger):
    """``steps[name]``: the steps at which ``name`` was written."""

    name, version = "recorder", 0

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[str, list[int]] = {}
        self.values: dict[str, dict[int, float]] = {}

    def log_metrics(self, metrics, step=None) -> None:
        for name, value in metrics.items():
            self.steps.setdefault(name, []).append(step)
            self.values.setdefault(name, {})[step] = value

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


class Both(LightningModule):
    """Logs one value through ``self.log`` and another through ``log_step_metrics``, each step."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        self.log("lightning", float(self.global_step))
        log_step_metrics(self.trainer, {"direct": float(self.global_step), "shown": 2.0}, self.global_step,
                         prog_bar=("shown",))
        return (self.w * 0).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader([0] * 16, batch_size=None)


def test_written_where_lightning_writes_self_log_values():
    for every in (1, 3):
        recorder = Recorder()
        trainer = Trainer(max_steps=7, logger=recorder, log_every_n_steps=every, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
        trainer.fit(Both())
        assert recorder.steps["direct"] == recorder.steps["lightning"] != [], (every, recorder.steps)
        assert recorder.values["direct"] == recorder.values["lightning"]
        assert set(recorder.steps["epoch"]) == set(recorder.steps["lightning"])
        assert trainer.callback_metrics["direct"] == trainer.callback_metrics["lightning"] == 6.0
        assert trainer.progress_bar_metrics["shown"] == 2.0 and "direct" not in trainer.progress_bar_metrics


def test_without_a_trainer_nothing_happens():
    log_step_metrics(None, {"a": 1.0}, 0)  # a module driven by hand (tests, the exactness check)


def test_a_checkpoint_can_monitor_a_training_metric(tiny_model_dir, tmp_path):
    module = RLOOModule(tiny_model_dir, rewards={"funcs": ["rloo_lightning.tasks.reverse.reward"]},
                        sampling={"k": 2, "max_new_tokens": 4}, validation={"at_start": False})
    data = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="reverse", batch_size=2, num_train_rows=8,
                            num_val_rows=2, max_new_tokens=4)
    recorder = Recorder()
    best = ModelCheckpoint(dirpath=tmp_path, monitor="train/reward", mode="max", every_n_train_steps=1, save_top_k=1)
    trainer = Trainer(accelerator="cpu", max_steps=3, limit_val_batches=0, logger=recorder, callbacks=[best],
                      enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(module, datamodule=data)
    rewards = recorder.values["train/reward"]
    assert sorted(rewards) == [0, 1, 2]
    assert best.best_model_path and float(best.best_model_score) == max(rewards.values())
    assert trainer.callback_metrics["train/reward"] == rewards[2]


def _tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from rloo_lightning.runtime.tensorboard_logs import read_events

    return {tag: [(e.step, e.value) for e in events] for tag, events in read_events(folder).items()}


def test_tensorboard_gets_one_event_a_step_with_what_log_metrics_writes(tmp_path):
    """The same tags (with the logger's prefix), steps and values as Lightning's ``log_metrics`` writes."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from rloo_lightning.metrics import write_to_loggers

    fast, plain = (TensorBoardLogger(tmp_path, name=n, prefix="run") for n in ("fast", "plain"))
    trainer = Trainer(logger=[fast], log_every_n_steps=1, accelerator="cpu", enable_progress_bar=False)
    for step in range(3):
        values = {"train/a": 0.1 * step, "train/b": 1e-7 + step}
        write_to_loggers(trainer, values, step)
        plain.log_metrics({**values, "epoch": 0}, step=step)
    fast.experiment.flush()
    plain.experiment.flush()
    written = _tensorboard_scalars(fast.log_dir)
    assert set(written) == {"run-train/a", "run-train/b", "run-epoch"}
    assert written == _tensorboard_scalars(plain.log_dir)
