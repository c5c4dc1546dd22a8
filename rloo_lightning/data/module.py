"""PromptDataModule: prompts from a task, files or a dataset, tokenized once into the prompt cache, served
in shuffled, resumable, rank-sharded batches."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from rloo_lightning.data.cache import PromptCache
from rloo_lightning.data.encode import CHAT_ROLES, UNKNOWN_WARNED, PromptEncoder
from rloo_lightning.data.prompt_rows import PromptRows
from rloo_lightning.data.resume_layout import check_resumed_layout, data_layout
from rloo_lightning.data.sampling import ResumableDataLoader, ResumableSampler, collate_prompts
from rloo_lightning.data.sources import default_cache_dir, file_source, task_sources
from rloo_lightning.data.validation_split import (DEFAULT_VAL_CAP, default_cap_applies, hold_out_rule, hold_out_text,
                                                  report_split, resumed_validation_rows)
from rloo_lightning.environments.tools import tool_schemas
from rloo_lightning.models import context_length, load_tokenizer

__all__ = ["PromptDataModule"]

DEFAULT_TRAIN_ROWS, DEFAULT_VAL_ROWS = 4000, 200  # the sizes of an embedded task's splits


class PromptDataModule(LightningDataModule):
    """Prompts for RLOO from an embedded task, local files, or a Hugging Face dataset.

    The rows are read, checked and tokenized once, into the prompt cache (memory-mapped Arrow files
    under ``cache_dir``, see :mod:`rloo_lightning.data.cache`): ``prepare_data`` builds it on one
    process per node, and every later start with the same source, tokenizer, chat template, system
    prompt and length limits opens it without reading the source again.

    Each row has a prompt column: a string, or a chat ``messages`` list of ``{"role", "content"}``
    dicts. Every other column is passed, per completion, to the reward functions (e.g. a reference
    ``answer``). The tokenizer is the policy's (the CLI links ``model.model_name_or_path`` here), so
    prompt lengths are checked against the model's context before any compute is spent.

    Args:
        tokenizer_name_or_path: the policy's tokenizer (linked by the CLI).
        gguf_file: GGUF file inside ``tokenizer_name_or_path`` (linked by the CLI).
        task: an embedded task name (e.g. ``reverse``). With ``train_file`` as well (a file given over a config
            that names a task), the file is used and one line says the task is ignored.
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
        prompt_column: the column holding the prompt (string or messages list). A prompt more than half of whose
            tokens are the tokenizer's unknown token is refused (the model cannot read it), naming the file and
            row, unless ``on_unreadable_prompt`` is ``keep``; a split with more than 1 % unknown tokens gives a
            warning either way.
        extra_roles: chat roles a messages prompt may use besides ``system``, ``user``, ``assistant`` and
            ``tool`` (e.g. ``ipython`` for a template that knows it); any other role is refused, naming the row.
        use_chat_template: ``auto`` applies the tokenizer's chat template (with
            ``add_generation_prompt``) when it has one; ``true`` requires one; ``false`` never.
            A messages-list prompt always needs one.
        system_prompt: a system message put before every prompt (needs the chat template).
        tools: tool functions (import paths) whose schemas go into every prompt, for a tool-using policy
            (:mod:`rloo_lightning.environments.tools`; give the same list to the environment): a chat template
            that takes ``tools`` renders them; otherwise a system message lists them with the call format
            (:func:`~rloo_lightning.environments.tools.tool_prompt`), before ``system_prompt``.
        max_prompt_length: longest prompt in tokens (default: the model's context minus
            ``max_new_tokens``). A longer prompt is handled by ``on_long_prompt``.
        on_long_prompt: ``error`` (stop before training, naming the row) or ``drop`` (skip it,
            counting the drops in the log).
        batch_size: prompts per rollout per device (each sampled k times). Every training batch
            is full: the rows that do not fill the last one are skipped each epoch (a warning
            says how many). A resumed fit keeps ``batch_size`` x devices (the prompts a step) as the checkpoint
            has it, else it is refused in one line (docs/reliability.md, "Resuming with other batch options").
        val_batch_size: prompts per validation batch (default: ``batch_size``).
        val_size: held-out fraction (< 1) or count (>= 1) when there is no ``val_file`` (default: 10 % of the rows,
            at most 1,000; a line says so when the cap applies). A resumed run keeps the split it started with.
            Fewer than 8 validation prompts give a warning.
        num_train_rows, num_val_rows: sizes of an embedded task's generated splits (default 4000
            and 200). Options that the source ignores (these with ``train_file``, ``val_size``
            with ``val_file`` or a task) give a warning.
        seed: seeds the task's generation, the split and the shuffling.
        max_new_tokens: completion budget (linked from the module).
        repeat_batches: yield each training batch this many times in a row (linked from the
            module's ``update.updates_per_rollout``, whose later updates reuse the first one's rollout).
        trust_remote_code: executes code shipped with the tokenizer; off unless set.
        cache_dir: the prompt cache's folder (default: ``$RLOO_LIGHTNING_CACHE/prompts``, else
            ``~/.cache/rloo_lightning/prompts``). Entries are never rewritten; delete the folder to
            reclaim the space.
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
        tools: list[str] | None = None,
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
        cache_dir: str | None = None,
        extra_roles: list[str] | None = None,
        on_unreadable_prompt: Literal["error", "keep"] = "error",
    ) -> None:
        super().__init__()
        # A train_file given over a config with a task (quickstart.yaml's): the file is what the user means.
        dropped_task, task = (task, None) if task is not None and train_file is not None else (None, task)
        if task is None and train_file is None and test_file is None and predict_file is None:
            raise ValueError("PromptDataModule: give `task` (embedded) or `train_file` (or only `predict_file` "
                             "for predict, `test_file` for test)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if repeat_batches < 1:
            raise ValueError(f"repeat_batches must be >= 1, got {repeat_batches}")
        if on_unreadable_prompt not in ("error", "keep"):
            raise ValueError(f"on_unreadable_prompt must be 'error' or 'keep', got {on_unreadable_prompt!r}")
        if on_long_prompt not in ("error", "drop"):
            raise ValueError(f"on_long_prompt must be 'error' or 'drop', got {on_long_prompt!r}")
        if use_chat_template not in ("auto", True, False):
            raise ValueError(f"use_chat_template must be 'auto', true or false, got {use_chat_template!r}")
        if max_prompt_length is not None and max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
        unknown_roles = sorted(set(extra_roles or ()) & set(CHAT_ROLES))
        if unknown_roles:
            raise ValueError(f"extra_roles lists {unknown_roles}, which are always accepted; list only other roles")
        self.save_hyperparameters()
        if dropped_task is not None:  # under LightningCLI the hyperparameters are the parsed config's, not the locals
            self.hparams.task = None
        # Tool import paths resolve now: a typo fails before any tokenizer or model is loaded.
        self.tool_schemas = tool_schemas(tools) if tools else None
        self._warn_ignored_options(dropped_task)
        self._warned_incomplete_batch = False
        self.tokenizer = None
        self.train_rows: PromptRows = PromptRows.from_rows([])
        self.val_rows: PromptRows = self.train_rows
        self.test_rows: PromptRows = self.train_rows
        self.predict_rows: PromptRows = self.train_rows
        self.encoder: PromptEncoder | None = None
        self._loaded: set[str] = set()  # the splits setup has read: "fit" (train + validation), "test", "predict"
        self.dropped: dict[str, int] = {}
        self._held_out_split: dict | None = None  # a split held out of train_file: {"source_rows": n}
        self._kept_val_rows: int | None = None  # a resumed run's held-out count (load_state_dict)

    def _warn_ignored_options(self, dropped_task: str | None = None) -> None:
        """Options given that the chosen source does not use: a warning naming each (they are not silent)."""
        hp = self.hparams
        if dropped_task is not None:  # with the task, the options that size its splits go too: one line for all
            sized = [f"{name}={getattr(hp, name)}" for name in ("num_train_rows", "num_val_rows")
                     if getattr(hp, name) is not None]
            rank_zero_info(f"PromptDataModule: train_file={hp.train_file!r} is given, so task={dropped_task!r}"
                           + (f" (and {', '.join(sized)})" if sized else "") + " is ignored")
            return
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

    # -- the split a run started with, kept on resume -------------------------------------------
    def state_dict(self) -> dict:
        """While fitting, ``layout``: what the data position (the batches a rank has consumed) counts in (see
        :meth:`load_state_dict`); with a split held out of ``train_file``: its size, the rows it was drawn from and
        the seed."""
        state = {}
        if self._layout() is not None:
            state["layout"] = self._layout()
        if self._held_out_split:
            state["held_out"] = {"validation_rows": len(self.val_rows), "seed": self.hparams.seed,
                                 "source_rows": self._held_out_split["source_rows"],
                                 "train_file": str(self.hparams.train_file)}
        return state

    def _layout(self) -> dict | None:
        """This fit's :func:`~rloo_lightning.data.resume_layout.data_layout` (None outside ``fit``)."""
        trainer = self.trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return None
        return data_layout(self.hparams.batch_size, trainer.world_size, self.hparams.repeat_batches,
                           trainer.accumulate_grad_batches)

    def load_state_dict(self, state_dict: dict) -> None:
        """A resumed run validates on the prompts it started with, even where the default rule or ``val_size``
        would now hold out another count (the same seed's shuffle of the same rows: the first ``count`` of it).

        A resumed fit whose batch_size x world size, ``repeat_batches`` or ``accumulate_grad_batches`` differ from
        the checkpoint's ``layout`` is refused (one line naming each, from
        :func:`~rloo_lightning.data.resume_layout.layout_change`): the data position is a per-rank batch count, which
        would then point elsewhere in the data. A checkpoint without ``layout`` resumes unchecked."""
        self._check_layout(state_dict.get("layout"))
        held = state_dict.get("held_out")
        if not held or not self._held_out_split:
            return
        count = resumed_validation_rows(held, self._held_out_split["source_rows"], self.hparams.seed,
                                        self.hparams.train_file, len(self.val_rows))
        if count is None:
            return
        self._kept_val_rows = count
        self._loaded.discard("fit")
        self._setup_fit()

    def _check_layout(self, saved: dict | None) -> None:
        """A resumed fit's layout checked against the checkpoint's ``saved`` one
        (:func:`~rloo_lightning.data.resume_layout.check_resumed_layout`)."""
        now = self._layout()
        if now is None or saved is None:
            return
        check_resumed_layout(saved, now, str(self.trainer.ckpt_path))

    # -- loading: the prompt cache -------------------------------------------------------------
    @property
    def cache_root(self) -> Path:
        return Path(self.hparams.cache_dir).expanduser() if self.hparams.cache_dir else default_cache_dir()

    def _fit_cache(self) -> tuple[PromptCache, dict, tuple | None]:
        """The cache entry of the training and validation splits, their sources, and the hold-out rule."""
        hp = self.hparams
        if hp.task is not None:
            n_train = DEFAULT_TRAIN_ROWS if hp.num_train_rows is None else hp.num_train_rows
            n_val = DEFAULT_VAL_ROWS if hp.num_val_rows is None else hp.num_val_rows
            train, val = task_sources(hp.task, n_train, n_val, hp.seed, hp.prompt_column)
            sources, hold_out = {"train": train, "validation": val}, None
        elif hp.val_file is not None:
            sources = {"train": file_source(hp.train_file, hp.train_split, hp.dataset_config),
                       "validation": file_source(hp.val_file, hp.val_split, hp.dataset_config)}
            hold_out = None
        else:
            sources = {"all": file_source(hp.train_file, hp.train_split, hp.dataset_config)}
            hold_out = hold_out_rule(hp.val_size, hp.seed, self._kept_val_rows)
        key = {"sources": {split: src.identity for split, src in sources.items()}, "encoding": self.encoder.identity(),
               "hold_out": hold_out}
        name = hp.task if hp.task is not None else hp.train_file
        return PromptCache(self.cache_root, name, key), sources, hold_out

    def _split_cache(self, split: str, source: str) -> tuple[PromptCache, dict]:
        src = file_source(source, self.hparams.val_split, self.hparams.dataset_config)
        key = {"sources": {split: src.identity}, "encoding": self.encoder.identity(), "hold_out": None}
        return PromptCache(self.cache_root, f"{split}-{Path(source).name}", key), {split: src}

    def _caches(self, stage: str | None) -> list[tuple[PromptCache, dict, tuple | None]]:
        """The cache entries ``stage`` reads (see :meth:`setup`)."""
        hp = self.hparams
        self._load_tokenizer()
        if stage == "predict":
            if hp.predict_file is None:
                raise ValueError("predict needs data.predict_file: the prompts to sample completions for")
            return [(*self._split_cache("predict", hp.predict_file), None)]
        if stage == "test" and hp.test_file is not None:
            return [(*self._split_cache("test", hp.test_file), None)]
        if hp.task is None and hp.train_file is None:
            what = {"test": "test needs data.test_file, or data.task / data.train_file for its validation split"}
            raise ValueError(what.get(stage, f"{stage or 'fit'} needs data.task or data.train_file"))
        return [self._fit_cache()]

    def _ensure(self, cache: PromptCache, sources: dict, hold_out) -> dict:
        """The entry's metadata once its files pass their checks, building the entry first if it is not there or
        failed them (it is then moved aside, with a warning: :meth:`PromptCache.verified_meta`)."""
        meta = cache.verified_meta()
        if meta is None:
            names = ", ".join(sorted({s.name for s in sources.values()}))
            rank_zero_info(f"PromptDataModule: building the prompt cache of {names} in {cache.path}")
            meta = cache.build(sources, self.encoder, hold_out)
        return meta

    def prepare_data(self) -> None:
        """Builds the prompt cache the trainer's stage reads, once per node (Lightning calls it on one process
        and holds the others until it returns); every error in the data, naming the file and row, is raised here,
        before any compute."""
        fn = getattr(getattr(getattr(self, "trainer", None), "state", None), "fn", None)
        stage = getattr(fn, "value", fn) or "fit"
        for cache, sources, hold_out in self._caches(stage):
            self._ensure(cache, sources, hold_out)

    def setup(self, stage: str | None = None) -> None:
        """Open what ``stage`` uses from the prompt cache (building it if ``prepare_data`` did not): fit /
        validate the train and validation splits, test the ``test_file`` (else the validation split), predict
        the ``predict_file``. Idempotent."""
        hp = self.hparams
        stage = getattr(stage, "value", stage)  # Lightning passes its TrainerFn enum
        if stage == "predict" or (stage == "test" and hp.test_file is not None):
            if stage not in self._loaded:
                (cache, sources, hold_out), = self._caches(stage)
                meta = self._ensure(cache, sources, hold_out)
                rows = cache.open(meta)[stage]
                self._log_dropped(meta)
                self._warn_unknown(meta, sources)
                source = hp.predict_file if stage == "predict" else hp.test_file
                rank_zero_info(f"PromptDataModule: {len(rows)} {stage} prompts from {stage}_file {source}")
                setattr(self, f"{stage}_rows", rows)
                self._loaded.add(stage)
            return
        if "fit" not in self._loaded:
            self._setup_fit()
        if stage == "test":
            self.test_rows = self.val_rows
            rank_zero_info(f"PromptDataModule: no test_file: test evaluates the {len(self.val_rows)} validation "
                           "prompts")

    def _load_tokenizer(self) -> None:
        """The policy's tokenizer, its chat-template check, the prompt-length limit and the encoder (once)."""
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
        self.encoder = PromptEncoder(self.tokenizer, hp.tokenizer_name_or_path, hp.prompt_column, hp.use_chat_template,
                                     hp.system_prompt, hp.on_long_prompt, hp.max_prompt_length, hp.max_new_tokens,
                                     self.max_prompt_tokens, self.context, tools=self.tool_schemas,
                                     extra_roles=hp.extra_roles, on_unreadable_prompt=hp.on_unreadable_prompt)

    def columns(self, stage: str) -> list[tuple[str, list[str]]]:
        """The columns the reward functions get in ``stage`` (those of each scored split's first row), as
        ``[(which prompts, names)]``: ``fit`` the training and validation prompts, ``validate`` the validation
        ones, ``test`` the test ones, ``predict`` the predict ones."""
        hp = self.hparams
        source = hp.train_file if hp.task is None else f"task {hp.task!r}"
        splits = {"fit": [("training", self.train_rows, source), ("validation", self.val_rows, hp.val_file or source)],
                  "validate": [("validation", self.val_rows, hp.val_file or source)],
                  "test": [("test", self.test_rows, hp.test_file or hp.val_file or source)],
                  "predict": [("predict", self.predict_rows, hp.predict_file)]}.get(stage, [])
        return [(f"the {name} prompts of {where}", sorted(rows[0]["columns"])) for name, rows, where in splits
                if len(rows)]

    def _warn_unknown(self, meta: dict, sources: dict) -> None:
        """A warning per source whose prompt tokens are more than 1 % the tokenizer's unknown token."""
        for split, (unknown, tokens) in meta.get("unknown_tokens", {}).items():
            if tokens and unknown > UNKNOWN_WARNED * tokens and split in sources:
                rank_zero_warn(f"PromptDataModule: {100 * unknown / tokens:.1f} % of the prompt tokens of "
                               f"{sources[split].name} ({unknown} of {tokens}) are the unknown token "
                               f"{self.tokenizer.unk_token!r}: the model reads those prompts only in part. Is the "
                               f"data meant for the tokenizer of {self.hparams.tokenizer_name_or_path!r}?")

    def _log_dropped(self, meta: dict) -> None:
        for split, count in meta["dropped"].items():
            self.dropped[split] = count
            rank_zero_info(f"PromptDataModule: dropped {count} {split} prompts longer than "
                           f"{self.max_prompt_tokens} tokens (on_long_prompt=drop)")

    def _setup_fit(self) -> None:
        hp = self.hparams
        (cache, sources, hold_out), = self._caches("fit")
        meta = self._ensure(cache, sources, hold_out)
        splits = cache.open(meta)
        self.train_rows, self.val_rows = splits["train"], splits["validation"]
        self.dropped = {}
        self._log_dropped(meta)
        self._warn_unknown(meta, sources)
        if hp.task is not None:
            n_val = sources["validation"].identity["val_rows"]
            overlap = n_val - meta["source_rows"]["validation"]
            also = f", {overlap} also in training removed" if overlap else ""
            self._split_origin = (f"from task {hp.task!r}", f"from task {hp.task!r} (num_val_rows={n_val}{also})")
            source = f"task {hp.task!r}"
        elif hp.val_file is not None:
            self._split_origin = (f"from {hp.train_file}", f"from val_file {hp.val_file}")
            source = hp.train_file
        else:
            n = meta["source_rows"]["all"]
            self._held_out_split = {"source_rows": n}
            self._split_origin = (f"from {hp.train_file}", f"held out of the {n} rows of {hp.train_file} "
                                                           f"({hold_out_text(hp.val_size, self._kept_val_rows, n)})")
            source = hp.train_file
            if default_cap_applies(hp.val_size, self._kept_val_rows, n):
                rank_zero_info(f"PromptDataModule: validation holds out {DEFAULT_VAL_CAP} of the {n} rows of "
                               f"{hp.train_file} (10 % capped at {DEFAULT_VAL_CAP} when val_size is not given); set "
                               "data.val_size to choose (a fraction < 1 or a count >= 1)")
        if len(self.train_rows) < hp.batch_size:
            dropped = f" after dropping {self.dropped['train']} long prompts" if "train" in self.dropped else ""
            empty = not sum(meta["source_rows"].get(s, 0) for s in ("train", "all"))
            raise ValueError(f"{source}: the training set has {len(self.train_rows)} rows{dropped}, fewer than "
                             f"batch_size={hp.batch_size}" + (" (the source is empty)" if empty else ""))
        # After the check: an empty file is one error, not a validation-size warning first.
        report_split(hp, len(self.train_rows), len(self.val_rows), self._split_origin)
        self._loaded.add("fit")

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
        self._train_sampler = sampler
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
        return self._collate()(self.train_rows.__getitems__(picks))

    def train_batch(self, position: int) -> dict:
        """The batch this rank's training loader yields after ``position`` batches (repeats counted), collated as
        the loader collates it: ``rollout.lag`` samples a later step's prompts ahead of that step."""
        if getattr(self, "_train_sampler", None) is None:
            self.train_dataloader()
        return self._collate()(self.train_rows.__getitems__(self._train_sampler.batch_at(position)))

    def _consumed_batches(self) -> int:
        """Training batches this rank has consumed: optimizer steps x accumulation (restored on resume)."""
        return self.trainer.global_step * self.trainer.accumulate_grad_batches

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.val_rows)

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.test_rows)

    def predict_dataloader(self) -> DataLoader:
        return self._eval_loader(self.predict_rows)

    def _eval_loader(self, rows: PromptRows) -> DataLoader:
        """In file order, ``val_batch_size`` prompts a batch, the last one possibly short."""
        return DataLoader(rows, batch_size=self.hparams.val_batch_size or self.hparams.batch_size,
                          shuffle=False, collate_fn=self._collate())
