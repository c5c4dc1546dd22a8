"""Per-token log-probabilities, entropies and masks of completions: the model's side of the loss, as pure tensor
functions of logits and token ids.

:func:`token_logprobs`, :func:`token_entropy`, :func:`completion_mask`, :func:`masked_sum`, :func:`mask_width` and
:func:`mask_positions`. Running a model over a rollout's rows is :mod:`rloo_lightning.forward`'s.
Shapes: ``B`` sequences, ``T`` completion length, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "token_logprobs",
    "token_entropy",
    "completion_mask",
    "masked_sum",
    "mask_width",
    "mask_positions",
]


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


def mask_width(mask: Tensor) -> int:
    """Columns up to the last one that any row of ``mask`` ``[b, T]`` covers (at least 1).

    A single-turn mask is a prefix, so this is the longest completion. A multi-turn transcript's mask has holes
    (the environment's tokens), and the width still reaches its last policy token.
    """
    covered = (mask > 0).any(0).nonzero()
    return int(covered.max()) + 1 if covered.numel() else 1


def mask_positions(mask: Tensor) -> Tensor:
    """Position ids ``[B, L]`` for an attention mask ``[B, L]``: the real tokens of a row count 0, 1, 2, ...
    whatever padding precedes them (left padding does not shift a prompt), and padding itself takes 0."""
    return (mask.long().cumsum(1) - 1).clamp(min=0)
