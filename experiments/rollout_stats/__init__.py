"""The study: each system's own rollout pipeline gives the same batch statistics.

Its README.md holds the commands and the results.
"""
