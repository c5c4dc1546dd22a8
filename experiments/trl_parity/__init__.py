"""The study: the same rollouts make the same model in rloo_lightning and TRL.

Its README.md holds the commands and the results.
"""
