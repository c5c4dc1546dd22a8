"""Callbacks for the console tests' CLI runs (``tests/helpers/`` is on the subprocesses' ``PYTHONPATH``, see
cli_harness): ``--trainer.callbacks+=console_helpers.WarnAtTrainStart`` and so on."""

from __future__ import annotations

import warnings

from lightning.pytorch import Callback

WARNING = "a warning from console_helpers, on purpose"
FAILURE = "evaluation failed on purpose"


class WarnAtTrainStart(Callback):
    """Emits :data:`WARNING` (a ``UserWarning``) when training starts, after the progress bar's ``on_train_start``
    when listed after it."""

    def on_train_start(self, trainer, pl_module) -> None:
        warnings.warn(WARNING, UserWarning, stacklevel=1)


class FailSecondEvaluation(Callback):
    """The module's second ``evaluate_batch`` call raises ``RuntimeError(FAILURE)``: with two validation batches,
    the validation before training fails after its first batch (a progress line has been written by then)."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        original, calls = pl_module.evaluate_batch, []

        def failing(batch, batch_idx):
            calls.append(batch_idx)
            if len(calls) == 2:
                raise RuntimeError(FAILURE)
            return original(batch, batch_idx)

        pl_module.evaluate_batch = failing
