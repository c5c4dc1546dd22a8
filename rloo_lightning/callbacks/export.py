"""Export the policy in Hugging Face format."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer

__all__ = ["HFExport"]


class HFExport(Callback):
    """``save_pretrained`` of the policy and tokenizer at the end of fit (optionally at each checkpoint).

    The folder loads with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``
    and carries the model's own shipped generation config, not the training sampler's.

    Args:
        dirpath: where to write; default ``<trainer.log_dir>/hf_model``. With ``on_checkpoint``,
            each checkpoint's export goes to ``<dirpath>/step-<global step>``.
        on_checkpoint: also export whenever a Lightning checkpoint is saved.
    """

    def __init__(self, dirpath: str | None = None, on_checkpoint: bool = False) -> None:
        self.dirpath = dirpath
        self.on_checkpoint = on_checkpoint

    def export_dir(self, trainer: Trainer) -> Path:
        return Path(self.dirpath) if self.dirpath else Path(trainer.log_dir or trainer.default_root_dir) / "hf_model"

    # Both run on every rank: trainer.log_dir is a broadcast, and under FSDP2 save_pretrained gathers
    # the weights (collectives that rank 0 alone would hang in); save_pretrained writes on rank 0 only.
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        if self.on_checkpoint:
            pl_module.save_pretrained(str(self.export_dir(trainer) / f"step-{trainer.global_step}"))

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pl_module.save_pretrained(str(self.export_dir(trainer)))
