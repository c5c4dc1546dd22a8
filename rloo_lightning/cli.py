"""The ``rloo-lightning`` command: a LightningCLI over RLOOModule and PromptDataModule."""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

from rloo_lightning.data import PromptDataModule
from rloo_lightning.module import RLOOModule

__all__ = ["RLOOCLI", "main"]


class RLOOCLI(LightningCLI):
    """LightningCLI with the data module's tokenizer and budgets linked to the model's options."""

    def add_arguments_to_parser(self, parser) -> None:
        # One source of truth: the prompts are tokenized by the policy's tokenizer, and their
        # lengths are checked against the policy's context and completion budget.
        parser.link_arguments("model.model_name_or_path", "data.tokenizer_name_or_path")
        parser.link_arguments("model.max_new_tokens", "data.max_new_tokens")
        parser.link_arguments("model.trust_remote_code", "data.trust_remote_code")
        parser.link_arguments("model.gguf_file", "data.gguf_file")
        # Rollout reuse: the data repeats each batch for the updates made on its rollout.
        parser.link_arguments("model.updates_per_rollout", "data.repeat_batches")


def main(args: list[str] | None = None) -> None:
    """Entry point of ``rloo-lightning`` and ``python -m rloo_lightning``."""
    RLOOCLI(
        RLOOModule,
        PromptDataModule,
        save_config_kwargs={"overwrite": True},
        args=args,
    )
