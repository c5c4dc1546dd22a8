"""The pure mathematics of RLOO: tensors in, tensors out, importing only torch and the standard library (a test
checks it).

- :mod:`~rloo_lightning.algo.advantages`: baselines and advantages (the leave-one-out default and the alternatives).
- :mod:`~rloo_lightning.algo.kl`: the KL term, its estimators and placements, the moving reference.
- :mod:`~rloo_lightning.algo.losses`: policy losses and their token aggregations.
- :mod:`~rloo_lightning.algo.correction`: sampler-mismatch diagnostics and importance-sampling corrections.
- :mod:`~rloo_lightning.algo.logprobs`: per-token log-probabilities, entropies and completion masks from logits.
- :mod:`~rloo_lightning.algo.shaping`: reward shaping on a rollout's tensors (overlong and missing-EOS penalties,
  clipping).
"""
