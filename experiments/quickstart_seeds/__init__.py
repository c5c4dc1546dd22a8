"""The study: the quickstart over several seeds.

Its README.md holds the commands and the results.
"""
