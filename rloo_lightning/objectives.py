"""Pure tensor functions of RLOO: advantages, token log-probs, KL, losses.

Nothing here imports Lightning or transformers: tensors in, tensors out. Shapes use
``B`` = number of sequences (prompts x k, prompt-major), ``T`` = completion length,
``V`` = vocabulary size, ``N`` = number of prompts.

Paper: Ahmadian et al. 2024, *Back to Basics: Revisiting REINFORCE-Style Optimization for
Learning from Human Feedback in LLMs* (arXiv:2402.14740), Sec. 3.3 (RLOO) and Eq. 3-4.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "leave_one_out_advantages",
    "token_logprobs",
    "token_entropy",
    "completion_mask",
    "masked_sum",
    "masked_mean",
    "sequence_kl",
    "policy_loss",
    "pass_at_k",
    "group_std",
]


def leave_one_out_advantages(rewards: Tensor, k: int) -> Tensor:
    """Leave-one-out advantages ``A_i = R_i - mean_{j != i} R_j`` within each prompt group.

    Kool et al. 2019 / Ahmadian et al. 2024, Eq. 4: the baseline of sample ``i`` is the mean
    reward of the other ``k-1`` samples of the same prompt, so it is independent of ``y_i``
    and the estimator stays unbiased.

    Args:
        rewards: ``[N*k]`` float, prompt-major: the k completions of prompt ``p`` sit at
            ``p*k ... p*k+k-1``. ``NaN`` marks a missing reward: it is left out of its group's
            baseline and its own advantage is 0.
        k: group size, ``>= 2``.

    Returns:
        ``[N*k]`` advantages, same dtype as ``rewards``. A group with fewer than two valid
        rewards gets advantage 0 everywhere (no baseline can be formed).
    """
    if k < 2:
        raise ValueError(f"k must be >= 2 for a leave-one-out baseline, got k={k}")
    if rewards.dim() != 1 or rewards.numel() % k != 0:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by k={k}, got shape {tuple(rewards.shape)}"
        )
    grouped = rewards.view(-1, k)
    valid = ~torch.isnan(grouped)
    filled = torch.where(valid, grouped, torch.zeros_like(grouped))
    total = filled.sum(dim=1, keepdim=True)
    count = valid.sum(dim=1, keepdim=True)
    # Baseline over the *other* valid samples: (sum - r_i) / (count - 1); vectorised, no loop.
    others = (count - 1).clamp(min=1).to(rewards.dtype)
    baseline = (total - filled) / others
    adv = torch.where(valid & (count >= 2), filled - baseline, torch.zeros_like(filled))
    return adv.view(-1)


class _TokenLogprob(torch.autograd.Function):
    """log softmax(logits / T)[token] in fp32, saving only the input logits and the log-normaliser.

    A plain ``log_softmax(...).gather(...)`` keeps an fp32 ``[B, T, V]`` tensor alive until the
    backward pass; here the softmax is recomputed chunk by chunk in the backward instead.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, chunk: int) -> Tensor:
        flat = logits.reshape(-1, logits.shape[-1])
        idx = tokens.reshape(-1, 1)
        out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for s in range(0, flat.shape[0], chunk):
            z = flat[s : s + chunk].float() / temperature
            lse[s : s + chunk] = torch.logsumexp(z, dim=-1)
            out[s : s + chunk] = z.gather(1, idx[s : s + chunk]).squeeze(1) - lse[s : s + chunk]
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out.view(tokens.shape)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, tokens, lse = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        flat = logits.reshape(-1, logits.shape[-1])
        idx = tokens.reshape(-1, 1)
        g = grad_out.reshape(-1).float()
        grad = torch.empty_like(flat)
        for s in range(0, flat.shape[0], chunk):
            # d logp_tok / d z = onehot(tok) - softmax(z); z = logits / T.
            probs = torch.exp(flat[s : s + chunk].float() / temperature - lse[s : s + chunk, None])
            gz = -probs * g[s : s + chunk, None]
            gz.scatter_add_(1, idx[s : s + chunk], g[s : s + chunk, None])
            grad[s : s + chunk] = (gz / temperature).to(grad.dtype)
        return grad.view(logits.shape), None, None, None


CHUNK_ELEMENTS = 1 << 24  # fp32 elements of one [rows, V] temporary: 64 MiB, whatever the vocabulary


def _chunk_rows(chunk_size: int | None, vocab: int) -> int:
    """Rows of ``[N, V]`` logits per chunk: ``chunk_size``, or as many as fit in ``CHUNK_ELEMENTS``."""
    return int(chunk_size) if chunk_size else max(1, CHUNK_ELEMENTS // vocab)


def token_logprobs(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> Tensor:
    """Per-token log-probabilities ``log softmax(logits / temperature)[token]`` in fp32.

    The temperature must be the sampling temperature: the sampled distribution is
    ``softmax(logits / T)``, and the estimator's ``grad log pi`` is of that distribution.

    Args:
        logits: ``[B, T, V]`` (any float dtype; the softmax is taken in fp32). ``logits[:, t]``
            must be the prediction of ``tokens[:, t]``.
        tokens: ``[B, T]`` long.
        temperature: ``> 0``.
        chunk_size: rows of ``B*T`` processed at once; bounds the fp32 ``[chunk, V]`` temporaries.
            Default: ``CHUNK_ELEMENTS // V`` rows (64 MiB a temporary: 341 rows for a 49k vocabulary,
            110 for a 151k one), so the transient memory does not grow with the vocabulary.

    Returns:
        ``[B, T]`` fp32 log-probs, differentiable w.r.t. ``logits``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} disagree on [B, T]"
        )
    return _TokenLogprob.apply(logits, tokens.long(), float(temperature), _chunk_rows(chunk_size, logits.shape[-1]))


@torch.no_grad()
def token_entropy(logits: Tensor, temperature: float = 1.0, chunk_size: int | None = None) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` at every position (a metric, no gradient).

    Args:
        logits: ``[B, T, V]``.
        chunk_size: rows of ``B*T`` at once (default: as :func:`token_logprobs`, 64 MiB temporaries).

    Returns:
        ``[B, T]`` fp32 entropies in nats (always ``>= 0``).
    """
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    chunk_size = _chunk_rows(chunk_size, flat.shape[1])
    for s in range(0, flat.shape[0], chunk_size):
        logp = torch.log_softmax(flat[s : s + chunk_size].float() / temperature, dim=-1)
        out[s : s + chunk_size] = -(logp.exp() * logp).sum(-1)
    return out.view(logits.shape[:-1])


def completion_mask(completion_ids: Tensor, eos_token_ids: Sequence[int] | Tensor) -> Tensor:
    """Mask of completion tokens up to and including the first EOS.

    Built from the EOS *position*, never from ``ids != pad_id``: when ``pad == eos`` (SmolLM2
    and many chat models) that comparison would also drop the real EOS, whose log-prob the
    policy must learn.

    Args:
        completion_ids: ``[B, T]`` generated tokens (after the prompt).
        eos_token_ids: ids any of which ends a completion.

    Returns:
        ``[B, T]`` float mask; a completion without EOS (truncated) is all ones.
    """
    eos = torch.as_tensor(list(eos_token_ids) if not isinstance(eos_token_ids, Tensor) else eos_token_ids,
                          device=completion_ids.device)
    is_eos = torch.isin(completion_ids, eos)
    # Number of EOS strictly before t; a token is kept while none has appeared yet.
    eos_before = torch.cumsum(is_eos.int(), dim=1) - is_eos.int()
    return (eos_before == 0).float()


def masked_sum(values: Tensor, mask: Tensor, dim: int = -1) -> Tensor:
    """``sum(values * mask)`` along ``dim``; masked entries contribute exactly 0 even if NaN/inf.

    Args:
        values: ``[..., T]``; mask: same shape, 0/1.
    """
    return torch.where(mask.bool(), values, torch.zeros_like(values)).sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over unmasked entries (all of them if ``dim`` is None); 0 if none.

    Args:
        values: ``[..., T]``; mask: same shape, 0/1.
    """
    if dim is None:
        return masked_sum(values.reshape(-1), mask.reshape(-1), 0) / mask.sum().clamp(min=1)
    return masked_sum(values, mask, dim) / mask.sum(dim).clamp(min=1)


def sequence_kl(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """Sequence KL estimate k1: ``sum_t m_t (logp_t - ref_logp_t)`` = ``log pi(y)/pi_ref(y)``.

    The single-sample estimator of KL(pi || pi_ref) used by the paper (Sec. 2.3) and TRL; it
    is unbiased for the sequence KL when ``y ~ pi``, though a single value can be negative.

    Args:
        logp, ref_logp: ``[B, T]`` per-token log-probs of the sampled completion.
        mask: ``[B, T]`` completion mask.

    Returns:
        ``[B]``.
    """
    return masked_sum(logp - ref_logp, mask)


def policy_loss(
    advantages: Tensor, logp: Tensor, mask: Tensor, num_sequences: int | Tensor | None = None
) -> Tensor:
    """The paper's sequence-level REINFORCE loss ``-1/B * sum_i A_i * sum_t m_t logp_t``.

    Each completion is one action (Ahmadian et al. 2024, Sec. 3.1): its log-prob is the sum of
    its token log-probs, with no length normalisation (which would bias the gradient toward
    short or long answers) and no importance ratio or clip (on-policy, one update per rollout).

    Args:
        advantages: ``[B]``; treated as constants (detached here).
        logp: ``[B, T]`` policy log-probs with grad.
        mask: ``[B, T]`` completion mask (0 at padding and after the first EOS).
        num_sequences: the divisor; defaults to ``B``. Pass the number of kept sequences when
            some rows are dropped (their advantage 0), to average over what remains.

    Returns:
        scalar loss.
    """
    denom = advantages.shape[0] if num_sequences is None else num_sequences
    return -(advantages.detach() * masked_sum(logp, mask)).sum() / denom


def pass_at_k(successes: Tensor, n: int, k: int) -> Tensor:
    """Unbiased pass@k from ``n`` samples per prompt (Chen et al. 2021, Eq. 1): ``1 - C(n-c, k) / C(n, k)``.

    Args:
        successes: ``[N]`` number of successful samples ``c`` per prompt, ``0 <= c <= n``.
        n: samples per prompt; k: ``1 <= k <= n``.

    Returns:
        ``[N]`` float probabilities that at least one of k samples drawn without replacement succeeds.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    c = successes.long()
    # prod_{i=n-c+1}^{n} (1 - k/i) = C(n-c, k)/C(n, k), stable for large n (no factorials).
    i = torch.arange(1, n + 1, device=successes.device, dtype=torch.float64)
    factors = torch.where(i[None] > (n - c)[:, None], 1.0 - k / i[None], torch.ones_like(i[None]))
    fail = torch.where(n - c < k, torch.zeros_like(c, dtype=torch.float64), factors.prod(1))
    return (1.0 - fail).float()


def group_std(values: Tensor, k: int) -> Tensor:
    """Population std of each prompt group's valid (non-NaN) rewards.

    Args:
        values: ``[N*k]`` prompt-major. Returns ``[N]`` (0 for a group with < 2 valid values).
    """
    groups = values.view(-1, k)
    valid = ~torch.isnan(groups)
    n = valid.sum(1).clamp(min=1)
    filled = torch.where(valid, groups, torch.zeros_like(groups))
    mean = filled.sum(1) / n
    var = torch.where(valid, (groups - mean[:, None]) ** 2, torch.zeros_like(groups)).sum(1) / n
    return torch.where(valid.sum(1) >= 2, var.sqrt(), torch.zeros_like(var))
