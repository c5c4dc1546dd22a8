"""A LoRA policy's adapter for vLLM: what both vLLM engines need to sync the adapter alone (``lora_sync: adapter``).

vLLM serves a base model and loads LoRA adapters beside it from folders in PEFT's format (``adapter_config.json``,
``adapter_model.safetensors``); a request names the adapter it samples with. So a LoRA policy's base is loaded once
(its weights never change in training: peft freezes them) and each sync writes and loads the adapter's tensors only:
for a rank-16 adapter on every projection of SmolLM2-135M 18.6 MiB against 621 MiB (fp32), of a 7B model 81 MB
(bf16) against 15 GB. Each sync is a new adapter under a new name and id (vLLM caches an adapter by its id and its
prefix cache keys blocks by the adapter's name and path: a version loaded under an old name would sample from the
old weights or reuse their blocks); on a server, which outlives a run, the name carries the run too. A base reload
empties vLLM's adapter cache (vLLM 0.32 ``reload_weights``) but not a server's registry of names and folders, from
which it loads a named adapter again: the engines load the base first, unload what the server lists, then load the
adapter.

What vLLM refuses in an adapter (DoRA, ``modules_to_save``, trained biases, ranks over 512) is refused here, before
training, in one line naming the option (:func:`check_adapter_sync`); ``lora_sync: merged`` syncs such a policy
merged into full weights, as every policy was before.
"""

from __future__ import annotations

import os
import re
import shutil

from torch import Tensor

from rloo_lightning.engines.kv_cache import base_model

__all__ = ["LORA_RANKS", "adapter_name", "adapter_tensors", "check_adapter_sync", "is_lora_policy", "lora_rank",
           "write_adapter_folder"]

#: The ``max_lora_rank`` values vLLM (0.32) accepts; an adapter's rank must be at most the one chosen.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

_LORA_KEY = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B)\.([^.]+)")


def is_lora_policy(model) -> bool:
    """Whether ``model`` is a peft model with a LoRA adapter (the ``policy.lora`` option)."""
    config = getattr(model, "peft_config", None)
    return bool(config) and any(str(getattr(c, "peft_type", "")).endswith("LORA") for c in config.values())


def _config(model):
    return model.peft_config[model.active_adapter]


def lora_rank(model) -> int:
    """The ``max_lora_rank`` vLLM needs for the policy's adapter: the smallest of :data:`LORA_RANKS` that holds its
    largest rank (``r`` and any ``rank_pattern``)."""
    config = _config(model)
    rank = max([config.r, *(config.rank_pattern or {}).values()])
    return next((r for r in LORA_RANKS if r >= rank), rank)


def check_adapter_sync(model, engine: str) -> None:
    """Refuse, in one line naming the option, a LoRA policy whose adapter vLLM cannot load (before training)."""
    if len(getattr(model, "peft_config", {})) != 1:
        raise ValueError(f"{engine} lora_sync=adapter syncs one LoRA adapter; the policy has "
                         f"{sorted(model.peft_config)}: use lora_sync: merged")
    config = _config(model)
    refused = []
    if getattr(config, "use_dora", False):
        refused.append("policy.lora.use_dora (vLLM does not serve DoRA)")
    if getattr(config, "modules_to_save", None):
        refused.append(f"policy.lora.modules_to_save={sorted(config.modules_to_save)} (vLLM loads LoRA weights only)")
    if getattr(config, "bias", "none") != "none" or getattr(config, "lora_bias", False):
        refused.append("trained biases (policy.lora.bias / lora_bias; vLLM loads no adapter bias)")
    if getattr(config, "layer_replication", None):
        refused.append("policy.lora.layer_replication")
    rank = max([config.r, *(config.rank_pattern or {}).values()])
    if rank > LORA_RANKS[-1]:
        refused.append(f"rank {rank} (vLLM serves at most {LORA_RANKS[-1]})")
    if refused:
        raise ValueError(f"{engine} lora_sync=adapter: vLLM cannot serve this adapter: {'; '.join(refused)}. Set "
                         f"the engine's lora_sync: merged (full weights at every sync)")


def adapter_tensors(model) -> dict[str, Tensor]:
    """The active adapter's tensors on the CPU under the names of PEFT's ``adapter_model.safetensors``
    (``base_model.model.<module>.lora_A.weight``: the adapter's own name left out), whole (an FSDP2 shard is
    gathered: a collective, so every rank calls this at the same point)."""
    out = {}
    for name, tensor in base_model(model).state_dict().items():
        match = _LORA_KEY.search(name)
        if match is None or match.group(2) != model.active_adapter:
            continue
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        key = "base_model.model." + name[:match.start()] + f".{match.group(1)}" + name[match.end():]
        out[key] = tensor.detach().to("cpu").contiguous().clone()
    return out


def adapter_name(version: int, run: str = "") -> str:
    """The name an adapter version is loaded under: new at every sync (see the module docstring) and, on a server
    that outlives a run, new for every run (``run``: another run's name left in the server's registry would answer
    "already loaded" for an adapter whose folder may be gone)."""
    return f"rloo-{run}-adapter-{version}" if run else f"rloo-adapter-{version}"


def write_adapter_folder(folder: str, model, tensors: dict[str, Tensor]) -> int:
    """Write the adapter (``tensors``, from :func:`adapter_tensors`) and its config into ``folder`` atomically (a
    partial folder is never named); the bytes written."""
    from safetensors.torch import save_file

    partial = folder + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    _config(model).save_pretrained(partial)
    save_file(tensors, os.path.join(partial, "adapter_model.safetensors"))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)
    return sum(t.numel() * t.element_size() for t in tensors.values())
