"""The study: the paper's ablations (k, baselines, GRPO) on the quickstart task.

Its README.md holds the commands and the results.
"""
