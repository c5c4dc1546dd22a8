"""What the two vLLM engines and ``rloo-lightning serve`` share: the colocated
:class:`~rloo_lightning.engines.vllm.VLLMEngine`, the server engine
:class:`~rloo_lightning.engines.vllm_server.VLLMServerEngine` and :mod:`rloo_lightning.serve`.

- the refusals at setup (:func:`refuse_repetition_penalty`) and the policy's description as vLLM reads it
  (:func:`architectures`, :func:`dtype_name`, :func:`unquantized_config`);
- the request: prompts without their padding (:func:`unpadded_prompts`), vLLM's sampling keywords for the module's
  generation config (:func:`sampling_params`), each row's seed (:func:`row_seeds`);
- the answer: rows of token ids and log-probs as padded tensors (:func:`padded_samples`, :func:`pad_id`);
- the weights as vLLM loads them (:func:`named_weights`, LoRA merged by :func:`lora_deltas`);
- the environment a child process or a server is started with (:func:`scoped_environ`, :data:`API_KEY_ENV`).

Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator

import torch
from torch import Tensor

from rloo_lightning.engines.kv_cache import base_model

__all__ = ["API_KEY_ENV", "architectures", "completion_fields", "dtype_name", "lora_deltas", "named_weights", "pad_id",
           "padded_samples", "prompt_group_index", "refuse_repetition_penalty", "row_seeds", "sampling_params",
           "scoped_environ", "unpadded_prompts", "unquantized_config"]

#: The environment variable the servers' key is read from: by the server (its middleware, and vLLM's own ``/v1``
#: guard), by ``rloo-lightning serve``, and by the trainer (``VLLMServerEngine``'s ``api_key_env`` default).
API_KEY_ENV = "VLLM_API_KEY"


# -- setup ---------------------------------------------------------------------------------------
def refuse_repetition_penalty(generation_config, engine: str) -> None:
    """Raise when the module samples with a repetition penalty: vLLM's is not transformers' (``engine``: the class
    name the message gives)."""
    if generation_config.repetition_penalty not in (None, 1.0):
        raise ValueError(f"{engine} does not apply sampling.repetition_penalty as transformers does; set it to 1.0 "
                         "or use the default engine")


def architectures(model) -> list[str]:
    """The architectures vLLM builds the policy as: its config's, or the class of its base model."""
    base = base_model(model)
    return list(getattr(base.config, "architectures", None) or [type(base).__name__])


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as vLLM names it (``torch.bfloat16``: ``bfloat16``)."""
    return str(dtype).removeprefix("torch.")


def unquantized_config(config):
    """A copy of a transformers config without its quantization: the weights vLLM gets are the policy's, dequantized
    (a GGUF file is dequantized at load), so vLLM must not look for the checkpoint's quantization."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


# -- the request and its answer ------------------------------------------------------------------
def unpadded_prompts(prompt_ids: Tensor, prompt_mask: Tensor) -> list[list[int]]:
    """Each prompt's token ids, without its padding."""
    return [row[m.bool()].tolist() for row, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]


def sampling_params(config) -> dict:
    """vLLM ``SamplingParams`` keywords for a transformers ``GenerationConfig`` (the module's)."""
    eos = config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    greedy = not config.do_sample
    return dict(temperature=0.0 if greedy else float(config.temperature),
                top_k=-1 if greedy or not config.top_k else int(config.top_k),
                top_p=1.0 if greedy or config.top_p is None else float(config.top_p),
                # ignore_eos: vLLM would also stop at the EOS of the model's config; the module's EOS ids decide
                max_tokens=int(config.max_new_tokens), stop_token_ids=eos, ignore_eos=True, logprobs=0,
                detokenize=False)


def completion_fields(config) -> dict:
    """The server engine's completions request fields for the module's generation config (the sampling of
    ``VLLMEngine``, token ids back)."""
    params = sampling_params(config)
    params.pop("detokenize")
    return {**params, "return_token_ids": True, "skip_special_tokens": False}


def prompt_group_index(prompts: list[list[int]]) -> list[int]:
    """Each row's prompt group: runs of equal consecutive prompts (a rollout's k copies) share one."""
    groups, g = [], -1
    for i, prompt in enumerate(prompts):
        if i == 0 or prompt != prompts[i - 1]:
            g += 1
        groups.append(g)
    return groups


def row_seeds(seed: int, rows: int) -> list[int]:
    """Each row's own sampling seed, from the step's ``seed`` (the same on every run and every engine of vLLM)."""
    return [(seed + 0x9E3779B97F4A7C15 * (i + 1)) % 2**63 for i in range(rows)]


def pad_id(generation_config) -> int:
    """The id completions are right-padded with: the config's pad id, else 0 (the module's mask ends every completion
    at its first EOS, so the id after it is never read)."""
    return generation_config.pad_token_id if generation_config.pad_token_id is not None else 0


def padded_samples(samples: list, pad: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``[(token ids, log-probs)]`` per row as ``(ids [B, T'], logprobs [B, T'])`` on ``device``: right-padded with
    ``pad`` (log-prob 0), ``T'`` the longest row (at least 1)."""
    width = max(1, max((len(ids) for ids, _ in samples), default=0))
    ids = torch.full((len(samples), width), pad, dtype=torch.long)
    logp = torch.zeros(len(samples), width)
    for i, (row_ids, row_logp) in enumerate(samples):
        ids[i, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
        logp[i, : len(row_logp)] = torch.tensor(row_logp)
    return ids.to(device), logp.to(device)


# -- the weights ---------------------------------------------------------------------------------
def named_weights(model, merged: bool = True) -> Iterator[tuple[str, Tensor]]:
    """The policy's weights under the names of its Hugging Face checkpoint, whole (an FSDP2 / FSDP shard is
    gathered: a collective, so every rank calls this at the same point) and, under LoRA, with each adapter's delta
    merged in (computed, the policy is left as it is) unless ``merged`` is False (the base alone)."""
    base = base_model(model)
    deltas = lora_deltas(model) if merged else {}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name or "lora_embedding" in name:
            continue
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        key = name.replace(".base_layer.", ".")
        if key in deltas:
            tensor = tensor + deltas[key].to(tensor.dtype)
        yield key, tensor.detach()


def lora_deltas(model) -> dict[str, Tensor]:
    """``{weight name: delta}`` of each active LoRA adapter of a peft model (empty otherwise)."""
    if not hasattr(model, "peft_config"):
        return {}
    from peft.tuners.lora import LoraLayer

    base = base_model(model)
    deltas: dict[str, Tensor] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and not getattr(module, "disable_adapters", False):
            for adapter in module.active_adapters:
                if adapter in getattr(module, "lora_A", {}):
                    key = f"{name}.weight"
                    delta = module.get_delta_weight(adapter)
                    deltas[key] = deltas[key] + delta if key in deltas else delta
    return deltas


# -- processes -----------------------------------------------------------------------------------
@contextlib.contextmanager
def scoped_environ(values: dict[str, str], drop: tuple[str, ...] = ()) -> Iterator[None]:
    """``os.environ`` with ``values`` set and the variables in ``drop`` removed, restored as it was on exit (what a
    process started inside inherits)."""
    saved = {k: os.environ.get(k) for k in (*values, *drop)}
    os.environ.update(values)
    for k in drop:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
