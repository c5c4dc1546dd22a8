"""Prompts: where they come from (:mod:`.sources`), how they are encoded (:mod:`.encode`), the Arrow prompt
cache (:mod:`.cache`), the resumable sampler and collate (:mod:`.sampling`), and the data module (:mod:`.module`)."""

from rloo_lightning.data.cache import PromptCache, PromptRows
from rloo_lightning.data.encode import PromptEncoder
from rloo_lightning.data.module import PromptDataModule
from rloo_lightning.data.sampling import ResumableDataLoader, ResumableSampler, collate_prompts
from rloo_lightning.data.sources import FILE_FORMATS, Source, file_source, read_rows

__all__ = ["FILE_FORMATS", "PromptCache", "PromptDataModule", "PromptEncoder", "PromptRows", "ResumableDataLoader",
           "ResumableSampler", "Source", "collate_prompts", "file_source", "read_rows"]
