"""Where prompts come from: a local file, a folder of files, a ``datasets`` name, or an embedded task.

A :class:`Source` streams its rows as ``(where, row)`` pairs (``where`` names the file and row for error
messages: ``"data.jsonl row 3"``) and states its identity (what the prompt cache's key records: for a
file its absolute path, size and modification time), so the rows are read once, when the cache is
built, and never held in Python all at once (a ``.json`` list file is the exception: JSON cannot be
streamed, so it is parsed whole).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from rloo_lightning.runtime import framework

__all__ = ["FILE_FORMATS", "Source", "file_source", "read_rows", "task_sources"]

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
BATCH_ROWS = 1000  # rows per batch read from a datasets-backed source


@dataclass
class Source:
    """Rows and their identity.

    Args:
        name: how messages name the source (the file, the dataset, ``task 'reverse'``).
        identity: a JSON-able description that changes whenever the rows may have changed.
        rows: a callable giving a fresh iterator of ``(where, row)``.
    """

    name: str
    identity: dict
    rows: Callable[[], Iterator[tuple[str, dict]]] = field(repr=False)


# Text files are read with errors="surrogateescape": a byte that is not UTF-8 becomes one of these code points
# (a UTF-8 file can hold none of them), so the line that holds it can be named; the codec's own error gives a
# byte offset into whatever chunk it was decoding.
_NOT_UTF8 = re.compile("[\udc80-\udcff]")


def _check_utf8(text: str, name: str, first_line: int = 1) -> None:
    """A ``ValueError`` naming the file, line and column of the first byte of ``text`` that was not UTF-8."""
    bad = _NOT_UTF8.search(text)
    if bad is None:
        return
    line = first_line + text.count("\n", 0, bad.start())
    column = bad.start() - text.rfind("\n", 0, bad.start())
    raise ValueError(f"{name} line {line}: byte {ord(bad.group()) - 0xDC00:#04x} at column {column} is not UTF-8; "
                     "the file must be UTF-8 text (re-save it with UTF-8 encoding)")


# Where a row is, in every message: "<file> line N" in a .jsonl file (the line an editor shows), "<file> row N"
# elsewhere; both count from 1.
def _jsonl_rows(path: Path, name: str) -> Iterator[tuple[str, dict]]:
    with path.open(encoding="utf-8", errors="surrogateescape") as f:
        for line_no, line in enumerate(f, start=1):
            _check_utf8(line, name, line_no)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{name} line {line_no}: not valid JSON: {err}") from err
            yield f"{name} line {line_no}", row


def _json_rows(path: Path, name: str) -> Iterator[tuple[str, dict]]:
    text = path.read_text(encoding="utf-8", errors="surrogateescape")
    _check_utf8(text, name)
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err}); expected a list of objects, or use .jsonl") from err
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a list of objects, got {type(rows).__name__}")
    for i, row in enumerate(rows, start=1):
        yield f"{name} row {i}", row


def _dataset_rows(ds, name: str) -> Iterator[tuple[str, dict]]:
    """Rows of a ``datasets.Dataset``, a batch at a time (the dataset itself stays in Arrow)."""
    i = 1
    for batch in ds.iter(batch_size=BATCH_ROWS):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns)):
            yield f"{name} row {i}", dict(zip(columns, values))
            i += 1


def _load_file_dataset(path: Path, name: str):
    import datasets

    try:
        return datasets.load_dataset(FILE_FORMATS[path.suffix], data_files=str(path), split="train")
    except Exception as err:  # pyarrow/pandas raise many types; name the file in one clear error
        if path.suffix == ".csv":  # text: a byte that is not UTF-8 is named by its line (read again only here)
            with path.open(encoding="utf-8", errors="surrogateescape") as f:
                for line_no, line in enumerate(f, start=1):
                    _check_utf8(line, name, line_no)
        raise ValueError(f"{path}: cannot be read as {path.suffix[1:]}: {err}") from err


def _checked(rows: Iterator[tuple[str, dict]]) -> Iterator[tuple[str, dict]]:
    for where, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{where}: is {type(row).__name__}, expected an object")
        yield where, row


def _file_identity(path: Path) -> dict:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def file_source(source: str, split: str = "train", dataset_config: str | None = None) -> Source:
    """The :class:`Source` for ``source``: a local file (.jsonl, .json, .csv, .parquet, .arrow), a local
    folder of them (sorted by path), or a ``datasets.load_dataset`` name (hub or local script)."""
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in FILE_FORMATS and p.is_file())
        if not files:
            raise ValueError(f"{source}: folder has no {'/'.join(FILE_FORMATS)} files")
        parts = [file_source(str(f)) for f in files]

        def folder_rows():
            for part in parts:
                yield from part.rows()

        return Source(source, {"folder": str(path.resolve()), "files": [p.identity for p in parts]}, folder_rows)
    if path.is_file():
        if path.suffix not in FILE_FORMATS:
            raise ValueError(f"{source}: unsupported extension {path.suffix!r}; use one of {list(FILE_FORMATS)}")
        kind = FILE_FORMATS[path.suffix]
        if kind == "json":
            reader = _jsonl_rows if path.suffix == ".jsonl" else _json_rows
            return Source(source, _file_identity(path), lambda: _checked(reader(path, source)))
        return Source(source, _file_identity(path),
                      lambda: _checked(_dataset_rows(_load_file_dataset(path, source), source)))
    if source.startswith((".", "/", "~")) or path.suffix in FILE_FORMATS:
        raise ValueError(f"data file {source!r} does not exist")
    import datasets

    try:
        ds = datasets.load_dataset(source, dataset_config, split=split)
    except Exception as err:
        raise ValueError(f"dataset {source!r} (split {split!r}) cannot be loaded: {err}") from err
    # The fingerprint changes with the dataset's files and revision (it is what datasets keys its own cache on).
    identity = {"dataset": source, "config": dataset_config, "split": split,
                "fingerprint": framework.dataset_fingerprint(ds), "rows": len(ds)}
    return Source(f"{source}[{split}]", identity, lambda: _checked(_dataset_rows(ds, f"{source}[{split}]")))


def task_sources(task: str, num_train_rows: int, num_val_rows: int, seed: int, prompt_column: str):
    """The training and validation :class:`Source` of an embedded task. Validation rows that repeat a
    training prompt are removed (held out means held out); the cache records how many."""
    from rloo_lightning.tasks import get_task

    spec = get_task(task)
    make_rows = spec.make_rows
    made: dict[str, list[dict]] = {}

    def splits() -> dict[str, list[dict]]:  # generated on first use: a cache hit needs none of it
        if not made:
            made["train"] = make_rows(num_train_rows, seed)
            held = {r[prompt_column] for r in made["train"] if prompt_column in r} if spec.hold_out_prompts else set()
            made["validation"] = [r for r in make_rows(num_val_rows, seed + 1) if r.get(prompt_column) not in held]
        return made

    # The generator is code: the task's version (raised when its rows change) is part of the identity.
    identity = {"task": task, "train_rows": num_train_rows, "val_rows": num_val_rows, "seed": seed,
                "version": spec.version}
    return tuple(Source(f"task {task!r}", {**identity, "split": split},
                        lambda split=split: ((f"task {task} {split} row {i}", r)
                                             for i, r in enumerate(splits()[split], start=1)))
                 for split in ("train", "validation"))


def read_rows(source: str, split: str = "train", dataset_config: str | None = None) -> list[tuple[str, dict]]:
    """All ``(where, row)`` pairs of ``source`` as a list (for small sources and tests; training streams them)."""
    return list(file_source(source, split, dataset_config).rows())


def default_cache_dir() -> Path:
    """``$RLOO_LIGHTNING_CACHE/prompts``, else ``~/.cache/rloo_lightning/prompts``."""
    from rloo_lightning.models.tiny import cache_dir

    return cache_dir() / "prompts"
