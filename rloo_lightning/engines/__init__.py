"""Generation engines: what samples the completions of a rollout.

- :class:`GenerationEngine` (``base.py``): the contract (prompts in, token ids and optionally log pi_s out), and
  how a checkpoint names an engine and builds it again (:func:`engine_spec`, :func:`build_engine`).
- :class:`DecodeLoopEngine` (``decode.py``): the default, a decode loop over the policy's KV cache (pi_theta).
- :class:`HFGenerateEngine` (``hf_generate.py``): the policy's own ``generate`` (every sampling option transformers
  has; pi_theta).
- :class:`ReducedPrecisionEngine` (``reduced_precision.py``): a bf16 / fp16 / int8 copy of the policy (pi_s).
- ``VLLMEngine`` (``vllm.py``; its child process in ``vllm_process.py``, the trainer's side, and ``vllm_child.py``, the
  child's): vLLM, colocated. ``VLLMServerEngine`` (``vllm_server.py``; its HTTP client ``vllm_http.py``, its sync's
  pieces ``vllm_sync.py``, what the server loads ``vllm_server_side.py``): vLLM servers. What both share is
  ``vllm_common.py``. Not re-exported here: their modules are their paths, and importing this package never imports
  vLLM.
"""

from rloo_lightning.engines.base import GenerationEngine, Submitted, build_engine, engine_class, engine_spec
from rloo_lightning.engines.decode import DecodeLoopEngine
from rloo_lightning.engines.hf_generate import HFGenerateEngine, generates_synced, prompt_groups, shared_prefill
from rloo_lightning.engines.reduced_precision import ReducedPrecisionEngine, cpu_supports_bf16

__all__ = ["DecodeLoopEngine", "GenerationEngine", "HFGenerateEngine", "ReducedPrecisionEngine", "Submitted",
           "build_engine", "cpu_supports_bf16", "engine_class", "engine_spec", "generates_synced", "prompt_groups",
           "shared_prefill"]
