"""The prompt cache: rows in memory-mapped Arrow, built once, keyed by everything that decides them."""

from __future__ import annotations

import datetime
import json
import os
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from rloo_lightning.data import PromptDataModule, PromptRows, ResumableSampler
from rloo_lightning.data.validation_split import held_out_count


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rows(n):
    letters = "abcdefgh"
    return [{"prompt": letters[i % 8] + letters[(i // 8) % 8] + letters[(i // 64) % 8] + "=", "id": i}
            for i in range(n)]


def _dm(tok_dir, cache, **kw):
    kw.setdefault("batch_size", 2)
    return PromptDataModule(tokenizer_name_or_path=tok_dir, cache_dir=str(cache), **kw)


def _entries(cache):
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


# ---------------------------------------------------------------------------------------------
# built once, opened after
# ---------------------------------------------------------------------------------------------
def test_second_start_opens_the_cache_without_reading_the_source(tiny_model_dir, tmp_path, builds, monkeypatch):
    data = _write_jsonl(tmp_path / "train.jsonl", _rows(50))
    first = _dm(tiny_model_dir, tmp_path / "c", train_file=data, val_size=10)
    first.setup("fit")
    assert len(builds) == 1 and len(first.train_rows) == 40 and len(first.val_rows) == 10

    import rloo_lightning.data.sources as sources

    def no_reading(*a, **k):
        raise AssertionError("the source was read on a cache hit")

    monkeypatch.setattr(sources, "_jsonl_rows", no_reading)
    second = _dm(tiny_model_dir, tmp_path / "c", train_file=data, val_size=10)
    second.setup("fit")
    assert len(builds) == 1  # not rebuilt
    assert list(second.train_rows) == list(first.train_rows) and list(second.val_rows) == list(first.val_rows)


def test_rows_are_memory_mapped_and_readable_by_datasets(tiny_model_dir, tmp_path):
    data = _write_jsonl(tmp_path / "train.jsonl", _rows(3000))
    dm = _dm(tiny_model_dir, tmp_path / "c", train_file=data, val_size=0.1)
    dm.prepare_data()
    before = pa.total_allocated_bytes()
    dm.setup("fit")
    table = dm.train_rows.table
    # Opening allocates nothing from Arrow's pool: the buffers are the file's pages.
    assert pa.total_allocated_bytes() - before < 4096 < table.nbytes
    import datasets

    (entry,) = (tmp_path / "c").iterdir()
    ds = datasets.Dataset.from_file(str(entry / "train.arrow"))
    assert len(ds) == len(dm.train_rows) == 2700
    assert ds[0]["input_ids"] == dm.train_rows[0]["input_ids"]


def test_split_matches_the_seeded_shuffle_of_all_rows(tiny_model_dir, tmp_path):
    rows = _rows(5000)
    data = _write_jsonl(tmp_path / "train.jsonl", rows)
    dm = _dm(tiny_model_dir, tmp_path / "c", train_file=data, val_size=0.1, seed=3)
    dm.setup("fit")
    order = list(range(len(rows)))
    random.Random(3).shuffle(order)
    held = set(order[:held_out_count(0.1, len(rows))])
    assert {r["row"] for r in dm.val_rows} == held
    assert sorted(r["row"] for r in dm.train_rows) == sorted(set(range(len(rows))) - held)
    for r in [*dm.train_rows[:50], *dm.val_rows[:50]]:  # each row keeps its own columns and source index
        assert r["columns"]["id"] == r["row"] and r["prompt"] == rows[r["row"]]["prompt"]


# ---------------------------------------------------------------------------------------------
# the key: a change of anything that decides the rows rebuilds
# ---------------------------------------------------------------------------------------------
def _chat_model(src, dst, template):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    tok.chat_template = template
    dst.mkdir()
    tok.save_pretrained(dst)
    shutil.copy(src / "config.json", dst / "config.json")  # the context length
    return str(dst)


def test_every_part_of_the_key_rebuilds(tiny_model_dir, tiny_model_dir_pad_eos, tmp_path, builds):
    data = tmp_path / "train.jsonl"
    _write_jsonl(data, _rows(30))
    cache = tmp_path / "c"
    base = dict(train_file=str(data), val_size=5)
    chat1 = _chat_model(Path(tiny_model_dir), tmp_path / "chat1",
                        "{% for m in messages %}u:{{ m['content'] }};{% endfor %}a:")
    chat2 = _chat_model(Path(tiny_model_dir), tmp_path / "chat2",
                        "{% for m in messages %}U{{ m['content'] }}{% endfor %}A")
    variants = [
        (tiny_model_dir, {}),
        (tiny_model_dir_pad_eos, {}),  # another tokenizer (its special tokens differ)
        (chat1, {}),  # a chat template
        (chat2, {}),  # another chat template
        (chat1, {"system_prompt": "ab"}),
        (tiny_model_dir, {"max_prompt_length": 4, "on_long_prompt": "drop"}),
        (tiny_model_dir, {"max_prompt_length": 4, "on_long_prompt": "drop", "max_new_tokens": 4}),  # same limit
        (tiny_model_dir, {"max_new_tokens": 20}),  # the context's room is the limit
        (tiny_model_dir, {"val_size": 6}),
        (tiny_model_dir, {"seed": 1}),
        (tiny_model_dir, {"use_chat_template": False}),
    ]
    paths = []
    for tok, kw in variants:
        dm = _dm(tok, cache, **{**base, **kw})
        dm.setup("fit")
        paths.append(builds[-1] if builds else None)
    n = len(builds)
    # each variant built its own entry, except the one whose effective limit did not change
    assert n == len(variants) - 1 and len(set(builds)) == n
    # The source's identity: rewriting the file rebuilds, even at the same size.
    _write_jsonl(data, [{**r, "id": r["id"] + 1000} for r in _rows(30)])
    os.utime(data, ns=(1, 1))
    dm = _dm(tiny_model_dir, cache, **base)
    dm.setup("fit")
    assert len(builds) == n + 1 and dm.train_rows[0]["columns"]["id"] >= 1000
    # ... and nothing changed, nothing rebuilt
    _dm(tiny_model_dir, cache, **base).setup("fit")
    assert len(builds) == n + 1


def test_use_chat_template_auto_and_true_share_an_entry_only_if_they_encode_alike(tiny_model_dir, tmp_path, builds):
    data = _write_jsonl(tmp_path / "train.jsonl", _rows(12))
    _dm(tiny_model_dir, tmp_path / "c", train_file=data, val_size=2).setup("fit")
    _dm(tiny_model_dir, tmp_path / "c", train_file=data, val_size=2, use_chat_template="auto").setup("fit")
    assert len(builds) == 1  # the same options


# ---------------------------------------------------------------------------------------------
# checks happen in the conversion, errors name the row, nothing half-written stays
# ---------------------------------------------------------------------------------------------
def test_a_bad_row_stops_the_build_and_leaves_no_entry(tiny_model_dir, tmp_path):
    rows = _rows(3000)
    rows[2500]["prompt"] = ""
    data = _write_jsonl(tmp_path / "train.jsonl", rows)
    cache = tmp_path / "c"
    with pytest.raises(ValueError, match=r"train.jsonl line 2501: prompt column 'prompt' must be a non-empty"):
        _dm(tiny_model_dir, cache, train_file=data).setup("fit")
    assert _entries(cache) == []  # no entry, no temporary folder


def test_malformed_jsonl_line_is_reported_by_its_line_number(tiny_model_dir, tmp_path):
    path = tmp_path / "train.jsonl"
    lines = [json.dumps(r) for r in _rows(10)]
    lines.insert(3, "")  # a blank line is skipped, and still counted as a line
    lines[6] = '{"prompt": "ab=", '
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"train.jsonl line 7: not valid JSON"):
        _dm(tiny_model_dir, tmp_path / "c", train_file=str(path)).setup("fit")


def test_long_prompts_error_names_the_row_or_are_dropped_and_counted_on_every_start(tiny_model_dir, tmp_path, caplog):
    rows = _rows(40)
    for i in (7, 21, 33):
        rows[i]["prompt"] = "abcdefgh" * 2 + "="
    data = _write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(ValueError, match=r"train.jsonl line 8: prompt of 17 tokens exceeds max_prompt_length=8"):
        _dm(tiny_model_dir, tmp_path / "c", train_file=data, max_prompt_length=8).setup("fit")
    for _ in range(2):  # built, then opened: the counts come back from the cache
        dm = _dm(tiny_model_dir, tmp_path / "c", train_file=data, max_prompt_length=8, on_long_prompt="drop",
                 val_size=0)
        dm.setup("fit")
        assert dm.dropped == {"train": 3} and len(dm.train_rows) == 37
        assert {r["row"] for r in dm.train_rows} == set(range(40)) - {7, 21, 33}


def test_column_values_round_trip_exactly(tiny_model_dir, tmp_path):
    rows = [{"prompt": "ab=", "answer": "ba", "nested": {"a": [1, 2.5, None], "b": "é✓"}, "flag": True,
             "big": 2 ** 53 + 1, "small": 1e-300},
            {"prompt": [{"role": "user", "content": "cd="}], "answer": None}]
    chat = tmp_path / "chat"
    chat_dir = _chat_model(Path(tiny_model_dir), chat, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    dm = _dm(chat_dir, tmp_path / "c", train_file=_write_jsonl(tmp_path / "t.jsonl", rows), val_size=0, batch_size=1)
    dm.setup("fit")
    got = sorted(dm.train_rows, key=lambda r: r["row"])
    assert got[0]["columns"] == {k: v for k, v in rows[0].items() if k != "prompt"}
    assert got[1]["prompt"] == rows[1]["prompt"] and got[1]["columns"] == {"answer": None}


def test_a_value_json_cannot_hold_is_named_with_its_row_and_column(tiny_model_dir, tmp_path):
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["ab=", "cd="], "when": [datetime.datetime(2020, 1, 1), datetime.datetime(2021, 1, 1)]})
    pq.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"t.parquet row 1: column 'when' holds a datetime value"):
        _dm(tiny_model_dir, tmp_path / "c", train_file=str(tmp_path / "t.parquet"), val_size=0, batch_size=1
            ).setup("fit")
    assert _entries(tmp_path / "c") == []


def test_a_competing_builder_of_the_same_entry_is_harmless(tiny_model_dir, tmp_path):
    data = _write_jsonl(tmp_path / "train.jsonl", _rows(20))
    a = _dm(tiny_model_dir, tmp_path / "c", train_file=data, val_size=4)
    b = _dm(tiny_model_dir, tmp_path / "c", train_file=data, val_size=4)
    for dm in (a, b):
        dm._load_tokenizer()
    (ca, sa, ha), = a._caches("fit")
    (cb, sb, hb), = b._caches("fit")
    ca.build(sa, a.encoder, ha)
    cb.build(sb, b.encoder, hb)  # finds the entry complete when it renames: drops its own copy
    assert _entries(tmp_path / "c") == [ca.path.name]
    a.setup("fit")
    assert len(a.train_rows) == 16


def test_prepare_data_builds_what_the_stage_reads(tiny_model_dir, tmp_path, builds):
    import lightning.pytorch as L

    data = _write_jsonl(tmp_path / "p.jsonl", _rows(5))
    dm = _dm(tiny_model_dir, tmp_path / "c", predict_file=data)
    dm.trainer = L.Trainer(logger=False, enable_checkpointing=False)
    from lightning.pytorch.trainer.states import TrainerFn

    dm.trainer.state.fn = TrainerFn.PREDICTING
    dm.prepare_data()
    assert len(builds) == 1 and "predict" in builds[0].name
    dm.setup(TrainerFn.PREDICTING)
    assert len(builds) == 1 and len(dm.predict_rows) == 5


# ---------------------------------------------------------------------------------------------
# the sampler at scale: the same order as a list-based DistributedSampler, without the lists
# ---------------------------------------------------------------------------------------------
def _reference_order(n, world, rank, seed, epoch, batch, repeat):
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    order = torch.randperm(n, generator=g).tolist()
    total = (n // world) * world
    order = order[:total][rank:total:world]
    batches = [order[i:i + batch] for i in range(0, len(order) - batch + 1, batch)]
    return [i for b in batches for _ in range(repeat) for i in b]


@pytest.mark.parametrize("n,world,batch,repeat,consumed", [(1_000_000, 1, 8, 1, 0), (1_000_003, 2, 4, 2, 250_001),
                                                          (97, 3, 5, 1, 13), (97, 3, 5, 3, 40)])
def test_sampler_order_at_a_million_rows(n, world, batch, repeat, consumed):
    for rank in range(world):
        sampler = ResumableSampler(range(n), num_replicas=world, rank=rank, seed=5, batch_size=batch,
                                   position=lambda: consumed, repeat=repeat)
        per_epoch = (n // world // batch) * repeat
        epoch, done = divmod(consumed, per_epoch)
        expected = _reference_order(n, world, rank, 5, epoch, batch, repeat)[done * batch:]
        got = list(iter(sampler))
        assert got == expected


def test_prompt_rows_sequence_behaviour():
    rows = PromptRows.from_rows([{"input_ids": [i, i + 1], "prompt": f"p{i}", "columns": {"i": i}} for i in range(5)])
    assert len(rows) == 5 and rows[-1]["prompt"] == "p4" and rows[1:3] == [rows[1], rows[2]]
    assert rows.__getitems__([4, 0]) == [rows[4], rows[0]]
    with pytest.raises(IndexError):
        rows[5]
    assert [r["row"] for r in rows] == list(range(5))


def test_batches_carry_each_prompts_source_row(tiny_model_dir, tmp_path):
    rows = _rows(64)
    data = _write_jsonl(tmp_path / "train.jsonl", rows)
    dm = _dm(tiny_model_dir, tmp_path / "c", train_file=data, val_size=8, batch_size=4)
    dm.setup("fit")
    seen = []
    for batch in dm.train_dataloader():
        assert batch["row_index"].dtype == torch.long and batch["row_index"].shape == (4,)
        for i, prompt, ident in zip(batch["row_index"].tolist(), batch["prompt"], batch["columns"]["id"]):
            assert prompt == rows[i]["prompt"] and ident == i
        seen += batch["row_index"].tolist()
    assert sorted(seen) == sorted(r["row"] for r in dm.train_rows)
    assert dm.sample_batch(3, seed=1)["row_index"].tolist() == [r["row"] for r in dm.train_rows.__getitems__(
        torch.randperm(len(dm.train_rows), generator=torch.Generator().manual_seed(1))[:3].tolist())]
