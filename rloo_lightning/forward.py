"""Running a causal LM over a rollout's rows: the log-probs (and entropies) of its completions, prompt and
completion in one forward, or each prompt group's prompt run once with its KV cache shared by the k completions.

:func:`sequence_logprobs` is what ``training_step`` and the exactness test call; :func:`worth_sharing` decides
``update.share_prompt: auto``. The tensor functions it applies to the logits are
:mod:`rloo_lightning.algo.logprobs`'s. Shapes: ``B`` sequences, ``T`` completion length, ``V`` vocabulary.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from rloo_lightning.algo.logprobs import mask_positions, mask_width, token_entropy, token_logprobs
from rloo_lightning.engines.kv_cache import base_model, cache_keyword, prefill_groups

__all__ = [
    "completion_logits",
    "can_share_prompt",
    "shared_prompt_logits",
    "worth_sharing",
    "sequence_logprobs",
]


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
    base = base_model(model)
    if not hasattr(base, "generate") or (model.training and _checkpointing(base)):
        return False
    grouped_ids = prompt_ids.view(b // group_size, group_size, -1)
    grouped_mask = prompt_mask.view(b // group_size, group_size, -1)
    return bool((grouped_ids == grouped_ids[:, :1]).all() and (grouped_mask == grouped_mask[:, :1]).all())


_warned_no_cache: set[str] = set()

#: ``update.share_prompt: auto`` shares a group's prompt when ``parameters x (k-1) x distinct prompt tokens`` reaches
#: this: 2 GFLOP saved per forward, against a forward call's per-op overhead (SmolLM2-135M's and the quickstart's
#: tiny model's figures, measured: see ``docs/generation.md``, "Shared prompts in the update").
SHARE_MIN_WORK = 1e9


def worth_sharing(params: int, k: int, distinct_prompt_tokens: int) -> bool:
    """``update.share_prompt: auto``: whether sharing the prompt saves more compute than its extra forward costs."""
    return k > 1 and params * (k - 1) * distinct_prompt_tokens >= SHARE_MIN_WORK


def _checkpointing(model: torch.nn.Module) -> bool:
    # transformers 5.x renamed is_gradient_checkpointing (deprecated) to is_activation_checkpointing.
    name = "is_activation_checkpointing" if hasattr(model, "is_activation_checkpointing") else \
        "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


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
