"""PromptDataModule: load prompts, tokenize, check lengths, left-pad collate."""

from __future__ import annotations

import json
import random
from functools import partial
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from rloo_lightning.models import context_length, load_tokenizer

__all__ = ["PromptDataModule", "collate_prompts"]


class PromptDataModule(LightningDataModule):
    """Prompts for RLOO from an embedded task or a local json/jsonl file.

    Each row has a prompt column; every other column is passed, per completion, to the reward
    functions (e.g. a reference ``answer``). The tokenizer is the policy's (the CLI links
    ``model.model_name_or_path`` here), so prompt lengths are checked against the model's
    context before any compute is spent.

    Args:
        tokenizer_name_or_path: the policy's tokenizer (linked by the CLI).
        task: an embedded task name (e.g. ``reverse``); exclusive with ``train_file``.
        train_file: a local ``.jsonl`` (one object per line) or ``.json`` (a list of objects).
        val_file: held-out prompts; without it, ``val_size`` rows of the train file are held out.
        prompt_column: the column holding the prompt text.
        batch_size: prompts per rollout per device (each sampled k times).
        val_batch_size: prompts per validation batch (default: ``batch_size``).
        val_size: held-out fraction (< 1) or count (>= 1) when there is no ``val_file``.
        num_train_rows, num_val_rows: sizes of an embedded task's generated splits.
        seed: seeds the task's generation, the split and the shuffling.
        max_new_tokens: completion budget (linked from the module), checked with the prompt
            length against the model's context.
        trust_remote_code: executes code shipped with the tokenizer; off unless set.
    """

    def __init__(
        self,
        tokenizer_name_or_path: str = "",
        task: str | None = None,
        train_file: str | None = None,
        val_file: str | None = None,
        prompt_column: str = "prompt",
        batch_size: int = 8,
        val_batch_size: int | None = None,
        val_size: float = 0.1,
        num_train_rows: int = 4000,
        num_val_rows: int = 200,
        seed: int = 0,
        max_new_tokens: int = 0,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        if (task is None) == (train_file is None):
            raise ValueError("PromptDataModule: give exactly one of `task` (embedded) or `train_file`")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.save_hyperparameters()
        self.tokenizer = None
        self.train_rows: list[dict] = []
        self.val_rows: list[dict] = []

    # -- loading -------------------------------------------------------------------------------
    def _read_file(self, path: str) -> list[dict]:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"data file {path!r} does not exist")
        if p.suffix == ".jsonl":
            rows = []
            for line_no, line in enumerate(p.read_text().splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}: line {line_no} is not valid JSON: {err}") from err
        elif p.suffix == ".json":
            rows = json.loads(p.read_text())
            if isinstance(rows, dict):
                raise ValueError(f"{path}: expected a list of objects, got an object")
        else:
            raise ValueError(f"{path}: unsupported extension {p.suffix!r}; use .jsonl or .json")
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise ValueError(f"{path}: row {i} is {type(row).__name__}, expected an object")
        return rows

    def _load_rows(self) -> tuple[list[dict], list[dict], str]:
        hp = self.hparams
        if hp.task is not None:
            from rloo_lightning.tasks import get_task

            make_rows = get_task(hp.task).make_rows
            train = make_rows(hp.num_train_rows, hp.seed)
            held = {r[hp.prompt_column] for r in train}
            # Held-out means held out: drop validation prompts that also occur in training.
            val = [r for r in make_rows(hp.num_val_rows, hp.seed + 1) if r[hp.prompt_column] not in held]
            return train, val, f"task {hp.task!r}"
        train = self._read_file(hp.train_file)
        if hp.val_file is not None:
            return train, self._read_file(hp.val_file), hp.train_file
        order = list(range(len(train)))
        random.Random(hp.seed).shuffle(order)
        n_val = int(round(hp.val_size * len(train))) if hp.val_size < 1 else int(hp.val_size)
        val_idx = set(order[:n_val])
        return ([r for i, r in enumerate(train) if i not in val_idx],
                [r for i, r in enumerate(train) if i in val_idx], hp.train_file)

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is not None:
            return
        hp = self.hparams
        train, val, source = self._load_rows()
        if len(train) < hp.batch_size:
            raise ValueError(
                f"{source}: the training set has {len(train)} rows, fewer than batch_size={hp.batch_size}"
            )
        self.tokenizer = load_tokenizer(hp.tokenizer_name_or_path, trust_remote_code=hp.trust_remote_code)
        limit = context_length(hp.tokenizer_name_or_path, trust_remote_code=hp.trust_remote_code)
        self.train_rows = self._tokenize(train, source, "train", limit)
        self.val_rows = self._tokenize(val, source, "validation", limit)

    def _tokenize(self, rows: list[dict], source: str, split: str, limit: int | None) -> list[dict]:
        col = self.hparams.prompt_column
        out = []
        for i, row in enumerate(rows):
            if col not in row:
                raise ValueError(
                    f"{source} ({split} row {i}): no prompt column {col!r}; columns are {sorted(row)}. "
                    "Set `prompt_column`."
                )
            if not isinstance(row[col], str) or not row[col]:
                raise ValueError(f"{source} ({split} row {i}): prompt column {col!r} must be a non-empty string")
            ids = self.tokenizer(row[col], add_special_tokens=True)["input_ids"]
            if limit is not None and len(ids) + self.hparams.max_new_tokens > limit:
                raise ValueError(
                    f"{source} ({split} row {i}): prompt of {len(ids)} tokens + max_new_tokens="
                    f"{self.hparams.max_new_tokens} exceeds the model's context of {limit} tokens"
                )
            out.append({"input_ids": ids, "prompt": row[col],
                        "columns": {c: v for c, v in row.items() if c != col}})
        return out

    # -- loaders -------------------------------------------------------------------------------
    def _loader(self, rows: list[dict], batch_size: int, train: bool) -> DataLoader:
        generator = torch.Generator().manual_seed(self.hparams.seed) if train else None
        # drop_last in training: every rollout has batch_size prompts, so steps are alike.
        return DataLoader(rows, batch_size=batch_size, shuffle=train, drop_last=train, generator=generator,
                          collate_fn=partial(collate_prompts, pad_token_id=self.tokenizer.pad_token_id))

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_rows, self.hparams.batch_size, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_rows, self.hparams.val_batch_size or self.hparams.batch_size, train=False)


def collate_prompts(rows: list[dict], pad_token_id: int) -> dict:
    """Left-pad prompts (generation appends on the right).

    Returns:
        ``input_ids`` / ``attention_mask`` ``[N, P]``, ``prompt`` (N strings) and ``columns``
        (``{name: N values}``; a column missing from a row is None there).
    """
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, width - n :] = torch.tensor(r["input_ids"])
        mask[i, width - n :] = 1
    names = sorted({c for r in rows for c in r["columns"]})
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "prompt": [r["prompt"] for r in rows],
        "columns": {c: [r["columns"].get(c) for r in rows] for c in names},
    }
