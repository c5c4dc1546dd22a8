"""PromptDataModule: load prompts, apply the chat template, tokenize, check lengths, left-pad collate."""

from __future__ import annotations

import json
import random
from functools import partial
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler

from rloo_lightning.models import context_length, load_tokenizer

__all__ = ["PromptDataModule", "ResumableDataLoader", "ResumableSampler", "collate_prompts", "read_rows"]

SMALL_VALIDATION = 8  # fewer validation prompts than this: a warning (val/reward is too noisy to compare)
DEFAULT_VAL_SIZE, DEFAULT_TRAIN_ROWS, DEFAULT_VAL_ROWS = 0.1, 4000, 200

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


def _read_json(path: Path) -> list[dict]:
    """Rows of a ``.jsonl`` (one object per line) or ``.json`` (a list of objects) file."""
    if path.suffix == ".jsonl":
        rows = []
        for line_no, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}: line {line_no} is not valid JSON: {err}") from err
        return rows
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err}); expected a list of objects, or use .jsonl") from err
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a list of objects, got {type(rows).__name__}")
    return rows


def _read_with_datasets(path: Path) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(FILE_FORMATS[path.suffix], data_files=str(path), split="train")
    except Exception as err:  # pyarrow/pandas raise many types; name the file in one clear error
        raise ValueError(f"{path}: cannot be read as {path.suffix[1:]}: {err}") from err
    return ds.to_list()


def read_rows(source: str, split: str = "train", dataset_config: str | None = None) -> list[tuple[str, dict]]:
    """Rows of a local file, a local folder of files, or a ``datasets.load_dataset`` name.

    Returns ``(where, row)`` pairs; ``where`` names the file and row (``"data.jsonl row 3"``) for
    error messages. Local formats: .jsonl, .json, .csv, .parquet, .arrow.
    """
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in FILE_FORMATS and p.is_file())
        if not files:
            raise ValueError(f"{source}: folder has no {'/'.join(FILE_FORMATS)} files")
        return [pair for f in files for pair in read_rows(str(f))]
    if path.is_file():
        if path.suffix not in FILE_FORMATS:
            raise ValueError(f"{source}: unsupported extension {path.suffix!r}; use one of {list(FILE_FORMATS)}")
        rows = _read_json(path) if FILE_FORMATS[path.suffix] == "json" else _read_with_datasets(path)
        out = []
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise ValueError(f"{source} row {i}: is {type(row).__name__}, expected an object")
            out.append((f"{source} row {i}", row))
        return out
    if source.startswith((".", "/", "~")) or Path(source).suffix in FILE_FORMATS:
        raise ValueError(f"data file {source!r} does not exist")
    import datasets

    try:
        ds = datasets.load_dataset(source, dataset_config, split=split)
    except Exception as err:
        raise ValueError(f"dataset {source!r} (split {split!r}) cannot be loaded: {err}") from err
    return [(f"{source}[{split}] row {i}", row) for i, row in enumerate(ds.to_list())]


class PromptDataModule(LightningDataModule):
    """Prompts for RLOO from an embedded task, local files, or a Hugging Face dataset.

    Each row has a prompt column: a string, or a chat ``messages`` list of ``{"role", "content"}``
    dicts. Every other column is passed, per completion, to the reward functions (e.g. a reference
    ``answer``). The tokenizer is the policy's (the CLI links ``model.model_name_or_path`` here), so
    prompt lengths are checked against the model's context before any compute is spent.

    Args:
        tokenizer_name_or_path: the policy's tokenizer (linked by the CLI).
        gguf_file: GGUF file inside ``tokenizer_name_or_path`` (linked by the CLI).
        task: an embedded task name (e.g. ``reverse``); exclusive with ``train_file``.
        train_file: a local file (.jsonl, .json, .csv, .parquet, .arrow), a folder of them, or a
            ``datasets.load_dataset`` name (hub or local script).
        val_file: held-out prompts (same forms); without it, ``val_size`` rows are held out.
            Setup logs both split sizes and where they came from.
        test_file: prompts for ``rloo-lightning test`` (same forms); without it, ``test`` evaluates
            the validation split.
        predict_file: prompts for ``rloo-lightning predict`` (same forms), which writes sampled
            completions; ``predict`` needs neither ``task`` nor ``train_file``.
        dataset_config: the dataset configuration name for ``load_dataset``.
        train_split, val_split: splits to read from a dataset name.
        prompt_column: the column holding the prompt (string or messages list).
        use_chat_template: ``auto`` applies the tokenizer's chat template (with
            ``add_generation_prompt``) when it has one; ``true`` requires one; ``false`` never.
            A messages-list prompt always needs one.
        system_prompt: a system message put before every prompt (needs the chat template).
        max_prompt_length: longest prompt in tokens (default: the model's context minus
            ``max_new_tokens``). A longer prompt is handled by ``on_long_prompt``.
        on_long_prompt: ``error`` (stop before training, naming the row) or ``drop`` (skip it,
            counting the drops in the log).
        batch_size: prompts per rollout per device (each sampled k times). Every training batch
            is full: the rows that do not fill the last one are skipped each epoch (a warning
            says how many).
        val_batch_size: prompts per validation batch (default: ``batch_size``).
        val_size: held-out fraction (< 1) or count (>= 1) when there is no ``val_file`` (default 0.1).
            Fewer than 8 validation prompts give a warning.
        num_train_rows, num_val_rows: sizes of an embedded task's generated splits (default 4000
            and 200). Options that the source ignores (these with ``train_file``, ``val_size``
            with ``val_file`` or a task) give a warning.
        seed: seeds the task's generation, the split and the shuffling.
        max_new_tokens: completion budget (linked from the module).
        repeat_batches: yield each training batch this many times in a row (linked from the
            module's ``update.updates_per_rollout``, whose later updates reuse the first one's rollout).
        trust_remote_code: executes code shipped with the tokenizer; off unless set.
    """

    def __init__(
        self,
        tokenizer_name_or_path: str = "",
        gguf_file: str | None = None,
        task: str | None = None,
        train_file: str | None = None,
        val_file: str | None = None,
        test_file: str | None = None,
        predict_file: str | None = None,
        dataset_config: str | None = None,
        train_split: str = "train",
        val_split: str = "test",
        prompt_column: str = "prompt",
        use_chat_template: Literal["auto", True, False] = "auto",
        system_prompt: str | None = None,
        max_prompt_length: int | None = None,
        on_long_prompt: Literal["error", "drop"] = "error",
        batch_size: int = 8,
        val_batch_size: int | None = None,
        val_size: float | None = None,
        num_train_rows: int | None = None,
        num_val_rows: int | None = None,
        seed: int = 0,
        max_new_tokens: int = 0,
        repeat_batches: int = 1,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        if task is not None and train_file is not None:
            raise ValueError("PromptDataModule: give one of `task` (embedded) or `train_file`, not both")
        if task is None and train_file is None and test_file is None and predict_file is None:
            raise ValueError("PromptDataModule: give `task` (embedded) or `train_file` (or only `predict_file` "
                             "for predict, `test_file` for test)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if repeat_batches < 1:
            raise ValueError(f"repeat_batches must be >= 1, got {repeat_batches}")
        if on_long_prompt not in ("error", "drop"):
            raise ValueError(f"on_long_prompt must be 'error' or 'drop', got {on_long_prompt!r}")
        if use_chat_template not in ("auto", True, False):
            raise ValueError(f"use_chat_template must be 'auto', true or false, got {use_chat_template!r}")
        if max_prompt_length is not None and max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
        self.save_hyperparameters()
        self._warn_ignored_options()
        self._warned_incomplete_batch = False
        self.tokenizer = None
        self.train_rows: list[dict] = []
        self.val_rows: list[dict] = []
        self.test_rows: list[dict] = []
        self.predict_rows: list[dict] = []
        self._loaded: set[str] = set()  # the splits setup has read: "fit" (train + validation), "test", "predict"
        self.dropped: dict[str, int] = {}

    def _warn_ignored_options(self) -> None:
        """Options given that the chosen source does not use: a warning naming each (they are not silent)."""
        hp = self.hparams
        if hp.task is not None:
            ignored = {"val_file": hp.val_file, "val_size": hp.val_size, "dataset_config": hp.dataset_config}
            why = f"task={hp.task!r} generates its own splits (sized by num_train_rows / num_val_rows)"
        else:
            ignored = {"num_train_rows": hp.num_train_rows, "num_val_rows": hp.num_val_rows}
            why = "they size an embedded task's splits, and train_file is given"
            if hp.val_file is not None and hp.val_size is not None:
                rank_zero_warn(f"PromptDataModule: val_size={hp.val_size} is ignored: val_file={hp.val_file!r} "
                               "gives the validation prompts")
        given = {name: value for name, value in ignored.items() if value is not None}
        if given:
            listed = ", ".join(f"{name}={value!r}" for name, value in given.items())
            rank_zero_warn(f"PromptDataModule: {listed} ignored: {why}")

    @property
    def _val_size(self) -> float:
        """``val_size`` as used: the given value, or the default fraction (None tells "not given" apart)."""
        return DEFAULT_VAL_SIZE if self.hparams.val_size is None else self.hparams.val_size

    # -- loading -------------------------------------------------------------------------------
    def _load_rows(self) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]], str]:
        hp = self.hparams
        if hp.task is not None:
            from rloo_lightning.tasks import get_task

            make_rows = get_task(hp.task).make_rows
            n_train = DEFAULT_TRAIN_ROWS if hp.num_train_rows is None else hp.num_train_rows
            n_val = DEFAULT_VAL_ROWS if hp.num_val_rows is None else hp.num_val_rows
            train = make_rows(n_train, hp.seed)
            held = {r[hp.prompt_column] for r in train}
            # Held-out means held out: drop validation prompts that also occur in training.
            val = [r for r in make_rows(n_val, hp.seed + 1) if r[hp.prompt_column] not in held]
            overlap = f", {n_val - len(val)} also in training removed" if len(val) < n_val else ""
            self._split_origin = (f"from task {hp.task!r}", f"from task {hp.task!r} (num_val_rows={n_val}{overlap})")
            return ([(f"task {hp.task} train row {i}", r) for i, r in enumerate(train)],
                    [(f"task {hp.task} validation row {i}", r) for i, r in enumerate(val)], f"task {hp.task!r}")
        train = read_rows(hp.train_file, hp.train_split, hp.dataset_config)
        if hp.val_file is not None:
            self._split_origin = (f"from {hp.train_file}", f"from val_file {hp.val_file}")
            return train, read_rows(hp.val_file, hp.val_split, hp.dataset_config), hp.train_file
        order = list(range(len(train)))
        random.Random(hp.seed).shuffle(order)
        val_size = self._val_size
        n_val = int(round(val_size * len(train))) if val_size < 1 else int(val_size)
        val_idx = set(order[:n_val])
        self._split_origin = (f"from {hp.train_file}", f"held out of the {len(train)} rows of {hp.train_file} "
                                             f"(val_size={val_size})")
        return ([r for i, r in enumerate(train) if i not in val_idx],
                [r for i, r in enumerate(train) if i in val_idx], hp.train_file)

    def _report_split(self) -> None:
        """One info line with both split sizes and their origin; a warning if validation is very small."""
        hp = self.hparams
        train_from, val_from = self._split_origin
        rank_zero_info(f"PromptDataModule: {len(self.train_rows)} training prompts {train_from}, "
                       f"{len(self.val_rows)} validation prompts {val_from}")
        n_val = len(self.val_rows)
        deliberate_empty = n_val == 0 and hp.val_file is None and hp.task is None and hp.val_size == 0
        if n_val < SMALL_VALIDATION and not deliberate_empty:
            if hp.task is not None:
                knob = "raise num_val_rows"
            elif hp.val_file is not None:
                knob = f"add prompts to val_file {hp.val_file}"
            else:
                val_size = self._val_size
                knob = f"val_size={val_size} gives {n_val}; raise val_size (a fraction < 1 or a count >= 1)"
            rank_zero_warn(f"PromptDataModule: the validation split has only {n_val} prompts (fewer than "
                           f"{SMALL_VALIDATION}): val/ metrics will be too noisy to compare; {knob}")

    def setup(self, stage: str | None = None) -> None:
        """Read and tokenize what ``stage`` uses: fit / validate the train and validation splits, test the
        ``test_file`` (else the validation split), predict the ``predict_file``. Idempotent."""
        hp = self.hparams
        if stage == "predict":
            if hp.predict_file is None:
                raise ValueError("predict needs data.predict_file: the prompts to sample completions for")
            if "predict" not in self._loaded:
                self.predict_rows = self._read_split_file("predict", hp.predict_file)
            return
        if stage == "test" and hp.test_file is not None:
            if "test" not in self._loaded:
                self.test_rows = self._read_split_file("test", hp.test_file)
            return
        if "fit" not in self._loaded:
            if hp.task is None and hp.train_file is None:
                what = {"test": "test needs data.test_file, or data.task / data.train_file for its validation split"}
                raise ValueError(what.get(stage, f"{stage or 'fit'} needs data.task or data.train_file"))
            self._setup_fit()
        if stage == "test":
            self.test_rows = self.val_rows
            rank_zero_info(f"PromptDataModule: no test_file: test evaluates the {len(self.val_rows)} validation "
                           "prompts")

    def _read_split_file(self, split: str, source: str) -> list[dict]:
        """The tokenized prompts of ``source`` for ``split`` (``test`` or ``predict``), logged and marked as loaded."""
        self._load_tokenizer()
        rows = self._tokenize(read_rows(source, self.hparams.val_split, self.hparams.dataset_config), split)
        rank_zero_info(f"PromptDataModule: {len(rows)} {split} prompts from {split}_file {source}")
        self._loaded.add(split)
        return rows

    def _load_tokenizer(self) -> None:
        """The policy's tokenizer, its chat-template check and the prompt-length limit (once)."""
        if self.tokenizer is not None:
            return
        hp = self.hparams
        self.tokenizer = load_tokenizer(hp.tokenizer_name_or_path, gguf_file=hp.gguf_file,
                                        trust_remote_code=hp.trust_remote_code)
        if hp.use_chat_template is True and not self.tokenizer.chat_template:
            raise ValueError(f"use_chat_template=true but the tokenizer of {hp.tokenizer_name_or_path!r} has none")
        limit = context_length(hp.tokenizer_name_or_path, gguf_file=hp.gguf_file,
                               trust_remote_code=hp.trust_remote_code)
        self.max_prompt_tokens, self.context = hp.max_prompt_length, limit
        if limit is not None:
            room = limit - hp.max_new_tokens
            if room < 1:
                raise ValueError(f"max_new_tokens={hp.max_new_tokens} leaves no room for a prompt in the "
                                 f"model's context of {limit} tokens")
            self.max_prompt_tokens = min(room, hp.max_prompt_length or room)

    def _setup_fit(self) -> None:
        hp = self.hparams
        train, val, source = self._load_rows()
        self._load_tokenizer()
        self.train_rows = self._tokenize(train, "train")
        self.val_rows = self._tokenize(val, "validation")
        self._report_split()
        if len(self.train_rows) < hp.batch_size:
            dropped = f" after dropping {self.dropped['train']} long prompts" if "train" in self.dropped else ""
            raise ValueError(f"{source}: the training set has {len(self.train_rows)} rows{dropped}, fewer than "
                             f"batch_size={hp.batch_size}" + (" (the source is empty)" if not train else ""))
        self._loaded.add("fit")

    def format_prompt(self, prompt, where: str) -> tuple[str, bool]:
        """The text fed to the model for ``prompt`` and whether it went through the chat template."""
        hp = self.hparams
        has_template = bool(self.tokenizer.chat_template)
        chat = isinstance(prompt, list) or hp.system_prompt is not None or (
            hp.use_chat_template is True or (hp.use_chat_template == "auto" and has_template))
        if hp.use_chat_template is False and (isinstance(prompt, list) or hp.system_prompt is not None):
            raise ValueError(f"{where}: a messages prompt or system_prompt needs use_chat_template")
        if not chat:
            return prompt, False
        if not has_template:
            raise ValueError(f"{where}: a messages prompt or system_prompt needs a chat template, and the "
                             f"tokenizer of {hp.tokenizer_name_or_path!r} has none")
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if hp.system_prompt is not None:
            messages = [{"role": "system", "content": hp.system_prompt}, *messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as err:
            raise ValueError(f"{where}: the chat template failed on this prompt: {err}") from err
        return text, True

    def _tokenize(self, rows: list[tuple[str, dict]], split: str) -> list[dict]:
        hp = self.hparams
        col, out, dropped = hp.prompt_column, [], 0
        for where, row in rows:
            if col not in row:
                raise ValueError(f"{where}: no prompt column {col!r}; columns are {sorted(row)}. "
                                 "Set `prompt_column`.")
            prompt = row[col]
            is_messages = isinstance(prompt, list) and prompt and all(
                isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
            if not (isinstance(prompt, str) and prompt) and not is_messages:
                raise ValueError(f"{where}: prompt column {col!r} must be a non-empty string or a list of "
                                 f"{{'role', 'content'}} messages, got {prompt!r:.80}")
            text, templated = self.format_prompt(prompt, where)
            # A chat template writes its own special tokens (BOS included); don't add them twice.
            ids = self.tokenizer(text, add_special_tokens=not templated)["input_ids"]
            if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
                if hp.on_long_prompt == "drop":
                    dropped += 1
                    continue
                if hp.max_prompt_length is not None and self.max_prompt_tokens == hp.max_prompt_length:
                    why = f"exceeds max_prompt_length={hp.max_prompt_length}"
                else:
                    why = (f"+ max_new_tokens={hp.max_new_tokens} exceeds the model's context of "
                           f"{self.context} tokens")
                raise ValueError(f"{where}: prompt of {len(ids)} tokens {why}; shorten it or set on_long_prompt=drop")
            out.append({"input_ids": ids, "prompt": prompt, "columns": {c: v for c, v in row.items() if c != col}})
        if dropped:
            self.dropped[split] = dropped
            rank_zero_info(f"PromptDataModule: dropped {dropped} {split} prompts longer than "
                           f"{self.max_prompt_tokens} tokens (on_long_prompt=drop)")
        return out

    # -- loaders -------------------------------------------------------------------------------
    def _collate(self):
        return partial(collate_prompts, pad_token_id=self.tokenizer.pad_token_id)

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        """Only the tensors of a prompt batch move; its strings and columns stay as they are.

        Lightning's default walks every string of ``prompt`` and ``columns`` each step.
        """
        if isinstance(batch, dict) and "input_ids" in batch:
            return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def train_dataloader(self) -> DataLoader:
        """Shuffled prompts from a :class:`ResumableSampler` whose position follows the trainer's step."""
        hp = self.hparams
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        sampler = ResumableSampler(self.train_rows, num_replicas=world, rank=rank, seed=hp.seed,
                                   batch_size=hp.batch_size, repeat=hp.repeat_batches,
                                   position=self._consumed_batches if trainer is not None else None)
        # drop_last: every rollout has batch_size prompts, so steps are alike.
        self._warn_incomplete_batch(sampler, world)
        return ResumableDataLoader(self.train_rows, batch_size=hp.batch_size, sampler=sampler, drop_last=True,
                                   collate_fn=self._collate())

    def _warn_incomplete_batch(self, sampler: ResumableSampler, world: int) -> None:
        """Once: how many training rows each epoch skips because they do not fill a batch (drop_last)."""
        if self._warned_incomplete_batch:
            return
        self._warned_incomplete_batch = True
        hp, n = self.hparams, len(self.train_rows)
        used = world * (sampler.num_samples // hp.batch_size) * hp.batch_size
        if used == n:
            return
        per = f"batch_size={hp.batch_size}" + (f" x {world} devices" if world > 1 else "")
        rank_zero_warn(f"PromptDataModule: {n - used} of the {n} training prompts are skipped each epoch (a "
                       f"different {n - used} each epoch, by the shuffle): every batch is full ({per}), so the "
                       f"rows that do not fill the last one are dropped. Choose a batch_size"
                       + (" x devices" if world > 1 else "") + f" that divides {n} to use every row.")

    def sample_batch(self, num_prompts: int, seed: int) -> dict:
        """``num_prompts`` training prompts drawn without replacement by a generator seeded with ``seed``.

        For dynamic sampling's extra rounds: a pure function of the seed, which the module derives
        from (seed, rank, step, round), so a resumed run draws what an uninterrupted one would.
        """
        if not self.train_rows:
            raise RuntimeError("PromptDataModule.sample_batch called before setup('fit')")
        generator = torch.Generator().manual_seed(seed)
        picks = torch.randperm(len(self.train_rows), generator=generator)[:num_prompts].tolist()
        return self._collate()([self.train_rows[i] for i in picks])

    def _consumed_batches(self) -> int:
        """Training batches this rank has consumed: optimizer steps x accumulation (restored on resume)."""
        return self.trainer.global_step * self.trainer.accumulate_grad_batches

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.val_rows)

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.test_rows)

    def predict_dataloader(self) -> DataLoader:
        return self._eval_loader(self.predict_rows)

    def _eval_loader(self, rows: list[dict]) -> DataLoader:
        """In file order, ``val_batch_size`` prompts a batch, the last one possibly short."""
        return DataLoader(rows, batch_size=self.hparams.val_batch_size or self.hparams.batch_size,
                          shuffle=False, collate_fn=self._collate())


class ResumableDataLoader(DataLoader):
    """The training loader: a ``DataLoader`` that Lightning counts as resumable (``state_dict`` / ``load_state_dict``).

    The resume position is not kept here: the :class:`ResumableSampler`'s ``position`` (the
    trainer's restored global step) is the one source of truth, so :meth:`load_state_dict` takes the
    saved state and changes nothing. Lightning only stores the state in the checkpoint and hands it
    back on restore (it skips no batches itself), so nothing is skipped twice; being stateful only
    tells Lightning that a mid-epoch resume continues exactly (no "not resumable" warning).
    """

    def state_dict(self) -> dict:
        """``consumed_batches``: the batches this rank had consumed when the checkpoint was written."""
        position = getattr(self.sampler, "position", None)
        return {"consumed_batches": int(position()) if callable(position) else 0}

    def load_state_dict(self, state_dict: dict) -> None:
        """Accepts the saved state; the sampler's position (the restored global step) already places the data."""


class ResumableSampler(DistributedSampler):
    """Shuffled, rank-sharded indices; the data order is a function of (seed, batches consumed) only.

    A ``DistributedSampler`` subclass, so Lightning uses it as is instead of wrapping it; each
    rank gets its own shard (a prompt's k completions are all sampled on its rank).

    With ``position`` (a callable giving the batches already consumed, e.g. the restored global
    step), every pass starts from it: epoch ``consumed // batches_per_epoch``, skipping the
    batches of that epoch already used. A resumed run therefore continues exactly where the
    interrupted one stopped, mid-epoch or at an epoch boundary, whatever Lightning's own epoch
    counter says (after a resume at an epoch's last batch it can lag by one). Without
    ``position`` it behaves as a ``DistributedSampler`` (``set_epoch`` picks the permutation).

    Args:
        batch_size: batches per epoch are ``len(self) // batch_size`` (``drop_last`` loaders).
        repeat: each batch is yielded this many times in a row (rollout reuse); the position
            counts the repeated batches.
    """

    def __init__(self, dataset, num_replicas: int = 1, rank: int = 0, seed: int = 0, batch_size: int = 1,
                 position=None, repeat: int = 1) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.batch_size = batch_size
        self.position = position
        self.repeat = repeat

    def __len__(self) -> int:
        return (self.num_samples // self.batch_size) * self.batch_size * self.repeat

    def set_epoch(self, epoch: int) -> None:
        if self.position is None:
            super().set_epoch(epoch)

    def __iter__(self):
        skip = 0
        if self.position is not None:
            per_epoch = max(1, (self.num_samples // self.batch_size) * self.repeat)
            self.epoch, done = divmod(self.position(), per_epoch)
            skip = done * self.batch_size
        order = list(super().__iter__())
        b = self.batch_size
        batches = [order[i : i + b] for i in range(0, len(order) - b + 1, b)]
        order = [i for batch in batches for _ in range(self.repeat) for i in batch]
        # len() stays the full shard: Lightning numbers a resumed epoch's batches from its restored count.
        return iter(order[skip:])


def collate_prompts(rows: list[dict], pad_token_id: int) -> dict:
    """Left-pad prompts (generation appends on the right).

    Returns:
        ``input_ids`` / ``attention_mask`` ``[N, P]``, ``prompt`` (N prompts as given: strings or
        messages lists) and ``columns`` (``{name: N values}``; a column missing from a row is None).
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
