"""Models: loading by name (:mod:`.loading`), the tiny offline models (:mod:`.tiny`), the policy and its reference
(:mod:`.policy`), and sharded training (:mod:`.sharding`).

The names of the former ``rloo_lightning/models.py`` module (loading and the tiny-model builders) are re-exported
here, so ``rloo_lightning.models.load_causal_lm`` and the like keep working.
"""

from rloo_lightning.models.loading import (
    PACKAGE_PREFIX,
    TINY_PREFIX,
    TOKENIZER_FILES,
    config_context,
    context_length,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
)
from rloo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama, cache_dir

__all__ = [
    # loading
    "PACKAGE_PREFIX", "TINY_PREFIX", "TOKENIZER_FILES", "config_context", "context_length", "load_causal_lm",
    "load_tokenizer", "resolve_model_path",
    # the tiny offline models
    "build_char_tokenizer", "build_tiny_llama", "cache_dir",
]
