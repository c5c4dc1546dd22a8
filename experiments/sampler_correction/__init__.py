"""The study: reduced-precision samplers: speed, mismatch, learning with and without correction.

Its README.md holds the commands and the results.
"""
