"""What :class:`~rloo_lightning.engines.vllm_server.VLLMServerEngine` loads into a vLLM server; ``rloo-lightning serve``
passes both to ``vllm serve``:

* :class:`WeightSync`, the worker extension (``--worker-extension-cls``): its methods run on every vLLM worker,
  called by the trainer through ``/collective_rpc`` (vLLM's dev mode). They take strings only (that endpoint passes
  nothing else) and return plain values.
* :class:`GuardEveryPath`, an ASGI middleware (``--middleware``): vLLM's ``--api-key`` guards ``/v1/...`` only, and dev
  mode serves ``/collective_rpc``, ``/pause`` and the weight endpoints to anyone who reaches the port. This one asks
  every path but ``/health`` for the key.

The weights come as a folder of safetensors files that the trainer wrote (on a file system that the trainer's rank 0
and the server both see): the one transfer that works without a GPU, that a restarted server loads again without
the trainer, and whose tensors the worker counts. vLLM's own transfer engines (``/init_weight_transfer_engine``)
need CUDA, and its NCCL communicator does nothing without it: an update would "succeed" and leave the old weights.

Nothing here imports vLLM at import time: the trainer never needs it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
import uuid

from rloo_lightning.engines.vllm_common import API_KEY_ENV

#: This server process's identity: a restarted server has another, so the trainer knows to load its weights again.
BOOT = uuid.uuid4().hex[:12]
#: The tag of this worker's last load, ``"<run>:<sync_id>"`` ("" after a start, or after a load that failed).
LOADED = {"tag": ""}


class WeightSync:
    """Mixed into each vLLM worker (``--worker-extension-cls``); ``reload_weights`` and ``vllm_config`` are the
    worker's own."""

    def rloo_load(self, folder: str, tag: str) -> dict:
        """Load every ``*.safetensors`` file of ``folder`` (names as in the policy's Hugging Face checkpoint) into
        this worker's model, in place, and take ``tag`` (the trainer's name of this sync) as what it holds.

        Returns ``{"version", "boot", "tensors", "bytes", "seconds"}`` (``version``: the tag, under the protocol's
        key, unread by the trainer): the tensors and bytes that reached vLLM's loader (the trainer checks them against
        what it wrote: a load that consumed nothing is an error, not a sync)."""
        from safetensors import safe_open

        start = time.perf_counter()
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors file in {folder}")
        counted = {"tensors": 0, "bytes": 0}

        def weights():
            for name in files:
                with safe_open(os.path.join(folder, name), framework="pt", device="cpu") as f:
                    for key in f.keys():
                        tensor = f.get_tensor(key)
                        counted["tensors"] += 1
                        counted["bytes"] += tensor.numel() * tensor.element_size()
                        yield key, tensor

        LOADED["tag"] = ""  # a load that fails half-way leaves no sync the trainer would trust
        self.reload_weights(weights_iterator=weights())
        LOADED["tag"] = tag
        return {"version": tag, "boot": BOOT, **counted, "seconds": time.perf_counter() - start}

    def rloo_state(self) -> str:
        """``"<boot>:<tag>"``: this server process and the tag of its last :meth:`rloo_load` ("" after a start: the
        weights it was built with)."""
        return f"{BOOT}:{LOADED['tag']}"

    def rloo_describe(self) -> str:
        """JSON of what the trainer checks at connect: the model's architectures, vocabulary size, dtype, hidden size
        and layers, the log-probs it reports, vLLM's version, and the largest LoRA rank it serves (None: none)."""
        import vllm

        config = self.vllm_config.model_config
        hf = config.hf_config
        return json.dumps({
            "architectures": list(getattr(hf, "architectures", None) or []),
            "vocab_size": config.get_vocab_size(),
            "dtype": str(config.dtype).removeprefix("torch."),
            "hidden_size": config.get_hidden_size(),
            "num_hidden_layers": getattr(hf, "num_hidden_layers", None),
            "logprobs_mode": str(config.logprobs_mode),
            "max_model_len": config.max_model_len,
            "vllm_version": vllm.__version__,
            "boot": BOOT,
            "max_lora_rank": getattr(self.vllm_config.lora_config, "max_lora_rank", None),  # None: no LoRA
        })


class GuardEveryPath:
    """ASGI middleware: every HTTP request but ``GET /health`` must carry ``Authorization: Bearer <key>``, the key
    in :data:`~rloo_lightning.engines.vllm_common.API_KEY_ENV` when the server started (none set: the server refuses
    to start)."""

    def __init__(self, app) -> None:
        key = os.environ.get(API_KEY_ENV, "")
        if not key:
            raise RuntimeError(f"GuardEveryPath: set {API_KEY_ENV} (the key every request must carry)")
        self.app, self.digest = app, hashlib.sha256(key.encode()).digest()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or (scope.get("path") == "/health" and scope.get("method") == "GET"):
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self.digest):
            await self.app(scope, receive, send)
            return
        body = b'{"error": "Unauthorized"}'
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
