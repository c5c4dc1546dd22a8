"""``rloo-lightning export``: a Lightning checkpoint of RLOOModule to a Hugging Face model folder.

Every checkpoint the package writes exports: a whole-policy ``.ckpt``, a LoRA one (the adapter; the
base is read from ``model_name_or_path``), a GGUF-loaded policy (written dequantized) and an FSDP2
sharded checkpoint (a folder of ``.distcp`` shards and ``meta.pt``, gathered here on one process).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

__all__ = ["read_checkpoint", "checkpoint_hparams", "module_from_checkpoint", "export_checkpoint", "main"]


def _check_exists(path: Path, option: str = "checkpoint", keys: tuple[str, ...] = ("hyper_parameters",)) -> None:
    """One line naming ``path`` when it does not exist, is truncated or is not a checkpoint (see
    :func:`rloo_lightning.runtime.checkpoint_check.check_checkpoint_path`), before torch reads it. ``keys``: what its
    pickled structure must name (a module checkpoint, with or without Lightning's version: its hyperparameters)."""
    from rloo_lightning.runtime.checkpoint_check import check_checkpoint_path

    check_checkpoint_path(path, option, lightning_values=False, keys=keys)
    if path.is_dir() and not (path / "meta.pt").is_file():
        raise ValueError(f"{path} is a folder but not a sharded checkpoint (no meta.pt)")


def checkpoint_hparams(path: str | Path) -> tuple[dict, dict]:
    """The module's and the data module's hyperparameters stored in a checkpoint file or sharded folder.

    Read without loading the weights (memory-mapped file, or the folder's ``meta.pt``).
    """
    path = Path(path)
    _check_exists(path)
    if path.is_dir():
        meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
    else:
        meta = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    hparams = dict(meta.get("hyper_parameters") or {})
    if "model_name_or_path" not in hparams:
        raise ValueError(f"{path} is not an RLOOModule checkpoint (its hyper_parameters have no model_name_or_path)")
    return hparams, dict(meta.get("datamodule_hyper_parameters") or {})


def read_checkpoint(path: str | Path) -> dict:
    """The checkpoint as one dict (``state_dict``, ``hyper_parameters``, ...); a sharded folder is gathered."""
    path = Path(path)
    _check_exists(path, keys=())  # a plain state dict is read too
    if not path.is_dir():
        return torch.load(path, map_location="cpu", weights_only=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
    with tempfile.TemporaryDirectory() as tmp:
        # One process reads every shard: no process group needed.
        dcp_to_torch_save(path, Path(tmp) / "full.pt")
        checkpoint["state_dict"] = torch.load(Path(tmp) / "full.pt", map_location="cpu",
                                              weights_only=True)["state_dict"]
    return checkpoint


def module_from_checkpoint(path: str | Path, model_name_or_path: str | None = None, lora_export: str | None = None):
    """An :class:`~rloo_lightning.RLOOModule` built from a checkpoint's options, with its trained weights.

    Reward functions are not built (export and inspection need none). ``model_name_or_path`` replaces
    the checkpoint's (the base model moved); ``lora_export`` replaces ``policy.lora_export``.
    """
    from rloo_lightning.module import RLOOModule

    _check_exists(Path(path))  # a module checkpoint: its hyperparameters are needed
    checkpoint = read_checkpoint(path)
    hparams = dict(checkpoint["hyper_parameters"])
    hparams["rewards"] = {**hparams.get("rewards", {}), "funcs": [], "weights": None}
    # No reference copy: export needs the policy alone (the KL coefficient buffer still loads from the state).
    hparams["kl"] = {**hparams.get("kl", {}), "beta": 0.0, "ref_sync_steps": 0}
    hparams["generation_engine"] = None  # nothing is sampled: the training engine (a vLLM child...) is not built
    if model_name_or_path is not None:
        hparams["model_name_or_path"] = model_name_or_path
    if lora_export is not None:
        hparams["policy"] = {**hparams.get("policy", {}), "lora_export": lora_export}
    module = RLOOModule(**hparams)
    module.configure_model()
    checkpoint.pop("rloo_reference", None)
    module.on_load_checkpoint(checkpoint)  # LoRA: the base weights join the adapter's state
    module.load_state_dict(checkpoint["state_dict"])
    return module


def export_checkpoint(ckpt_path: str | Path, output_dir: str | Path, model_name_or_path: str | None = None,
                      lora_export: str | None = None) -> Path:
    """Write the checkpoint's policy and tokenizer to ``output_dir`` (``from_pretrained`` loads it)."""
    output_dir = Path(output_dir)
    if output_dir.exists() and any(output_dir.iterdir()):
        raise FileExistsError(f"output_dir {output_dir} exists and is not empty; choose another folder")
    module = module_from_checkpoint(ckpt_path, model_name_or_path, lora_export)
    module.save_pretrained(str(output_dir))
    return output_dir


def main(argv: list[str]) -> None:
    """``rloo-lightning export --ckpt_path X [--output_dir Y]``."""
    parser = argparse.ArgumentParser(
        prog="rloo-lightning export",
        description="Write a checkpoint's policy and tokenizer as a Hugging Face model folder "
                    "(AutoModelForCausalLM.from_pretrained loads it).")
    parser.add_argument("--ckpt_path", required=True,
                        help="a .ckpt file, or an FSDP2 sharded-checkpoint folder (with meta.pt)")
    parser.add_argument("--output_dir", default=None,
                        help="where to write (default: <checkpoint's folder>/<checkpoint name>-hf); must be "
                             "empty or absent")
    parser.add_argument("--model_name_or_path", default=None,
                        help="the base model, if it moved since training (default: the checkpoint's)")
    parser.add_argument("--lora_export", choices=["merged", "adapter"], default=None,
                        help="a LoRA policy: merged into the base, or the adapter alone (default: the checkpoint's "
                             "policy.lora_export)")
    args = parser.parse_args(argv)
    ckpt = Path(args.ckpt_path)
    _check_exists(ckpt, "--ckpt_path")
    output_dir = Path(args.output_dir) if args.output_dir else ckpt.parent / f"{ckpt.stem}-hf"
    written = export_checkpoint(ckpt, output_dir, args.model_name_or_path, args.lora_export)
    print(f"exported {ckpt} -> {written.resolve()}")
