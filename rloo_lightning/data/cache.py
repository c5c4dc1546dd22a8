"""The prompt cache: each split's tokenized prompts in a memory-mapped Arrow file, converted once.

A cache entry is a folder ``<cache_dir>/<name>-<key>/`` with one Arrow IPC stream file per split
(``train.arrow``, ``validation.arrow``, ``test.arrow``, ``predict.arrow``; ``datasets.Dataset.from_file``
opens them too) and ``meta.json`` (the key's fields, the row counts, the long prompts dropped). The key is
a hash of everything that decides the rows: the source's identity (for a file its absolute path, size and
modification time), the tokenizer's fingerprint, the chat template, the system prompt, the prompt column,
the length limit and ``on_long_prompt``, and for a split held out of one file the seed and ``val_size``.
Changing any of them makes a new entry; an old entry is never rewritten.

Building streams the source a batch at a time, encodes it (:class:`PromptEncoder`: every row's checks,
the long-prompt error or drop happen here, once) and writes it into a temporary folder that is renamed
into place when complete, so a crash leaves no half entry and two processes building the same entry
cannot corrupt it. Opening an entry reads nothing but its metadata: rows are read from the memory map
when a batch asks for them.

Each row is ``{"input_ids": [int], "prompt": str | messages, "columns": {name: value}, "row": int}``;
``row`` is the row's index in its source (its file order), the prompt's stable identity. The prompt and
the other columns are stored as JSON text, so every value a JSONL file can hold round-trips exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

from rloo_lightning.data.encode import PromptEncoder
from rloo_lightning.data.sources import Source

__all__ = ["FORMAT_VERSION", "PromptCache", "PromptRows"]

FORMAT_VERSION = 1
WRITE_ROWS = 2048  # rows encoded and written per Arrow record batch


def _schema():
    import pyarrow as pa

    return pa.schema([("input_ids", pa.list_(pa.int32())), ("prompt", pa.string()), ("columns", pa.string()),
                      ("row", pa.int64())])


class PromptRows(Sequence):
    """The tokenized prompts of one split: a read-only sequence of row dicts over an Arrow table.

    ``rows[i]``, ``rows[a:b]``, iteration, and ``rows.__getitems__(indices)`` (which ``DataLoader`` uses to
    fetch a whole batch in one Arrow ``take``). ``rows.table`` is the ``pyarrow.Table`` itself.
    """

    def __init__(self, table) -> None:
        self.table = table

    @classmethod
    def open(cls, path: str | Path) -> "PromptRows":
        """Memory-maps the Arrow stream file at ``path`` (nothing is read until rows are asked for)."""
        import pyarrow as pa

        return cls(pa.ipc.open_stream(pa.memory_map(str(path), "r")).read_all())

    @classmethod
    def from_rows(cls, rows: list[dict]) -> "PromptRows":
        """An in-memory table of already encoded rows (``{"input_ids", "prompt", "columns"[, "row"]}``)."""
        import pyarrow as pa

        return cls(pa.Table.from_batches([_record_batch(rows, [r.get("row", i) for i, r in enumerate(rows)])],
                                         schema=_schema()))

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.__getitems__(range(len(self))[index])
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"row {index} out of range for {n} rows")
        return _to_rows(self.table.slice(index % n, 1))[0]

    def __getitems__(self, indices) -> list[dict]:
        import pyarrow as pa

        indices = list(indices)
        if not indices:
            return []
        return _to_rows(self.table.take(pa.array(indices, type=pa.int64())))

    def __iter__(self):
        for batch in self.table.to_batches(max_chunksize=WRITE_ROWS):
            yield from _to_rows(batch)

    def __repr__(self) -> str:
        return f"PromptRows({len(self)} rows)"


def _to_rows(table) -> list[dict]:
    d = table.to_pydict()
    return [{"input_ids": ids, "prompt": json.loads(p), "columns": json.loads(c), "row": r}
            for ids, p, c, r in zip(d["input_ids"], d["prompt"], d["columns"], d["row"])]


_ENCODER = json.JSONEncoder(ensure_ascii=False)  # one encoder for every row: json.dumps builds one per call


def _json(value, where: str, column: str) -> str:
    try:
        return _ENCODER.encode(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: column {column!r} holds a {type(value).__name__} value, which the prompt cache "
                         f"cannot store (it keeps columns as JSON): {err}; convert it in the data, e.g. to a "
                         "string") from err


def _record_batch(rows: list[dict], indices: list[int], wheres: list[str] | None = None):
    import pyarrow as pa

    wheres = wheres or [f"row {i}" for i in indices]
    columns = []
    for r, where in zip(rows, wheres):
        try:
            columns.append(_ENCODER.encode(r["columns"]))
        except (TypeError, ValueError):  # name the column that cannot be stored
            for name, value in r["columns"].items():
                _json(value, where, name)
            raise
    return pa.record_batch([pa.array([r["input_ids"] for r in rows], type=pa.list_(pa.int32())),
                            pa.array([_json(r["prompt"], w, "prompt") for r, w in zip(rows, wheres)], type=pa.string()),
                            pa.array(columns, type=pa.string()), pa.array(indices, type=pa.int64())], schema=_schema())


class _Writer:
    """Encoded rows into one Arrow stream file, a record batch at a time."""

    def __init__(self, path: Path) -> None:
        import pyarrow as pa

        self.sink = pa.OSFile(str(path), "wb")
        self.writer = pa.ipc.new_stream(self.sink, _schema())
        self.rows = 0

    def write(self, batch) -> None:
        if batch.num_rows:
            self.writer.write_batch(batch)
            self.rows += batch.num_rows

    def close(self) -> None:
        self.writer.close()
        self.sink.close()


def _encode_into(source: Source, encoder: PromptEncoder, writer: _Writer) -> tuple[int, list[int]]:
    """Streams ``source`` through ``encoder`` into ``writer``; the source's row count and the dropped rows."""
    n, dropped, pending = 0, [], []

    def flush():
        encoded = encoder.encode(pending)
        keep = [(e, n - len(pending) + j, pending[j][0]) for j, e in enumerate(encoded) if e is not None]
        dropped.extend(n - len(pending) + j for j, e in enumerate(encoded) if e is None)
        if keep:
            rows, idx, wheres = zip(*keep)
            writer.write(_record_batch(list(rows), list(idx), list(wheres)))
        pending.clear()

    for pair in source.rows():
        pending.append(pair)
        n += 1
        if len(pending) == WRITE_ROWS:
            flush()
    if pending:
        flush()
    return n, dropped


def held_out_count(val_size: float, n: int) -> int:
    """Validation rows held out of ``n``: a fraction (< 1) of them, rounded, or a count (>= 1)."""
    return int(round(val_size * n)) if val_size < 1 else int(val_size)


class PromptCache:
    """One cache entry: where it lives, whether it is complete, how to build and open it.

    Args:
        cache_dir: the cache's root folder.
        name: a readable prefix of the entry's folder (the source's name).
        key_fields: everything that decides the rows (hashed into the folder's name, kept in ``meta.json``).
    """

    def __init__(self, cache_dir: str | Path, name: str, key_fields: dict) -> None:
        self.key_fields = {"format": FORMAT_VERSION, **key_fields}
        blob = json.dumps(self.key_fields, sort_keys=True, default=str).encode()
        self.key = hashlib.sha256(blob).hexdigest()[:20]
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(name).name or name).strip("_.")[:40] or "prompts"
        self.path = Path(cache_dir).expanduser() / f"{slug}-{self.key}"

    @property
    def meta_path(self) -> Path:
        return self.path / "meta.json"

    def exists(self) -> bool:
        return self.meta_path.is_file()

    def meta(self) -> dict:
        return json.loads(self.meta_path.read_text())

    def open(self) -> dict[str, PromptRows]:
        """The entry's splits, memory-mapped."""
        return {split: PromptRows.open(self.path / f"{split}.arrow") for split in self.meta()["splits"]}

    def build(self, sources: dict[str, Source], encoder: PromptEncoder, hold_out: tuple[str, float, int] | None = None
              ) -> dict:
        """Encodes ``sources`` (``{split: source}``) into the entry and returns its metadata.

        With ``hold_out=(split, val_size, seed)`` the single source is split: ``held_out_count(val_size, n)`` of
        its n rows, chosen by ``random.Random(seed)``'s shuffle of the row indices, go to ``split``
        (``validation``) and the others to ``train``; long prompts are dropped (or raise) before the split is
        drawn, and the draw is over all n rows, so it does not depend on the length limit.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.parent / f".{self.path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            meta = {"key": self.key_fields, "splits": {}, "dropped": {}, "source_rows": {}}
            if hold_out is None:
                for split, source in sources.items():
                    writer = _Writer(tmp / f"{split}.arrow")
                    n, dropped = _encode_into(source, encoder, writer)
                    writer.close()
                    meta["splits"][split], meta["source_rows"][split] = writer.rows, n
                    if dropped:
                        meta["dropped"][split] = len(dropped)
            else:
                self._build_split(tmp, next(iter(sources.values())), encoder, *hold_out, meta)
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
            try:
                os.rename(tmp, self.path)
            except OSError:  # another process completed the same entry first: its rows are these rows
                if not self.exists():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return self.meta()

    @staticmethod
    def _build_split(tmp: Path, source: Source, encoder: PromptEncoder, val_split: str, val_size: float, seed: int,
                     meta: dict) -> None:
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        everything = _Writer(tmp / "all.arrow")
        n, dropped = _encode_into(source, encoder, everything)
        everything.close()
        order = list(range(n))
        random.Random(seed).shuffle(order)
        is_val = np.zeros(n, dtype=bool)
        is_val[order[:held_out_count(val_size, n)]] = True
        del order
        writers = {"train": _Writer(tmp / "train.arrow"), val_split: _Writer(tmp / f"{val_split}.arrow")}
        table = PromptRows.open(tmp / "all.arrow").table
        for batch in table.to_batches(max_chunksize=WRITE_ROWS):
            held = pa.array(is_val[batch.column("row").to_numpy()])
            writers[val_split].write(batch.filter(held))
            writers["train"].write(batch.filter(pc.invert(held)))
        del table
        for split, w in writers.items():
            w.close()
            meta["splits"][split] = w.rows
        (tmp / "all.arrow").unlink()
        meta["source_rows"] = {"all": n}
        held = [bool(is_val[i]) for i in dropped]
        for split, count in (("train", held.count(False)), (val_split, held.count(True))):
            if count:
                meta["dropped"][split] = int(count)
