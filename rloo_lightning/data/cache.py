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
cannot corrupt it. Rows are read from the memory map when a batch asks for them.

What is on disk is checked before it is used. ``meta.json`` records each Arrow file's size and SHA-256
(written at build time, in the temporary folder, before the rename) and a SHA-256 of its own content.
Every open of an entry (:meth:`PromptCache.verified_meta`, :meth:`PromptCache.verify`) reads each file in
full and compares; a file truncated, grown, changed in place at the same size (whatever its modification
time says), missing or unreadable, a ``meta.json`` damaged or edited, or an entry of an older version
without checksums fails. Such an entry is never used: :meth:`PromptCache.verified_meta` warns
(:class:`PromptCacheWarning`, naming the entry and what is wrong), renames the folder aside to
``<entry>.corrupt-<time>-<pid>-<tag>`` (``.unverified-`` for an older version's entry; kept, never read
again) and the caller rebuilds it. A build whose rename finds an entry already in place keeps that entry
only if it passes the same checks; otherwise it moves it aside and retries.

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
import stat
import time
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rloo_lightning.data.encode import PromptEncoder
from rloo_lightning.data.prompt_rows import WRITE_ROWS, PromptRows, arrow_schema, record_batch
from rloo_lightning.data.sources import Source
from rloo_lightning.data.validation_split import held_out_count

__all__ = ["FORMAT_VERSION", "PromptCache", "PromptCacheError", "PromptCacheWarning"]

FORMAT_VERSION = 1
CHECKSUM = "sha256"  # the hashlib algorithm of meta.json's checksums (its name is their field's name)
READ_BYTES = 1 << 20  # the read size while a file is hashed
RENAME_TRIES = 5  # a build's attempts to rename its entry into place over entries that fail their checks
CACHE_DIR_OPTION = ("data.cache_dir (--data.cache_dir, PromptDataModule's cache_dir; default "
                    "$RLOO_LIGHTNING_CACHE/prompts, else ~/.cache/rloo_lightning/prompts)")


class PromptCacheError(OSError):
    """A cache entry that cannot be used (and cannot be rebuilt here), or a cache folder that cannot be written."""


class PromptCacheWarning(UserWarning):
    """A cache entry failed its checks: it was moved aside, and is rebuilt."""


class _Writer:
    """Encoded rows into one Arrow stream file, a record batch at a time."""

    def __init__(self, path: Path) -> None:
        import pyarrow as pa

        self.path = path
        with _writing(path):
            self.sink = pa.OSFile(str(path), "wb")
            self.writer = pa.ipc.new_stream(self.sink, arrow_schema())
        self.rows = 0

    def write(self, batch) -> None:
        if batch.num_rows:
            with _writing(self.path):
                self.writer.write_batch(batch)
            self.rows += batch.num_rows

    def close(self) -> None:
        with _writing(self.path):
            self.writer.close()
            self.sink.close()


@contextmanager
def _writing(path: Path):
    """Turns an ``OSError`` while writing ``path`` into a :class:`PromptCacheError` naming it and the option."""
    try:
        yield
    except PromptCacheError:
        raise
    except OSError as err:
        raise PromptCacheError(f"prompt cache: cannot write {path} ({err}); free space there, or set "
                               f"{CACHE_DIR_OPTION} to a writable folder") from err


def _file_digest(path: Path) -> str:
    """The ``CHECKSUM`` hex digest of the file at ``path``, read ``READ_BYTES`` at a time (not memory-mapped: the
    pages read are not added to this process's resident set)."""
    digest = hashlib.new(CHECKSUM)
    buffer = bytearray(READ_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _meta_checksum(meta: dict) -> str:
    """The checksum of ``meta.json``'s content: everything but its ``checksum`` field, as canonical JSON."""
    body = {k: v for k, v in meta.items() if k != "checksum"}
    return hashlib.new(CHECKSUM, json.dumps(body, sort_keys=True).encode()).hexdigest()


def _as_json(value):
    """``value`` as it reads back from ``meta.json`` (tuples become lists, unknown types their ``str``)."""
    return json.loads(json.dumps(value, default=str))


@dataclass
class _Verdict:
    """What :meth:`PromptCache._inspect` found: an entry that passes (``meta``), one that fails (``problem``), or
    none (both ``None``). ``folder`` is the entry folder's ``(st_dev, st_ino)`` as inspected."""

    meta: dict | None = None
    problem: str | None = None
    unverified: bool = False  # it fails because it has no checksums (an older version's entry)
    folder: tuple[int, int] | None = None


def _encode_into(source: Source, encoder: PromptEncoder, writer: _Writer) -> tuple[int, list[int]]:
    """Streams ``source`` through ``encoder`` into ``writer``; the source's row count and the dropped rows."""
    n, dropped, pending = 0, [], []

    def flush():
        encoded = encoder.encode(pending)
        keep = [(e, n - len(pending) + j, pending[j][0]) for j, e in enumerate(encoded) if e is not None]
        dropped.extend(n - len(pending) + j for j, e in enumerate(encoded) if e is None)
        if keep:
            rows, idx, wheres = zip(*keep)
            writer.write(record_batch(list(rows), list(idx), list(wheres)))
        pending.clear()

    for pair in source.rows():
        pending.append(pair)
        n += 1
        if len(pending) == WRITE_ROWS:
            flush()
    if pending:
        flush()
    return n, dropped


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
        """Whether the entry's ``meta.json`` is there (not whether the entry passes its checks: see
        :meth:`verified_meta`)."""
        return self.meta_path.is_file()

    def meta(self) -> dict:
        """The entry's ``meta.json``, unchecked (see :meth:`verify`)."""
        return json.loads(self.meta_path.read_text())

    def verified_meta(self) -> dict | None:
        """The entry's metadata once every file passes its checks (each file read in full and hashed), or
        ``None``: not built, or it failed them. A failing entry is renamed aside with a
        :class:`PromptCacheWarning` naming it and what is wrong, so that it is never used again; build it anew."""
        verdict = self._inspect()
        if verdict.problem is None:
            return verdict.meta
        self._move_aside(verdict)
        return None

    def verify(self) -> dict:
        """The entry's metadata once every file passes its checks; :class:`PromptCacheError` naming the entry and
        what is wrong otherwise (nothing is moved: :meth:`verified_meta` does that)."""
        verdict = self._inspect()
        if verdict.meta is None:
            problem = verdict.problem or "it is not built"
            raise PromptCacheError(f"prompt cache entry {self.path}: {problem}; the next PromptDataModule start "
                                   "(prepare_data or setup) moves it aside and rebuilds it")
        return verdict.meta

    def open(self, meta: dict | None = None) -> dict[str, PromptRows]:
        """The entry's splits, memory-mapped. ``meta``: what :meth:`verified_meta` or :meth:`build` just returned
        for this entry (the files are then not hashed again); without it the entry is checked first
        (:meth:`verify`)."""
        import pyarrow as pa

        meta = self.verify() if meta is None else meta
        splits = {}
        for split, count in meta["splits"].items():
            path = self.path / f"{split}.arrow"
            try:
                rows = PromptRows.open(path)
            except (OSError, pa.ArrowException) as err:
                raise PromptCacheError(f"prompt cache entry {self.path}: {path.name} cannot be read ({err}); delete "
                                       "the entry folder, it is rebuilt on the next start") from err
            if len(rows) != count:
                raise PromptCacheError(f"prompt cache entry {self.path}: {path.name} holds {len(rows)} rows, "
                                       f"meta.json says {count}; delete the entry folder, it is rebuilt on the next "
                                       "start")
            splits[split] = rows
        return splits

    def _inspect(self) -> _Verdict:
        """Checks the entry: ``meta.json`` against its own checksum and the key, then every file it lists against
        its size and checksum. The first problem found is the verdict."""
        try:
            st = os.stat(self.path)
        except (FileNotFoundError, NotADirectoryError):  # not there (or a folder above it is a file)
            return _Verdict()
        except OSError as err:
            return _Verdict(problem=f"the folder cannot be read ({err})")
        folder = (st.st_dev, st.st_ino)

        def bad(problem: str, unverified: bool = False) -> _Verdict:
            return _Verdict(problem=problem, unverified=unverified, folder=folder)

        if not stat.S_ISDIR(st.st_mode):
            return bad("it is not a folder")
        try:
            text = self.meta_path.read_bytes()
        except FileNotFoundError:
            return bad("meta.json is missing")
        except OSError as err:
            return bad(f"meta.json cannot be read ({err})")
        try:
            meta = json.loads(text)
        except ValueError:
            return bad(f"meta.json is not valid JSON ({len(text)} bytes: truncated or overwritten)")
        if not isinstance(meta, dict) or "checksum" not in meta or not isinstance(meta.get("files"), dict):
            return bad("meta.json has no checksums (an entry written by a version of rloo_lightning that did not "
                       "record them), so its files cannot be verified", unverified=True)
        if meta["checksum"] != _meta_checksum(meta):
            return bad("meta.json does not match its own checksum (edited or damaged after it was written)")
        if json.dumps(meta.get("key"), sort_keys=True) != json.dumps(self.key_fields, sort_keys=True, default=str):
            return bad("meta.json records another key than the folder's name")
        splits = meta.get("splits")
        if not isinstance(splits, dict):
            return bad("meta.json lists no splits")
        for name in (f"{split}.arrow" for split in splits):
            expected = meta["files"].get(name)
            if not (isinstance(expected, dict) and CHECKSUM in expected and "bytes" in expected):
                return bad(f"meta.json has no {CHECKSUM} checksum and size of {name}")
            path = self.path / name
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                return bad(f"{name} is missing")
            except OSError as err:
                return bad(f"{name} cannot be read ({err})")
            if size != expected["bytes"]:
                how = "truncated" if size < expected["bytes"] else "longer than written"
                return bad(f"{name} is {how}: {size} bytes, {expected['bytes']} when it was built")
            try:
                digest = _file_digest(path)
            except FileNotFoundError:  # since the stat: the entry was moved aside meanwhile
                return bad(f"{name} is missing")
            except OSError as err:
                return bad(f"{name} cannot be read ({err})")
            if digest != expected[CHECKSUM]:
                return bad(f"{name} does not match its {CHECKSUM} checksum: its size is the one it was built with, "
                           "its content changed")
        return _Verdict(meta=meta, folder=folder)

    def _move_aside(self, verdict: _Verdict) -> None:
        """Renames the entry that ``verdict`` found bad to ``<entry>.corrupt-<time>-<pid>-<tag>`` (``.unverified-``
        for an entry without checksums), with a warning. If another process moved it first, there is nothing to
        move; if another process has meanwhile put a fresh entry in its place (the folder renamed is not the one
        inspected), that one is put back."""
        what = f"prompt cache entry {self.path}: {verdict.problem}"
        kind = "unverified" if verdict.unverified else "corrupt"
        aside = self.path.with_name(f"{self.path.name}.{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-"
                                    f"{uuid.uuid4().hex[:6]}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            warnings.warn(f"{what}; another process has already moved it aside. Rebuilding it.", PromptCacheWarning,
                          stacklevel=3)
            return
        except OSError as err:
            raise PromptCacheError(f"{what}; it cannot be moved aside ({err}): delete the folder, or set "
                                   f"{CACHE_DIR_OPTION} to a writable folder") from err
        if verdict.folder is not None:
            st = os.stat(aside)
            if (st.st_dev, st.st_ino) != verdict.folder:  # a fresh entry, put in place since it was inspected
                try:
                    os.rename(aside, self.path)
                except OSError:  # and yet another is in place by now: this one is a duplicate of it
                    shutil.rmtree(aside, ignore_errors=True)
                warnings.warn(f"{what}; another process has already replaced it.", PromptCacheWarning, stacklevel=3)
                return
        warnings.warn(f"{what}. Moved aside to {aside} (kept for inspection, never read again: delete it when done); "
                      "rebuilding the entry.", PromptCacheWarning, stacklevel=3)

    def build(self, sources: dict[str, Source], encoder: PromptEncoder, hold_out: tuple[str, float, int] | None = None
              ) -> dict:
        """Encodes ``sources`` (``{split: source}``) into the entry and returns its metadata.

        With ``hold_out=(split, val_size, seed[, cap])`` the single source is split: ``held_out_count(val_size, n,
        cap)`` of its n rows, chosen by ``random.Random(seed)``'s shuffle of the row indices, go to ``split``
        (``validation``) and the others to ``train``; long prompts are dropped (or raise) before the split is
        drawn, and the draw is over all n rows, so it does not depend on the length limit.

        The files' sizes and checksums go into ``meta.json`` before the folder is renamed into place. If an entry
        is there already (another process built it first), it is kept if it passes its checks and this build is
        dropped; otherwise it is moved aside (:meth:`verified_meta`) and the rename retried.
        """
        tmp = self.path.parent / f".{self.path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
        except OSError as err:
            raise PromptCacheError(f"prompt cache: cannot write to the folder {self.path.parent} ({err}); set "
                                   f"{CACHE_DIR_OPTION} to a writable folder") from err
        try:
            meta = {"key": self.key_fields, "splits": {}, "dropped": {}, "source_rows": {}, "unknown_tokens": {}}
            if hold_out is None:
                for split, source in sources.items():
                    writer = _Writer(tmp / f"{split}.arrow")
                    encoder.counts = {"tokens": 0, "unknown": 0}
                    n, dropped = _encode_into(source, encoder, writer)
                    writer.close()
                    meta["splits"][split], meta["source_rows"][split] = writer.rows, n
                    meta["unknown_tokens"][split] = [encoder.counts["unknown"], encoder.counts["tokens"]]
                    if dropped:
                        meta["dropped"][split] = len(dropped)
            else:
                self._build_split(tmp, next(iter(sources.values())), encoder, meta, *hold_out)
            meta["files"] = {f"{split}.arrow": {"bytes": (tmp / f"{split}.arrow").stat().st_size,
                                                CHECKSUM: _file_digest(tmp / f"{split}.arrow")}
                             for split in meta["splits"]}
            meta = _as_json(meta)
            meta["checksum"] = _meta_checksum(meta)
            with _writing(tmp / "meta.json"):
                (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            return self._put_in_place(tmp, meta)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _put_in_place(self, tmp: Path, meta: dict) -> dict:
        """Renames the complete folder ``tmp`` to the entry; the metadata of the entry in place in the end."""
        error = None
        for _ in range(RENAME_TRIES):
            try:
                os.rename(tmp, self.path)
                return meta
            except OSError as err:
                error = err
            verdict = self._inspect()  # what is in the way
            if verdict.meta is not None:  # another process completed the same entry first: its rows are these rows
                shutil.rmtree(tmp, ignore_errors=True)
                return verdict.meta
            if verdict.problem is not None:  # it fails its checks: never kept, whoever put it there
                self._move_aside(verdict)
        raise PromptCacheError(f"prompt cache entry {self.path}: cannot rename the built entry into place after "
                               f"{RENAME_TRIES} tries ({error}); set {CACHE_DIR_OPTION} to a writable folder "
                               "that only rloo_lightning writes to")

    @staticmethod
    def _build_split(tmp: Path, source: Source, encoder: PromptEncoder, meta: dict, val_split: str, val_size: float,
                     seed: int, cap: int | None = None) -> None:
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        everything = _Writer(tmp / "all.arrow")
        encoder.counts = {"tokens": 0, "unknown": 0}
        n, dropped = _encode_into(source, encoder, everything)
        everything.close()
        meta["unknown_tokens"]["all"] = [encoder.counts["unknown"], encoder.counts["tokens"]]
        order = list(range(n))
        random.Random(seed).shuffle(order)
        is_val = np.zeros(n, dtype=bool)
        is_val[order[:held_out_count(val_size, n, cap)]] = True
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
