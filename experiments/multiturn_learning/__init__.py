"""The study: multi-turn RLOO learns to use an environment's reply.

Its README.md holds the commands and the results.
"""
