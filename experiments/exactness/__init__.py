"""The study: each option's training step against the exact gradient; planted bugs; importance corrections.

Its README.md holds the commands and the results.
"""
