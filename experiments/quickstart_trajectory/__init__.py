"""The study: the quickstart's every logged value, bit for bit on one kind of CPU.

Its README.md holds the commands and the results.
"""
