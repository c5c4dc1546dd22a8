"""Prompts: where they come from (:mod:`.sources`), how they are encoded (:mod:`.encode`), the Arrow tables of
tokenized prompts (:mod:`.prompt_rows`) and the prompt cache that keeps them (:mod:`.cache`), the validation split
(:mod:`.validation_split`), the resumable sampler and collate (:mod:`.sampling`), the resumed fit's data layout check
(:mod:`.resume_layout`), and the data module (:mod:`.module`)."""

from rloo_lightning.data.cache import PromptCache
from rloo_lightning.data.encode import PromptEncoder
from rloo_lightning.data.module import PromptDataModule
from rloo_lightning.data.prompt_rows import PromptRows
from rloo_lightning.data.sampling import ResumableDataLoader, ResumableSampler, collate_prompts
from rloo_lightning.data.sources import FILE_FORMATS, Source, file_source, read_rows

__all__ = ["FILE_FORMATS", "PromptCache", "PromptDataModule", "PromptEncoder", "PromptRows", "ResumableDataLoader",
           "ResumableSampler", "Source", "collate_prompts", "file_source", "read_rows"]
