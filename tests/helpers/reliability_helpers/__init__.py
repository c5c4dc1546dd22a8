"""Helpers of the CLI runs (``tests/test_resume.py`` and others): callbacks importable by class path, and scripts run
as subprocesses.

Subprocesses get ``tests/helpers/`` on ``PYTHONPATH`` so that ``reliability_helpers.callbacks.PoisonReward``
etc. resolve from a LightningCLI ``--trainer.callbacks+=`` argument.
"""
