"""The policy's own ``generate`` as an engine (:class:`HFGenerateEngine`: every sampling option transformers has;
pi_theta), and what other engines share with it: the prefill of each distinct prompt once (:func:`prompt_groups`,
:func:`shared_prefill`) and the test for a sharded policy that gathers per forward (:func:`generates_synced`).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator

import torch
from torch import Tensor
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from rloo_lightning.engines.base import GenerationEngine
from rloo_lightning.engines.kv_cache import base_model, cache_keyword, prefill_groups
from rloo_lightning.runtime import sigterm

__all__ = ["HFGenerateEngine", "generates_synced", "prompt_groups", "shared_prefill"]


class HFGenerateEngine(GenerationEngine):
    """``model.generate`` with the KV cache, in eval mode, stopping when every row has ended.

    Args:
        return_logprobs: also return log pi_s of each sampled token, from the processed logits ``generate``
            sampled from (temperature and any top-k / top-p applied): the mismatch diagnostics then measure
            how far cached decoding is from the training forward.
        sampler_temperature: sample at this temperature instead of ``sampling.temperature`` (the log-probs
            follow it): a sampler that differs from pi_theta by a known amount, to test the correction.
        share_prompt: prefill each distinct prompt once and share its KV cache across its k samples
            (:func:`shared_prefill`), instead of prefilling all ``N*k`` rows: the same distribution, the
            same random draws, (k-1)/k less prefill compute.
    """

    def __init__(self, return_logprobs: bool = False, sampler_temperature: float | None = None,
                 share_prompt: bool = True) -> None:
        if sampler_temperature is not None and sampler_temperature <= 0:
            raise ValueError(f"sampler_temperature must be > 0, got {sampler_temperature}")
        self.return_logprobs = return_logprobs or sampler_temperature is not None
        self.sampler_temperature = sampler_temperature
        self.share_prompt = share_prompt

    @property
    def reports_logprobs(self) -> bool:
        """Whether sampled rollouts come with log pi_s (what ``correction.level`` needs)."""
        return self.return_logprobs

    def generate(self, model, tokenizer, prompt_ids, prompt_mask, generation_config, seed):
        # A peft wrapper generates with its base model's generation_config.
        base = base_model(model)
        was_training, shipped = model.training, base.generation_config
        # transformers fills every unset field of our config from the model's shipped one (min_p,
        # suppress_tokens, ... would truncate the sampler); an empty one leaves nothing to merge.
        base.generation_config = GenerationConfig()
        model.eval()  # eval: no dropout, and transformers keeps the KV cache even when checkpointing
        logprobs = self.return_logprobs and generation_config.do_sample
        if logprobs:
            generation_config = copy.deepcopy(generation_config)
            generation_config.output_scores = generation_config.return_dict_in_generate = True
            if self.sampler_temperature is not None:
                generation_config.temperature = self.sampler_temperature
        try:
            # Not where every forward gathers sharded weights (synced_gpus): ranks must run the same forwards.
            share = self.share_prompt and not generates_synced(model)
            prefilled = shared_prefill(model, prompt_ids, prompt_mask) if share else {}
            with _seeded_global_rng(seed, prompt_ids.device):
                out = model.generate(
                    input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=generation_config,
                    tokenizer=tokenizer if generation_config.stop_strings else None, **prefilled,
                    stopping_criteria=StoppingCriteriaList([_StopRequested()]),
                )
        finally:
            model.train(was_training)
            base.generation_config = shipped
        if not logprobs:
            return out[:, prompt_ids.shape[1] :]
        ids = out.sequences[:, prompt_ids.shape[1] :]
        # scores: one [B, V] tensor per generated position, the processed logits that were sampled from.
        scores = torch.stack(out.scores, dim=1).float()
        return ids, torch.log_softmax(scores, dim=-1).gather(-1, ids[..., None]).squeeze(-1)


class _StopRequested(StoppingCriteria):
    """A SIGTERM (:func:`rloo_lightning.runtime.sigterm.check`): one process stops at this token; with several ranks
    every row of this rank ends here (under ``synced_gpus`` it keeps serving the others' forwards until they end
    too)."""

    def __call__(self, input_ids: Tensor, scores, **kwargs) -> Tensor:
        return torch.full((input_ids.shape[0],), sigterm.check("generation"), dtype=torch.bool, device=input_ids.device)


def generates_synced(model) -> bool:
    """Whether ``model.generate`` was given ``synced_gpus=True`` (a sharded policy that gathers per forward: every
    rank must run the same forwards, so nothing may add or skip one)."""
    return bool(getattr(getattr(model, "generate", None), "keywords", {}).get("synced_gpus", False))


def prompt_groups(prompt_ids: Tensor, prompt_mask: Tensor) -> int:
    """The largest ``g`` such that the rows are runs of ``g`` equal consecutive prompts (ids and mask): the gcd of
    the runs' lengths, so ``k`` (or a multiple of it) for a rollout's ``N*k`` rows even when two neighbouring
    prompts are equal; 1 when no row repeats."""
    rows = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    _, counts = torch.unique_consecutive(rows, dim=0, return_counts=True)
    return math.gcd(*counts.tolist())


def shared_prefill(model, prompt_ids: Tensor, prompt_mask: Tensor) -> dict:
    """The keyword that hands ``generate`` a KV cache of all but the last prompt column, computed once per
    distinct prompt and repeated over its k rows (``{}`` when the rows are not groups of equal prompts, the
    prompt is one column wide, or the model returns no cache).

    ``generate`` then runs only the last prompt column and the decode steps: its sampling (and so its random
    draws) is unchanged, the prefill costs ``N`` rows instead of ``N*k``.
    """
    k = prompt_groups(prompt_ids, prompt_mask)
    if k == 1 or prompt_ids.shape[1] < 2:
        return {}
    cache, _ = prefill_groups(model, prompt_ids[:, :-1], prompt_mask[:, :-1], k)
    return {} if cache is None else {cache_keyword(model): cache}


@contextlib.contextmanager
def _seeded_global_rng(seed: int, device: torch.device) -> Iterator[None]:
    """The global RNG of ``device`` (and the CPU's) seeded with ``seed`` inside, restored after.

    Not ``fork_rng`` + ``torch.manual_seed``: those seed every accelerator type torch knows of, and on
    a machine where CUDA is not initialised each call formats a stack trace (``torch.cuda._lazy_call``), many
    times what seeding the generators in use costs (measured: see ``benchmarks/step_time.md``).
    """
    cpu_state = torch.get_rng_state()
    cuda = device.type == "cuda"
    cuda_state = torch.cuda.get_rng_state(device) if cuda else None
    torch.default_generator.manual_seed(seed)
    if cuda:
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if cuda:
            torch.cuda.set_rng_state(cuda_state, device)
