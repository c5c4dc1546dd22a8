"""Tiny offline models, built in code: a character-level tokenizer, a tiny Llama, and their cache.

The embedded tasks (:mod:`rloo_lightning.tasks`) build their ``tiny:<task>`` models with these and
cache them under :func:`cache_dir`; the tests build throwaway models with them. Nothing here
downloads anything. Also importable from :mod:`rloo_lightning.models`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

__all__ = ["cache_dir", "build_char_tokenizer", "build_tiny_llama"]


def cache_dir() -> Path:
    """Where built tiny models live: ``$RLOO_LIGHTNING_CACHE`` or ``~/.cache/rloo_lightning``."""
    return Path(os.environ.get("RLOO_LIGHTNING_CACHE", Path.home() / ".cache" / "rloo_lightning"))


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
