"""The study: every off-policy correction of ``model.correction`` against the exact gradient on a toy with long
completions, with a sampler that is not pi_theta (lag 0) and with stale rollouts (lag 1).

Its README.md holds the command and the results.
"""
