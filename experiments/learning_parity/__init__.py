"""The study: SmolLM2 learning against TRL's RLOOTrainer.

Its README.md holds the commands and the results.
"""
