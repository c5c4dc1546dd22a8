"""The tokenized prompts of one split as an Arrow table: its schema, rows encoded into record batches, and
:class:`PromptRows`, the read-only sequence of row dicts over such a table that the loaders read.

Each row is ``{"input_ids": [int], "prompt": str | messages, "columns": {name: value}, "row": int}``; the prompt and
the other columns are stored as JSON text, so every value a JSONL file can hold round-trips exactly. The prompt
cache (:mod:`rloo_lightning.data.cache`) writes and memory-maps these tables.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

__all__ = ["WRITE_ROWS", "PromptRows", "arrow_schema", "record_batch"]

WRITE_ROWS = 2048  # rows encoded and written per Arrow record batch


def arrow_schema():
    """The Arrow schema of a prompt table: a row's token ids, its prompt and other columns as JSON text, and its index
    in its source."""
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

        return cls(pa.Table.from_batches([record_batch(rows, [r.get("row", i) for i, r in enumerate(rows)])],
                                         schema=arrow_schema()))

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


def record_batch(rows: list[dict], indices: list[int], wheres: list[str] | None = None):
    """Encoded ``rows`` as one Arrow record batch, ``indices`` their source rows; a value that cannot be stored as
    JSON fails naming its row (``wheres``, default ``row <index>``) and column."""
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
                            pa.array(columns, type=pa.string()), pa.array(indices, type=pa.int64())],
                           schema=arrow_schema())
