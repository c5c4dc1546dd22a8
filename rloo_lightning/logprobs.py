"""Per-token log-probabilities, entropies and masks of completions: the model's side of the loss.

Pure tensor functions (:func:`token_logprobs`, :func:`token_entropy`, :func:`completion_mask`,
:func:`masked_sum`) and the one function that runs a causal LM over a rollout's rows
(:func:`sequence_logprobs`), which ``training_step`` and the exactness test both call.
Shapes: ``B`` sequences, ``T`` completion length, ``V`` vocabulary.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "token_logprobs",
    "token_entropy",
    "completion_mask",
    "masked_sum",
    "mask_width",
    "completion_logits",
    "can_share_prompt",
    "shared_prompt_logits",
    "prefill_groups",
    "worth_sharing",
    "sequence_logprobs",
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


def completion_logits(model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                      completion_mask: Tensor, group_size: int = 1) -> Tensor:
    """Logits ``[b, T', V]`` predicting each completion token, prompt and completion in one forward.

    Position ids come from the attention mask, so left padding does not shift positions. Columns
    that are padding in every row (the prompts' common left padding, the tail after the longest
    completion) are cut before the forward: ``T'`` is the longest completion of these rows.
    ``logits[:, t]`` predicts ``completion_ids[:, t]`` (the last prompt position predicts the first).

    With ``group_size = k > 1`` and rows that come in groups of k equal prompts (a rollout's layout), each
    prompt is run once and its KV cache serves its k completions (:func:`shared_prompt_logits`): the same
    logits up to float rounding for (k-1)/k less prompt compute, forward and backward.

    Args:
        model: a causal LM taking ``input_ids, attention_mask, position_ids, use_cache, logits_to_keep``.
        prompt_ids, prompt_mask: ``[b, P]`` left-padded prompts.
        completion_ids, completion_mask: ``[b, T]``.
        group_size: rows per prompt group (1: no sharing).
    """
    start = int(prompt_mask.any(0).int().argmax())  # first column with a real prompt token
    prompt_ids, prompt_mask = prompt_ids[:, start:], prompt_mask[:, start:]
    width = mask_width(completion_mask)
    completion_ids = completion_ids[:, :width]
    if group_size > 1 and can_share_prompt(model, prompt_ids, prompt_mask, group_size):
        logits = shared_prompt_logits(model, prompt_ids, prompt_mask, completion_ids, group_size)
        if logits is not None:
            return logits
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attn = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
    out = model(input_ids=ids, attention_mask=attn, position_ids=mask_positions(attn), use_cache=False,
                logits_to_keep=width + 1)
    return out.logits[:, :-1]


def can_share_prompt(model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, group_size: int) -> bool:
    """Whether :func:`shared_prompt_logits` applies: rows in groups of ``group_size`` equal prompts, and a
    Hugging Face model that will return its KV cache (it can ``generate``, and is not checkpointing
    activations in training, where transformers turns the cache off)."""
    b = prompt_ids.shape[0]
    if b % group_size or prompt_ids.shape[1] < 1:
        return False
    base = _base_model(model)
    if not hasattr(base, "generate") or (model.training and _checkpointing(base)):
        return False
    grouped_ids = prompt_ids.view(b // group_size, group_size, -1)
    grouped_mask = prompt_mask.view(b // group_size, group_size, -1)
    return bool((grouped_ids == grouped_ids[:, :1]).all() and (grouped_mask == grouped_mask[:, :1]).all())


_warned_no_cache: set[str] = set()

#: ``update.share_prompt: auto`` shares a group's prompt when ``parameters x (k-1) x distinct prompt tokens`` reaches
#: this: 2 GFLOP saved per forward, about 13 ms at this CPU's large-matmul rate, against a forward call's per-op
#: overhead of a few ms (measured: SmolLM2-135M saves 5.5e10, the quickstart's tiny model 3e7).
SHARE_MIN_WORK = 1e9


def worth_sharing(params: int, k: int, distinct_prompt_tokens: int) -> bool:
    """``update.share_prompt: auto``: whether sharing the prompt saves more compute than its extra forward costs."""
    return k > 1 and params * (k - 1) * distinct_prompt_tokens >= SHARE_MIN_WORK


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model under a peft wrapper (itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _checkpointing(model: torch.nn.Module) -> bool:
    # transformers 5.x renamed is_gradient_checkpointing (deprecated) to is_activation_checkpointing.
    name = "is_activation_checkpointing" if hasattr(model, "is_activation_checkpointing") else \
        "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward's keyword for a KV cache: ``cache`` since transformers 5.24, ``past_key_values`` before."""
    forward = _base_model(model).forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def returned_cache(out):
    """The KV cache a forward returned (``cache`` or, before transformers 5.24, ``past_key_values``), or None."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def prefill_groups(model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, k: int):
    """One forward of the distinct prompts of ``b = n*k`` rows (every k-th row) with the KV cache on.

    Returns ``(cache, logits [n, 1, V])``: the last position's logits, and the cache repeated k times along the
    batch (``b`` rows, in the autograd graph when grad is on); ``(None, logits)`` when the model returned no cache
    that can be repeated. Positions come from the attention mask (left padding does not shift them).
    """
    ids, mask = prompt_ids[::k], prompt_mask[::k]
    out = model(input_ids=ids, attention_mask=mask, position_ids=mask_positions(mask),
                use_cache=True, logits_to_keep=1)
    cache = returned_cache(out)
    if cache is None or not hasattr(cache, "batch_repeat_interleave"):
        return None, out.logits
    if k > 1:
        cache.batch_repeat_interleave(k)
    return cache, out.logits


def shared_prompt_logits(model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                         group_size: int) -> Tensor | None:
    """:func:`completion_logits` with one forward per prompt group: the prompt's KV cache is shared.

    The first forward runs the ``n = b / k`` distinct prompts with the cache on; its last position predicts
    each group's first completion token. The cache (keys and values, still in the autograd graph) is
    repeated k times along the batch, and a second forward runs the completions against it, positions
    continuing after each prompt. Gradients reach the prompt positions through the shared cache, summed over
    the k completions, exactly as k separate forwards would give them: the same log-probs and gradient up to
    float rounding. It saves ``(k-1)/k`` of the prompt positions' compute in forward and backward.

    Args:
        prompt_ids, prompt_mask: ``[b, P]`` left-padded prompts, groups of ``k = group_size`` equal rows.
        completion_ids: ``[b, T']`` (already cut to the longest completion).

    Returns:
        ``[b, T', V]`` logits, or None when the model returned no cache (the caller runs the plain forward).
    """
    k, width = group_size, completion_ids.shape[1]
    cache, head_logits = prefill_groups(model, prompt_ids, prompt_mask, k)
    if cache is None:
        name = type(model).__name__
        if name not in _warned_no_cache:
            _warned_no_cache.add(name)
            warnings.warn(f"{name} returned no KV cache: each completion's prompt is run again (no prompt sharing)",
                          stacklevel=2)
        return None
    first = head_logits[:, -1:].repeat_interleave(k, dim=0)  # [b, 1, V]: predicts completion token 0
    if width == 1:
        return first
    attn = torch.cat([prompt_mask, torch.ones_like(completion_ids[:, :-1])], dim=1)
    positions = prompt_mask.sum(1, keepdim=True) + torch.arange(width - 1, device=completion_ids.device)
    tail = model(input_ids=completion_ids[:, :-1], attention_mask=attn, position_ids=positions,
                 use_cache=True, **{cache_keyword(model): cache})
    return torch.cat([first, tail.logits], dim=1)


def sequence_logprobs(model: torch.nn.Module, rollout, rows: slice = slice(None), temperature: float = 1.0,
                      with_entropy: bool = False, share_prompt: bool = False) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs ``[b, T]`` (fp32, at the sampling temperature) of a rollout's completions.

    The log-probs are of ``softmax(logits / temperature)``, the distribution that was sampled, so
    that ``grad log pi`` in the loss is of the sampler itself.

    Args:
        model: the causal LM (policy or reference).
        rollout: a :class:`~rloo_lightning.rollout.Rollout`; ``rows`` selects ``b`` of its ``B`` rows.
        with_entropy: also return the per-token entropies ``[b, T]`` (a metric, no grad).
        share_prompt: run each prompt group's prompt once (:func:`shared_prompt_logits`) when ``rows`` hold
            whole groups of ``rollout.k``.

    Returns:
        ``(logp [b, T], entropy [b, T] or None)``, 0 past each row's longest completion.
    """
    start, stop, _ = rows.indices(rollout.completion_ids.shape[0])
    whole_groups = start % rollout.k == 0 and (stop - start) % rollout.k == 0
    logits = completion_logits(model, rollout.prompt_ids[rows], rollout.prompt_mask[rows],
                               rollout.completion_ids[rows], rollout.completion_mask[rows],
                               group_size=rollout.k if share_prompt and whole_groups else 1)
    tokens = rollout.completion_ids[rows][:, : logits.shape[1]]
    pad = (0, rollout.completion_ids.shape[1] - logits.shape[1])
    logp = torch.nn.functional.pad(token_logprobs(logits, tokens, temperature), pad)
    entropy = None
    if with_entropy:
        entropy = torch.nn.functional.pad(token_entropy(logits.detach(), temperature), pad)
    return logp, entropy
