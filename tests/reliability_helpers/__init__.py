"""Helpers for ``tests/test_reliability.py``: callbacks importable by class path and scripts run as subprocesses.

Subprocesses get ``tests/`` on ``PYTHONPATH`` so that ``reliability_helpers.callbacks.PoisonReward``
etc. resolve from a LightningCLI ``--trainer.callbacks+=`` argument.
"""
