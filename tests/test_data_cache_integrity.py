"""What is on disk is never silently wrong: a prompt cache entry that fails its checks is named, moved aside and
rebuilt; a good one yields the same prompts as before."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
from test_data_cache import _rows, _write_jsonl

from rloo_lightning.data import PromptDataModule, PromptRows
from rloo_lightning.data.cache import CHECKSUM, PromptCacheError, PromptCacheWarning

ROOT = Path(__file__).resolve().parents[1]



def _dm(tok_dir, cache, data, **kw):
    return PromptDataModule(tokenizer_name_or_path=tok_dir, cache_dir=str(cache), train_file=data, val_size=30,
                            batch_size=2, **kw)


def _cache(tok_dir, tmp_path, data, **kw):
    """The entry's ``PromptCache``, its sources and hold-out rule, and the data module's encoder."""
    dm = _dm(tok_dir, tmp_path / "c", data, **kw)
    dm._load_tokenizer()
    (cache, sources, hold_out), = dm._caches("fit")
    return cache, sources, hold_out, dm.encoder


@pytest.fixture
def entry(tiny_model_dir, tmp_path, builds):
    """A built entry: ``(folder, data file, training rows, validation rows)``, opened without a warning."""
    data = _write_jsonl(tmp_path / "train.jsonl", _rows(300))
    dm = _start(tiny_model_dir, tmp_path, data, expect_warning=False)
    (folder,) = (tmp_path / "c").iterdir()
    assert len(builds) == 1
    return folder, data, list(dm.train_rows), list(dm.val_rows)


def _start(tok_dir, tmp_path, data, expect_warning):
    """A fresh data module's ``setup("fit")``; with ``expect_warning=False`` any PromptCacheWarning fails."""
    dm = _dm(tok_dir, tmp_path / "c", data)
    with warnings.catch_warnings():
        if not expect_warning:
            warnings.simplefilter("error", PromptCacheWarning)
        dm.setup("fit")
    return dm


def _names(cache):
    return sorted(p.name for p in cache.iterdir())


def _aside(folder, kind="corrupt"):
    (aside,) = [p for p in folder.parent.iterdir() if p.name.startswith(f"{folder.name}.{kind}-")]
    assert re.fullmatch(rf"{re.escape(folder.name)}\.{kind}-\d{{8}}-\d{{6}}-\d+-[0-9a-f]{{6}}", aside.name)
    return aside


def _rebuilt_alike(tiny_model_dir, tmp_path, entry, builds, warning):
    """The next start warns (``warning``: a regex, after the entry's folder), moves the entry aside, rebuilds it
    with the same rows; the start after that opens it without a warning or a build. Returns the folder moved
    aside."""
    folder, data, train, val = entry
    with pytest.warns(PromptCacheWarning, match=re.escape(f"prompt cache entry {folder}: ") + warning) as caught:
        dm = _start(tiny_model_dir, tmp_path, data, expect_warning=True)
    assert len(caught) == 1 and "Moved aside to" in str(caught[0].message)
    assert len(builds) == 2
    assert list(dm.train_rows) == train and list(dm.val_rows) == val
    again = _start(tiny_model_dir, tmp_path, data, expect_warning=False)
    assert len(builds) == 2 and list(again.train_rows) == train
    return folder.parent / re.search(r"Moved aside to (\S+) ", str(caught[0].message)).group(1)


# ---------------------------------------------------------------------------------------------
# the manifest: written at build time, checked at every open
# ---------------------------------------------------------------------------------------------
def test_the_manifest_records_every_files_size_and_checksum(entry):
    folder = entry[0]
    meta = json.loads((folder / "meta.json").read_text())
    assert set(meta["files"]) == {"train.arrow", "validation.arrow"} == {p.name for p in folder.glob("*.arrow")}
    for name, record in meta["files"].items():
        content = (folder / name).read_bytes()
        assert record == {"bytes": len(content), CHECKSUM: hashlib.new(CHECKSUM, content).hexdigest()}
    assert meta["splits"] == {"train": 270, "validation": 30}


def test_a_truncated_file_is_named_moved_aside_and_rebuilt(tiny_model_dir, tmp_path, entry, builds):
    folder = entry[0]
    size = (folder / "train.arrow").stat().st_size
    os.truncate(folder / "train.arrow", size // 3)
    aside = _rebuilt_alike(tiny_model_dir, tmp_path, entry, builds,
                           rf"train.arrow is truncated: {size // 3} bytes, {size} when it was built")
    assert aside == _aside(folder) and (aside / "train.arrow").stat().st_size == size // 3  # kept as it was
    assert _names(tmp_path / "c") == sorted([folder.name, aside.name])  # no temporary folder left


def _swap_prompt_letters(path: Path, count: int = 256) -> int:
    """Overwrites ``count`` bytes of the prompts' text in place (a letter for another: the same size, the Arrow
    structure intact), keeping the file's modification time as ``cp -p`` or ``rsync -t`` would. Returns the
    offset."""
    content = path.read_bytes()
    run = re.search(rb'[a-h="]{%d,}' % count, content)  # the prompt column's JSON text
    assert run, "no prompt text found in the Arrow file"
    start = run.start()
    swapped = bytes(b"bcdefgha"[b - 97] if 97 <= b <= 104 else b for b in content[start:start + count])
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(swapped)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    return start


def test_a_same_size_change_in_place_is_detected_whatever_the_mtime(tiny_model_dir, tmp_path, entry, builds):
    folder, data, train, val = entry
    _swap_prompt_letters(folder / "train.arrow")
    # Unchecked, the changed file opens without an error and yields other prompts: what the check prevents.
    changed = list(PromptRows.open(folder / "train.arrow"))
    assert len(changed) == len(train) and changed != train
    aside = _rebuilt_alike(tiny_model_dir, tmp_path, entry, builds,
                           rf"train.arrow does not match its {CHECKSUM} checksum: its size is the one it was built "
                           "with, its content changed")
    assert list(PromptRows.open(aside / "train.arrow")) == changed  # kept as it was


@pytest.mark.parametrize("name", ["validation.arrow", "meta.json"])
def test_a_missing_file_of_an_entry_is_named_and_the_entry_rebuilt(tiny_model_dir, tmp_path, entry, builds, name):
    folder = entry[0]
    (folder / name).unlink()
    aside = _rebuilt_alike(tiny_model_dir, tmp_path, entry, builds, rf"{re.escape(name)} is missing")
    assert not (aside / name).exists() and _aside(folder) == aside


@pytest.mark.parametrize("damage,problem", [
    ("edit", r"meta.json does not match its own checksum \(edited or damaged after it was written\)"),
    ("truncate", r"meta.json is not valid JSON \(\d+ bytes: truncated or overwritten\)"),
])
def test_a_damaged_meta_json_is_named_and_the_entry_rebuilt(tiny_model_dir, tmp_path, entry, builds, damage,
                                                            problem):
    meta_path = entry[0] / "meta.json"
    if damage == "edit":  # still valid JSON, one count changed
        meta = json.loads(meta_path.read_text())
        meta["splits"]["validation"] -= 1
        meta_path.write_text(json.dumps(meta))
    else:
        os.truncate(meta_path, meta_path.stat().st_size // 2)
    _rebuilt_alike(tiny_model_dir, tmp_path, entry, builds, problem)


def test_an_entry_of_an_older_version_without_checksums_is_moved_aside_as_unverified(tiny_model_dir, tmp_path,
                                                                                      entry, builds):
    folder = entry[0]
    meta = json.loads((folder / "meta.json").read_text())
    del meta["files"], meta["checksum"]  # what the version before checksums wrote
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))
    aside = _rebuilt_alike(tiny_model_dir, tmp_path, entry, builds,
                           r"meta.json has no checksums \(an entry written by a version of rloo_lightning that did "
                           r"not record them\), so its files cannot be verified")
    assert aside == _aside(folder, "unverified")


def test_an_entry_renamed_to_another_key_is_not_used(tiny_model_dir, tmp_path, entry, builds):
    folder, data, train, _ = entry
    cache = _cache(tiny_model_dir, tmp_path, data, seed=7)[0]  # another key: another folder
    os.rename(folder, cache.path)  # the old rows under the new key's name
    other = _dm(tiny_model_dir, tmp_path / "c", data, seed=7)
    with pytest.warns(PromptCacheWarning, match=re.escape(f"{cache.path}: meta.json records another key")):
        other.setup("fit")
    assert len(builds) == 2 and sorted(r["row"] for r in other.val_rows) != sorted(r["row"] for r in entry[3])


# ---------------------------------------------------------------------------------------------
# opening without a rebuild, the race logic, errors that remain
# ---------------------------------------------------------------------------------------------
def test_open_of_a_bad_entry_names_it_instead_of_arrows_message(entry, tmp_path, tiny_model_dir):
    folder, data = entry[:2]
    size = (folder / "train.arrow").stat().st_size
    os.truncate(folder / "train.arrow", size - 100)
    cache = _cache(tiny_model_dir, tmp_path, data)[0]
    with pytest.raises(PromptCacheError, match=re.escape(f"prompt cache entry {folder}: train.arrow is truncated")
                       ) as err:
        cache.open()
    assert "Expected to be able to read" not in str(err.value)
    assert (folder / "train.arrow").exists()  # open moves nothing


def test_a_build_that_finds_a_corrupt_entry_in_place_never_keeps_it(tiny_model_dir, tmp_path, entry, builds):
    """The race logic: the rename finds an entry there. A good one is kept (tests/test_data_cache.py); a bad one
    is moved aside and the rename retried."""
    folder, data, train, val = entry
    _swap_prompt_letters(folder / "train.arrow")
    cache, sources, hold_out, encoder = _cache(tiny_model_dir, tmp_path, data)
    with pytest.warns(PromptCacheWarning, match=re.escape(f"{folder}: train.arrow does not match")):
        meta = cache.build(sources, encoder, hold_out)  # as a competing process whose rename comes second
    assert meta == cache.verify()
    splits = cache.open()
    assert list(splits["train"]) == train and list(splits["validation"]) == val
    assert _names(tmp_path / "c") == sorted([folder.name, _aside(folder).name])


def test_moving_aside_leaves_a_fresh_entry_that_took_the_bad_ones_place(tiny_model_dir, tmp_path, entry):
    folder, data, train, _ = entry
    cache, sources, hold_out, encoder = _cache(tiny_model_dir, tmp_path, data)
    os.truncate(folder / "train.arrow", 10)
    verdict = cache._inspect()
    assert verdict.problem and verdict.meta is None
    # Meanwhile another process moves the bad entry aside and builds a good one in its place.
    os.rename(folder, tmp_path / "c" / "elsewhere")
    cache.build(sources, encoder, hold_out)
    fresh = os.stat(folder).st_ino
    with pytest.warns(PromptCacheWarning, match="another process has already replaced it"):
        cache._move_aside(verdict)
    assert os.stat(folder).st_ino == fresh and list(cache.open()["train"]) == train
    assert _names(tmp_path / "c") == sorted(["elsewhere", folder.name])
    # ... or it has moved the bad entry aside and not built yet: nothing to move
    os.rename(folder, tmp_path / "c" / "fresh")
    with pytest.warns(PromptCacheWarning, match="another process has already moved it aside"):
        cache._move_aside(verdict)


def test_a_bad_entry_that_cannot_be_moved_aside_names_it_and_the_option(tiny_model_dir, tmp_path, entry,
                                                                        monkeypatch):
    folder, data = entry[:2]
    (folder / "validation.arrow").unlink()
    rename = os.rename

    def refusing(src, dst, *a, **k):
        if ".corrupt-" in str(dst):
            raise PermissionError(13, "Permission denied", str(src))
        return rename(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", refusing)
    with pytest.raises(PromptCacheError, match=re.escape(f"prompt cache entry {folder}: validation.arrow is "
                                                         "missing; it cannot be moved aside") + r".*data\.cache_dir"):
        _dm(tiny_model_dir, tmp_path / "c", data).setup("fit")


def test_a_cache_folder_that_cannot_be_written_is_named_with_the_option(tiny_model_dir, tmp_path):
    data = _write_jsonl(tmp_path / "train.jsonl", _rows(40))
    (tmp_path / "a_file").write_text("")
    with pytest.raises(PromptCacheError, match=re.escape(f"prompt cache: cannot write to the folder "
                                                         f"{tmp_path / 'a_file' / 'c'}") + r".*data\.cache_dir"):
        _dm(tiny_model_dir, tmp_path / "a_file" / "c", data).setup("fit")


# ---------------------------------------------------------------------------------------------
# two processes open the same corrupt entry at once
# ---------------------------------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import json, os, sys, time, warnings
    tok, cache, data, go, out = sys.argv[1:]
    from rloo_lightning.data import PromptDataModule
    dm = PromptDataModule(tokenizer_name_or_path=tok, cache_dir=cache, train_file=data, val_size=30, batch_size=2)
    dm._load_tokenizer()
    open(out + ".ready", "w").close()
    while not os.path.exists(go):
        time.sleep(0.002)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.setup("fit")
    json.dump({"train": list(dm.train_rows), "validation": list(dm.val_rows),
               "warnings": [str(w.message) for w in caught if w.category.__name__ == "PromptCacheWarning"]},
              open(out, "w"))
""")


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "same size"])
def test_two_processes_opening_a_corrupt_entry_together(tiny_model_dir, tmp_path, entry, damage):
    folder, data, train, val = entry
    if damage == "truncate":
        os.truncate(folder / "train.arrow", (folder / "train.arrow").stat().st_size // 2)
    else:
        _swap_prompt_letters(folder / "train.arrow")
    go = tmp_path / "go"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    outs = [tmp_path / f"out{i}.json" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, tiny_model_dir, str(tmp_path / "c"), data, str(go),
                               str(out)], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for out in outs]
    deadline = time.monotonic() + 120
    while not all(Path(f"{out}.ready").exists() for out in outs):  # both imported, about to open the entry
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.01)
    go.touch()
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    results = [json.loads(out.read_text()) for out in outs]
    for result in results:  # both: the rows of the good entry
        assert result["train"] == train and result["validation"] == val
    warned = [w for r in results for w in r["warnings"]]
    assert warned and all(w.startswith(f"prompt cache entry {folder}: train.arrow ") for w in warned)
    # One good entry, the bad one kept aside once, no temporary folder left.
    assert _names(tmp_path / "c") == sorted([folder.name, _aside(folder).name])
    assert list(_cache(tiny_model_dir, tmp_path, data)[0].open()["train"]) == train
