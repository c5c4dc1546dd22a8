"""A reduced-precision copy of the policy as the engine (:class:`ReducedPrecisionEngine`: bf16 / fp16 / int8,
refreshed after every optimizer step). It samples from pi_s != pi_theta, so it reports log pi_s of what it sampled:
the module logs ``train/mismatch/*`` and, with ``model.correction.level``, corrects the estimator for it.
"""

from __future__ import annotations

import copy
from typing import Literal

import torch

from rloo_lightning.engines.base import GenerationEngine
from rloo_lightning.engines.hf_generate import HFGenerateEngine
from rloo_lightning.runtime import framework

__all__ = ["ReducedPrecisionEngine", "cpu_supports_bf16"]


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_supports_bf16() -> bool:
    """Whether this CPU has native bf16 arithmetic (AVX512-BF16 or AMX): elsewhere bf16 is emulated, and slow."""
    try:
        return framework.mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


class ReducedPrecisionEngine(GenerationEngine):
    """Samples from a reduced-precision copy of the policy, refreshed after every optimizer step.

    The copy is ``bfloat16`` / ``float16`` (weights and activations) or ``int8`` (int8 weights,
    activations in the policy's dtype, through ``torchao``'s weight-only quantization). It is made at
    the first rollout and refreshed lazily at the rollout after each optimizer step (the module calls
    :meth:`on_weights_updated`), so gradient accumulation costs one refresh per step. It samples
    with the policy's own ``generate`` (KV cache, the module's explicit generation config) and
    returns ``(ids, log pi_s)``: the log-probabilities of the copy's processed logits, the
    distribution it actually sampled from.

    Args:
        dtype: ``bfloat16`` (checked at setup: a CPU without native bf16 is refused, since emulated
            bf16 is slower than fp32), ``float16`` (GPU) or ``int8`` (needs ``torchao``).

    Memory: one extra copy of the weights at the reduced precision. A policy sharded by FSDP2 /
    FSDP / ZeRO-3 is refused (each rank would need the whole copy).
    """

    def __init__(self, dtype: Literal["bfloat16", "float16", "int8"] = "bfloat16") -> None:
        if dtype not in (*DTYPES, "int8"):
            raise ValueError(f"ReducedPrecisionEngine dtype must be one of {[*DTYPES, 'int8']}, got {dtype!r}")
        self.dtype = dtype
        self.copy: torch.nn.Module | None = None
        self.stale = True
        self.refreshes = 0
        self._sampler = HFGenerateEngine(return_logprobs=True)

    reports_logprobs = True

    def check(self, device: torch.device) -> None:
        if self.dtype == "bfloat16" and device.type == "cpu" and not cpu_supports_bf16():
            raise RuntimeError("generation_engine ReducedPrecisionEngine(dtype=bfloat16): this CPU has no native "
                               "bf16 (AVX512-BF16 / AMX); emulated bf16 is slower than fp32. Use dtype int8 or "
                               "the default engine")
        if self.dtype == "float16" and device.type == "cpu":
            raise RuntimeError("generation_engine ReducedPrecisionEngine(dtype=float16) is for GPUs; on a CPU use "
                               "bfloat16 or int8")
        if self.dtype == "int8":
            try:
                import torchao  # noqa: F401
            except ImportError as err:
                raise ImportError("ReducedPrecisionEngine(dtype=int8) needs torchao: pip install torchao") from err

    def on_weights_updated(self, model) -> None:
        self.stale = True

    def refresh(self, model: torch.nn.Module) -> torch.nn.Module:
        """The reduced-precision copy of ``model``'s current weights (made or updated in place)."""
        if any(hasattr(p, "full_tensor") for p in model.parameters()):
            raise ValueError("ReducedPrecisionEngine does not support a sharded (FSDP2 / FSDP / ZeRO-3) policy")
        # Normal tensors, whatever grad mode the module generates in: the copy is reused across rollouts.
        with torch.inference_mode(False), torch.no_grad():
            if self.copy is not None and self.dtype in DTYPES:
                for target, source in zip(self.copy.state_dict().values(), model.state_dict().values()):
                    target.copy_(source)  # cast to the copy's dtype
            else:  # first use, or int8 (quantized weights are rebuilt from the fp weights)
                self.copy = self._build(model)
        self.stale = False
        self.refreshes += 1
        return self.copy

    def _build(self, model: torch.nn.Module) -> torch.nn.Module:
        fresh = copy.deepcopy(model).eval().requires_grad_(False)
        if self.dtype in DTYPES:
            return fresh.to(DTYPES[self.dtype])
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(fresh, Int8WeightOnlyConfig())
        return fresh

    def generate(self, model, tokenizer, prompt_ids, prompt_mask, generation_config, seed):
        sampler = self.refresh(model) if self.stale or self.copy is None else self.copy
        return self._sampler.generate(sampler, tokenizer, prompt_ids, prompt_mask, generation_config, seed)
