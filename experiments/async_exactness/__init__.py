"""The study: stale rollouts (rollout.lag K = 1) through the module's pipeline against the exact gradient.

Its README.md holds the command and the results.
"""
