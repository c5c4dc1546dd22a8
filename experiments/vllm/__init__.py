"""The study: vLLM as the rollout engine: exactness, learning, speed and memory.

Its README.md holds the commands and the results.
"""
