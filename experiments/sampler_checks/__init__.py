"""The study: both samplers draw from the policy.

Its README.md holds the commands and the results.
"""
