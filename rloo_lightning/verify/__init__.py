"""The exactness harnesses: :mod:`.exactness` checks that ``RLOOModule.training_step`` is an unbiased estimator of
the RLOO gradient on a toy whose every completion can be enumerated, :mod:`.exactness_multiturn` the same for
two-turn episodes around a stochastic environment, :mod:`.exactness_stale` for stale rollouts through the module's
pipeline; :mod:`.exactness_long` is a toy with completions of up to 8 tokens, where a correction's dependence on the
length shows."""
