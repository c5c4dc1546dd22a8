"""Split into :mod:`rloo_lightning.algo.logprobs` (the pure tensor functions), :mod:`rloo_lightning.forward` (running
the model on a rollout) and :mod:`rloo_lightning.engines.kv_cache` (the Hugging Face KV-cache plumbing); this path
will be removed."""
from rloo_lightning._moved import moved

_FORWARD = ("completion_logits", "can_share_prompt", "shared_prompt_logits", "worth_sharing", "sequence_logprobs",
            "SHARE_MIN_WORK")
_KV_CACHE = ("cache_keyword", "returned_cache", "prefill_groups")

__getattr__ = moved(__name__, "rloo_lightning.algo.logprobs",
                    {**dict.fromkeys(_FORWARD, "rloo_lightning.forward"),
                     **dict.fromkeys(_KV_CACHE, "rloo_lightning.engines.kv_cache")})
