"""The Hugging Face KV-cache plumbing the engines and :mod:`rloo_lightning.forward` share: the model under a peft
wrapper, the forward's cache keyword (renamed in transformers 5.24), the cache a forward returned, and one prefill
of a rollout's distinct prompts whose cache serves each prompt's k rows."""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from rloo_lightning.algo.logprobs import mask_positions

__all__ = ["base_model", "cache_keyword", "returned_cache", "prefill_groups"]


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model under a peft wrapper (itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward's keyword for a KV cache: ``cache`` since transformers 5.24, ``past_key_values`` before."""
    forward = base_model(model).forward
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
