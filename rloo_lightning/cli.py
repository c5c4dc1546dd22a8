"""The ``rloo-lightning`` command: a LightningCLI over RLOOModule and PromptDataModule."""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

from rloo_lightning.config import RENAMED
from rloo_lightning.data import PromptDataModule
from rloo_lightning.importpath import add_cwd_to_sys_path
from rloo_lightning.module import RLOOModule

__all__ = ["RLOOCLI", "main"]


class RLOOCLI(LightningCLI):
    """LightningCLI with the data module's tokenizer and budgets linked to the model's options."""

    def add_arguments_to_parser(self, parser) -> None:
        # One source of truth: the prompts are tokenized by the policy's tokenizer, and their
        # lengths are checked against the policy's context and completion budget.
        parser.link_arguments("model.model_name_or_path", "data.tokenizer_name_or_path")
        parser.link_arguments("model.sampling.max_new_tokens", "data.max_new_tokens")
        parser.link_arguments("model.policy.trust_remote_code", "data.trust_remote_code")
        parser.link_arguments("model.policy.gguf_file", "data.gguf_file")
        # Rollout reuse: the data repeats each batch for the updates made on its rollout.
        parser.link_arguments("model.update.updates_per_rollout", "data.repeat_batches")


def _renamed_options(args: list[str]) -> list[str]:
    """Old flat module options in ``args``: ``--model.beta``, or ``model: {beta: ...}`` in a ``--config`` file."""
    found = []
    for i, arg in enumerate(args):
        name = arg[len("--model."):].split("=", 1)[0] if arg.startswith("--model.") else None
        if name in RENAMED:
            found.append(name)
        if arg == "--config" and i + 1 < len(args) or arg.startswith("--config="):
            path = Path(arg.split("=", 1)[1] if "=" in arg else args[i + 1])
            if path.is_file():
                import yaml

                try:
                    model = (yaml.safe_load(path.read_text()) or {}).get("model")
                except yaml.YAMLError:
                    continue  # jsonargparse reports it
                found += [key for key in model or {} if isinstance(model, dict) and key in RENAMED]
    return found


def main(args: list[str] | None = None) -> None:
    """Entry point of ``rloo-lightning`` and ``python -m rloo_lightning``."""
    # Reward functions and class_path values in the working directory (myreward.py next to the
    # data) are importable; appended, so a user's datasets.py cannot shadow a dependency. DDP ranks
    # re-run this command, so they get it too; reward workers get the parent's directory.
    add_cwd_to_sys_path()
    renamed = _renamed_options(sys.argv[1:] if args is None else args)
    if renamed:
        lines = "\n".join(f"  model.{name} -> model.{RENAMED[name]}" for name in renamed)
        sys.exit(f"error: RLOOModule's options are grouped now; rename:\n{lines}")
    RLOOCLI(RLOOModule, PromptDataModule, save_config_kwargs={"overwrite": True}, args=args)
