"""The study: learning with a fixed rollout lag K (rollout.lag) and vLLM as the rollout engine.

Its README.md holds the command and the results.
"""
