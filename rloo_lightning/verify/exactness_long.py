"""A longer enumerable toy for the off-policy corrections: completions of up to 8 tokens, exact by enumeration.

The toy of :mod:`rloo_lightning.verify.exactness` has completions of at most 3 tokens, where neither the length
invariance of a geometric mean nor the growth with length of a product weight's variance can show. This one has the
same policy (a table of logits by position and previous token, the module's own ``training_step`` on the sampled
side) with completions of up to ``L = 8`` tokens over ``{a, b}`` and EOS (511 distinct completions per prompt), the
EOS logit lowered so that a completion is about 4-5 tokens long on average. ``grad J`` is exact by enumeration
(:func:`~rloo_lightning.verify.exactness.exact_gradient`: about 2.5 s at L = 8 on one core).

:func:`off_policy_draws` draws the step's gradient with a sampler that is not pi_theta in one of the two ways training
meets: at lag 0 a sampler whose table differs from the policy's (``perturbed_table``: what other kernels or another
precision do), against ``grad J`` at the policy; at lag K >= 1 the module's own pipeline samples at step 0 from the
policy's table and step K trains at another (:mod:`rloo_lightning.verify.exactness_stale`), against ``grad J`` there.
:func:`bias_and_variance` turns the draws into the figures of ``docs/correction.md``. Shapes: ``n`` draws, ``D``
coordinates of the table.
"""

from __future__ import annotations

import dataclasses
import math

from torch import Tensor

from rloo_lightning.verify.exactness import (
    Toy, completion_probabilities, enumerate_completions, exact_gradient, make_toy, training_step_draws, z_test,
)
from rloo_lightning.verify.exactness_stale import stale_training_step_draws

__all__ = ["make_long_toy", "mean_lengths", "mass_outside", "off_policy_draws", "off_policy_sample",
           "off_policy_target", "bias_and_variance"]


def make_long_toy(max_len: int = 8, eos_bias: float = -1.0, seed: int = 0, **kwargs) -> Toy:
    """The toy of :func:`~rloo_lightning.verify.exactness.make_toy` with completions of up to ``max_len`` tokens and
    ``eos_bias`` added to the EOS logit of the policy and the reference (the same shift: their KL is unchanged in
    kind), so that completions are long enough for length to matter. ``kwargs``: the other arguments of
    ``make_toy`` (prompts, temperature, logit_scale, ref_noise)."""
    toy = make_toy(max_len=max_len, seed=seed, **kwargs)
    shift = toy.policy_table.new_zeros(toy.policy_table.shape)
    shift[..., toy.emit.index(toy.eos_id)] = eos_bias
    return dataclasses.replace(toy, policy_table=toy.policy_table + shift, ref_table=toy.ref_table + shift)


def mean_lengths(toy: Toy, policy_table: Tensor | None = None) -> Tensor:
    """``[P]`` the exact mean completion length (EOS included) per prompt under ``policy_table`` (the toy's)."""
    if policy_table is not None:
        toy = dataclasses.replace(toy, policy_table=policy_table)
    lengths = [float(len(y)) for y in enumerate_completions(toy)]
    probs = completion_probabilities(toy)
    return probs @ probs.new_tensor(lengths)


def mass_outside(toy: Toy, sampler_table: Tensor, policy_table: Tensor, kind: str, lower: float,
                 upper: float) -> float:
    """The exact probability under the sampler that a completion's ratio pi_theta/pi_s (``sequence``: the product;
    ``geometric``: the geometric mean of its token ratios, over its tokens, EOS included) lies outside
    ``[lower, upper]``: the mass a filter with these bounds drops, averaged over the prompts."""
    lengths = [float(len(y)) for y in enumerate_completions(toy)]
    p_s = completion_probabilities(dataclasses.replace(toy, policy_table=sampler_table))
    p_theta = completion_probabilities(dataclasses.replace(toy, policy_table=policy_table))
    log_ratio = (p_theta / p_s).log()
    if kind == "geometric":
        log_ratio = log_ratio / log_ratio.new_tensor(lengths)
    ratio = log_ratio.exp()
    return float((p_s * ((ratio < lower) | (ratio > upper))).sum(1).mean())


def off_policy_draws(toy: Toy, other_table: Tensor, lag: int, num_draws: int, options: dict | None = None,
                     repeats: int = 16, seed: int = 0, beta: float = 0.1) -> tuple[Tensor, Tensor]:
    """``(draws [n, D], exact [D])``: ``-grad`` of the module's ``training_step`` and the exact ``grad J`` it estimates.

    ``lag`` 0: the engine samples from ``other_table`` (and reports its log-probs), the policy holds the toy's table,
    the target is ``grad J`` there. ``lag`` K >= 1: the pipeline samples at step 0 from the toy's table, step K trains
    with the policy at ``other_table``, the target is ``grad J`` at ``other_table``. ``options``: the module's option
    groups (``{"correction": {...}}``); every option is drawn from the same sampler stream (``seed``)."""
    return (off_policy_sample(toy, other_table, lag, num_draws, options, repeats, seed),
            off_policy_target(toy, other_table, lag, beta))


def off_policy_sample(toy: Toy, other_table: Tensor, lag: int, num_draws: int, options: dict | None = None,
                      repeats: int = 16, seed: int = 0) -> Tensor:
    """``[n, D]``: the draws of :func:`off_policy_draws` alone (a study drawing several options against one target
    computes the target once: :func:`off_policy_target`)."""
    if lag == 0:
        return training_step_draws(toy, num_draws, repeats, options, seed, sampler_table=other_table)
    return stale_training_step_draws(toy, other_table, num_draws, repeats, options, seed, lag)


def off_policy_target(toy: Toy, other_table: Tensor, lag: int, beta: float = 0.1) -> Tensor:
    """``[D]``: the exact ``grad J`` the draws of :func:`off_policy_draws` estimate (at the toy's table at lag 0, at
    ``other_table`` at lag K >= 1)."""
    return exact_gradient(toy if lag == 0 else dataclasses.replace(toy, policy_table=other_table), beta)


def bias_and_variance(draws: Tensor, exact: Tensor, alpha: float = 1e-3) -> dict:
    """The z-test of ``draws`` ``[n, D]`` against ``exact`` ``[D]`` (:func:`~rloo_lightning.verify.exactness.z_test`)
    and the bias in norms: ``relative_bias`` ||mean - exact|| / ||exact|| includes the draws' noise, whose size is
    ``relative_bias_noise_floor`` sqrt(trace(cov) / n) / ||exact||; ``relative_bias_debiased`` takes it out:
    sqrt(max(0, ||mean - exact||^2 - trace(cov) / n)) / ||exact||. ``relative_variance``: trace(cov) / ||exact||^2,
    the variance of one draw (one batch) relative to the size of the gradient."""
    z = z_test(draws, exact, alpha)
    n, norm2 = draws.shape[0], float(exact.pow(2).sum())
    err2, trace = float((draws.mean(0) - exact).pow(2).sum()), float(draws.var(0).sum())
    return {**dataclasses.asdict(z),
            "relative_bias_noise_floor": math.sqrt(trace / n / norm2),
            "relative_bias_debiased": math.sqrt(max(0.0, err2 - trace / n) / norm2),
            "relative_variance": trace / norm2}
