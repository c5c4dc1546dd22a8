"""The default generation engine: a decode loop of its own over the policy's KV cache.

``generate`` is general; an RLOO rollout asks for one thing, ``N*k`` samples from pi_theta at a temperature, and
three parts of ``generate``'s cost are not needed for it (measured on SmolLM2-135M, 16 rows, CPU; see
``benchmarks/generation.md``):

- each of the k copies of a prompt is prefilled again: here each distinct prompt is prefilled once and its cache
  repeated over its k rows;
- ``torch.multinomial`` over a ``[16, 49152]`` distribution draws one exponential variate per entry: here one
  uniform per row is located in the float64 cumulative distribution (inverse CDF,
  :func:`sample_from_logits`), exact to float64 rounding;
- finished rows keep being decoded: here they leave the batch (and the cache) as they finish.

It returns the log-probabilities of the tokens it sampled (the fp32 softmax it sampled from), which the tests check
against the training forward's within 1e-4: it is pi_theta, not an approximation that needs correcting.

Sampling options it does not implement (top-k, top-p, repetition penalty, ``min_new_tokens``, stop strings) and a
sharded policy that gathers per forward (``synced_gpus``) go to :class:`~rloo_lightning.engines.HFGenerateEngine`.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor

from rloo_lightning.engines.base import GenerationEngine
from rloo_lightning.engines.hf_generate import HFGenerateEngine, generates_synced, prompt_groups
from rloo_lightning.engines.kv_cache import base_model, cache_keyword, prefill_groups, returned_cache
from rloo_lightning.runtime import sigterm

__all__ = ["DecodeLoopEngine", "sample_from_logits", "plain_sampling"]

HEAD_CHUNK = 4096  # vocabulary rows of the LM head per matmul while decoding


def sample_from_logits(logits: Tensor, temperature: float, generator: torch.Generator | None,
                       greedy: bool = False) -> tuple[Tensor, Tensor]:
    """One token per row of ``softmax(logits / temperature)``, and its log-probability.

    Inverse-CDF sampling: a uniform ``u`` per row, scaled to the row's total mass, located in the float64 running
    sum of the probabilities. A token of probability ``p`` is drawn with probability ``p`` up to float64 rounding
    of the running sum (about 1e-16 per entry, against fp32 for the probabilities themselves); a token of
    probability 0 is never drawn. One random number per row, where ``torch.multinomial`` draws one per entry.

    Args:
        logits: ``[B, V]``.
        temperature: ``> 0`` (ignored when ``greedy``).
        generator: the random stream (its device is ``logits``'s).
        greedy: take the argmax instead.

    Returns:
        ``(tokens [B] long, logp [B] fp32)``, ``logp`` the log-probability under ``softmax(logits / temperature)``
        (for greedy: under ``softmax(logits)``).
    """
    logp = torch.log_softmax(logits.float() / (1.0 if greedy else temperature), dim=-1)
    if greedy:
        tokens = logp.argmax(-1)
    else:
        cdf = logp.exp().double().cumsum(-1)
        u = torch.rand(logits.shape[0], 1, generator=generator, device=logits.device, dtype=torch.float64)
        tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp(max=logits.shape[-1] - 1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def plain_sampling(config) -> bool:
    """Whether a generation config asks only for what :class:`DecodeLoopEngine` implements: temperature (or greedy),
    EOS ids, ``max_new_tokens``; no top-k / top-p / min-p, repetition penalty, ``min_new_tokens`` or stop strings."""
    sampled = config.do_sample
    return ((not sampled or (config.top_k in (None, 0) and config.top_p in (None, 1.0) and config.min_p is None))
            and config.repetition_penalty in (None, 1.0) and not config.min_new_tokens and not config.stop_strings
            and (config.num_beams or 1) == 1 and (config.num_return_sequences or 1) == 1
            and not config.suppress_tokens and not config.begin_suppress_tokens and not config.bad_words_ids)


def _chunked_head(module: torch.nn.Linear, x: Tensor) -> Tensor:
    """``module(x)`` as vocabulary chunks of one output: in one piece, the ``[rows, H] x [H, V]`` matmul of a decode
    step runs at a fraction of the small-matmul rate on CPU (``benchmarks/generation.md``)."""
    weight = module.weight
    if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):  # mm(out=...) has no autograd
        return torch.nn.functional.linear(x, weight, module.bias)
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    flat, out_flat = x.reshape(-1, x.shape[-1]), out.view(-1, weight.shape[0])
    for s in range(0, weight.shape[0], HEAD_CHUNK):
        torch.mm(flat, weight[s:s + HEAD_CHUNK].t(), out=out_flat[:, s:s + HEAD_CHUNK])
    return out if module.bias is None else out + module.bias


class DecodeLoopEngine(GenerationEngine):
    """Samples from pi_theta with a decode loop over the policy's KV cache (see the module docstring).

    Args:
        return_logprobs: also return the log-probabilities of the sampled tokens (the softmax sampled from); the
            module then logs ``train/mismatch/*``, which for this engine measures only float rounding.
        chunk_head: compute the LM head of each decode step in vocabulary chunks (an ``nn.Linear`` head only).
        compact: drop finished rows from the batch and the cache as they finish.

    The random stream is a ``torch.Generator`` seeded with the call's seed: the global RNG is not touched, and a
    seed gives the same tokens again. It is not ``generate``'s stream: the same seed samples other tokens (from
    the same distribution) than :class:`~rloo_lightning.engines.HFGenerateEngine`.
    """

    def __init__(self, return_logprobs: bool = False, chunk_head: bool = True, compact: bool = True) -> None:
        self.return_logprobs = return_logprobs
        self.reports_logprobs = return_logprobs
        self.chunk_head = chunk_head
        self.compact = compact
        self._fallback = HFGenerateEngine(return_logprobs=return_logprobs)

    def generate(self, model, tokenizer, prompt_ids, prompt_mask, generation_config, seed):
        if generates_synced(model) or not plain_sampling(generation_config):
            return self._fallback.generate(model, tokenizer, prompt_ids, prompt_mask, generation_config, seed)
        if not hasattr(base_model(model), "generate"):  # not a Hugging Face generative model: no KV cache
            return self._fallback.generate(model, tokenizer, prompt_ids, prompt_mask, generation_config, seed)
        was_training = model.training
        model.eval()  # no dropout
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        patch = self.chunk_head and type(head) is torch.nn.Linear and not hasattr(head.weight, "full_tensor")
        if patch:
            head.forward = types.MethodType(_chunked_head, head)
        try:
            with torch.no_grad():  # as generate (inside the module's inference_mode, a no-op)
                ids, logp = self._decode(model, prompt_ids, prompt_mask, generation_config, seed)
        finally:
            if patch:
                del head.forward
            model.train(was_training)
        return (ids, logp) if self.return_logprobs and generation_config.do_sample else ids

    def _decode(self, model, prompt_ids: Tensor, prompt_mask: Tensor, config, seed: int) -> tuple[Tensor, Tensor]:
        device, B, P = prompt_ids.device, prompt_ids.shape[0], prompt_ids.shape[1]
        greedy, T = not config.do_sample, int(config.max_new_tokens)
        eos = config.eos_token_id
        eos = torch.tensor([eos] if isinstance(eos, int) else list(eos), device=device)
        pad = config.pad_token_id if config.pad_token_id is not None else int(eos[0])
        generator = torch.Generator(device=device).manual_seed(int(seed) % (2 ** 63))
        keyword = cache_keyword(model)
        # Prefill each distinct prompt once; its cache and last logits serve its k rows.
        k = prompt_groups(prompt_ids, prompt_mask)
        cache, logits = prefill_groups(model, prompt_ids, prompt_mask, k)
        logits = logits[:, -1].repeat_interleave(k, dim=0)
        if cache is None:
            raise ValueError(f"{type(model).__name__} returned no KV cache with use_cache=True: DecodeLoopEngine needs "
                             "one (generation_engine: rloo_lightning.engines.HFGenerateEngine samples without)")
        tokens_out = torch.full((B, T), pad, dtype=torch.long, device=device)
        logp_out = torch.zeros(B, T, dtype=torch.float32, device=device)  # bf16-true sets the default dtype
        rows = torch.arange(B, device=device)  # the live rows' indices in the output
        attention = torch.cat([prompt_mask, torch.ones(B, T, dtype=prompt_mask.dtype, device=device)], dim=1)
        next_position = prompt_mask.sum(1)
        done = torch.zeros(B, dtype=torch.bool, device=device)  # of the live rows
        steps = 0
        for t in range(T):
            tokens, logp = sample_from_logits(logits, config.temperature or 1.0, generator, greedy)
            tokens, logp = tokens.masked_fill(done, pad), logp.masked_fill(done, 0.0)  # (compact=False) after EOS
            tokens_out[rows, t], logp_out[rows, t] = tokens, logp
            steps = t + 1
            done = done | torch.isin(tokens, eos)
            # A SIGTERM: one process stops here (sigterm.py); several ranks keep the tokens so far and stop together
            if t == T - 1 or bool(done.all()) or sigterm.check("generation"):
                break
            if self.compact and bool(done.any()):
                keep = (~done).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                rows, tokens, attention, next_position = rows[keep], tokens[keep], attention[keep], next_position[keep]
                done = done[keep]
            out = model(input_ids=tokens[:, None], attention_mask=attention[:, :P + t + 1],
                        position_ids=(next_position + t)[:, None], use_cache=True, **{keyword: cache})
            cache, logits = returned_cache(out), out.logits[:, -1]
        return tokens_out[:, :steps], logp_out[:, :steps]
