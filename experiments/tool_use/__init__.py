"""The study: SmolLM2 learns to call a calculator.

Its README.md holds the commands and the results.
"""
