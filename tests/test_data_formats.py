"""PromptDataModule on every local format, chat templates, long prompts and the split.

Complements tests/test_data_module.py (which covers .jsonl/.json basics, collate and the generic errors).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from rloo_lightning.data import PromptDataModule, collate_prompts, read_rows

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """``datasets.load_dataset`` writes its Arrow cache under the test's tmp dir, not ~/.cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets_cache")


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """Char tokenizer whose alphabet covers the template's output, with a small chat template."""
    from rloo_lightning.models import build_char_tokenizer, build_tiny_llama

    directory = tmp_path_factory.mktemp("tiny_chat")
    tok = build_char_tokenizer("abcdefgh=su:;", model_max_length=64)
    tok.chat_template = CHAT_TEMPLATE
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=64)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory)


def _rows(n, start=0):
    letters = "abcdefgh"
    out = []
    for i in range(start, start + n):
        word = letters[i % 8] + letters[(i // 8) % 8] + letters[(i * 3) % 8]
        out.append({"prompt": word + "=", "answer": word[::-1], "id": i, "weight": i / 4})
    return out


def _write(path, rows):
    """Write ``rows`` in the format named by ``path``'s extension; returns ``str(path)``."""
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".csv":
        datasets.Dataset.from_list(rows).to_csv(str(path))
    elif suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif suffix == ".arrow":
        # An Arrow IPC stream file, as Dataset.save_to_disk writes its shards (data-00000-of-00001.arrow).
        import pyarrow as pa

        table = pa.Table.from_pylist(rows)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    else:
        raise AssertionError(suffix)
    return str(path)


def _dm(model_dir, train_file, **kwargs):
    kwargs.setdefault("batch_size", 2)
    return PromptDataModule(tokenizer_name_or_path=model_dir, train_file=train_file, **kwargs)


# ---------------------------------------------------------------------------------------------
# local formats
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".arrow", ".json", ".jsonl"])
def test_every_local_format_reads_rows_and_columns(tiny_model_dir, tmp_path, suffix):
    rows = _rows(6)
    rows[2]["prompt"] = "abcdefgh="  # longest: the others are left-padded
    path = _write(tmp_path / f"train{suffix}", rows)
    # val_file = the same file: the validation loader keeps the file's order (no shuffle, no split)
    dm = _dm(tiny_model_dir, path, val_file=path, batch_size=6)
    dm.setup("fit")
    tok = dm.tokenizer
    assert [r["prompt"] for r in dm.train_rows] == [r["prompt"] for r in rows]
    assert [r["input_ids"] for r in dm.val_rows] == [tok(r["prompt"])["input_ids"] for r in rows]
    batch = next(iter(dm.val_dataloader()))
    assert batch["prompt"] == [r["prompt"] for r in rows]
    # every extra column reaches the collated batch, values and types intact
    assert batch["columns"] == {
        "answer": [r["answer"] for r in rows],
        "id": [r["id"] for r in rows],
        "weight": [r["weight"] for r in rows],
    }
    assert all(type(v) is int for v in batch["columns"]["id"])
    width = batch["input_ids"].shape[1]
    assert width == len("abcdefgh=")
    assert batch["attention_mask"][0].tolist() == [0] * (width - 4) + [1] * 4
    assert batch["input_ids"][0, : width - 4].eq(tok.pad_token_id).all()


def test_read_rows_names_file_and_row(tmp_path):
    path = _write(tmp_path / "d.parquet", _rows(3))
    pairs = read_rows(path)
    assert [w for w, _ in pairs] == [f"{path} row {i}" for i in (1, 2, 3)]  # counted from 1
    assert [r for _, r in pairs] == _rows(3)


def test_folder_of_mixed_files_reads_all_in_sorted_path_order(tiny_model_dir, tmp_path):
    folder = tmp_path / "data"
    # written out of order: the order read is the sorted paths, not creation order
    _write(folder / "sub" / "c.parquet", _rows(2, start=20))
    _write(folder / "b.csv", _rows(3, start=10))
    _write(folder / "a.jsonl", _rows(2, start=0))
    _write(folder / "d.arrow", _rows(2, start=30))
    _write(folder / "a2.json", _rows(1, start=40))
    (folder / "README.txt").write_text("not data\n")  # ignored: unsupported extension
    expected_ids = [0, 1, 40, 10, 11, 12, 30, 31, 20, 21]  # a.jsonl a2.json b.csv d.arrow sub/c.parquet

    pairs = read_rows(str(folder))
    assert [r["id"] for _, r in pairs] == expected_ids
    assert pairs[3][0].endswith("b.csv row 1") and pairs[-1][0].endswith("c.parquet row 2")
    assert read_rows(str(folder)) == pairs  # deterministic

    dm = _dm(tiny_model_dir, str(folder), val_file=str(folder), batch_size=4, val_batch_size=len(expected_ids))
    dm.setup("fit")
    assert sorted(r["columns"]["id"] for r in dm.train_rows) == sorted(expected_ids)
    batch = next(iter(dm.val_dataloader()))
    assert batch["columns"]["id"] == expected_ids
    by_id = {r["id"]: r for r in _rows(50)}
    assert batch["prompt"] == [by_id[i]["prompt"] for i in expected_ids]
    assert batch["columns"]["answer"] == [by_id[i]["answer"] for i in expected_ids]


def test_error_in_a_folder_names_the_file_and_row(tiny_model_dir, tmp_path):
    folder = tmp_path / "data"
    _write(folder / "a.jsonl", _rows(3))
    bad = _rows(3, start=10)
    bad[1] = {"question": "abc=", "answer": "cba", "id": 11, "weight": 0.0}
    _write(folder / "b.parquet", bad)
    dm = _dm(tiny_model_dir, str(folder), val_file=str(folder))
    with pytest.raises(ValueError, match=r"b\.parquet row 2.*'prompt'"):
        dm.setup("fit")


def test_folder_without_data_files_raises(tiny_model_dir, tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    dm = _dm(tiny_model_dir, str(tmp_path))
    with pytest.raises(ValueError, match=str(tmp_path)):
        dm.setup("fit")


def test_extra_columns_reach_collate_with_missing_as_none(tiny_model_dir, tmp_path):
    rows = [{"prompt": "abc=", "answer": "cba", "meta": {"level": 2}, "tags": ["x", "y"]},
            {"prompt": "hgf=", "answer": "fgh"}]
    path = _write(tmp_path / "t.jsonl", rows)
    dm = _dm(tiny_model_dir, path, val_file=path)
    dm.setup("fit")
    batch = collate_prompts(dm.val_rows, dm.tokenizer.pad_token_id)
    assert batch["columns"] == {"answer": ["cba", "fgh"], "meta": [{"level": 2}, None], "tags": [["x", "y"], None]}


def test_unknown_dataset_name_offline_raises_naming_it(tiny_model_dir):
    dm = _dm(tiny_model_dir, "no_such_org_xyz/no_such_dataset_xyz")
    with pytest.raises(ValueError, match="no_such_org_xyz/no_such_dataset_xyz"):
        dm.setup("fit")


@pytest.mark.parametrize("name", ["./missing.jsonl", "missing.parquet", "./nowhere/data"])
def test_nonexistent_local_path_raises_naming_it(tiny_model_dir, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    dm = _dm(tiny_model_dir, name)
    with pytest.raises(ValueError, match="does not exist") as err:
        dm.setup("fit")
    assert name in str(err.value)


def test_unsupported_extension_raises(tiny_model_dir, tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("abc=\nhgf=\n")
    dm = _dm(tiny_model_dir, str(path))
    with pytest.raises(ValueError, match=r"data\.txt.*unsupported extension '\.txt'"):
        dm.setup("fit")


@pytest.mark.parametrize("suffix,line", [(".jsonl", 40), (".json", 41), (".csv", 41)])
def test_a_byte_that_is_not_utf8_is_named_by_file_line_and_column(tmp_path, suffix, line):
    """Latin-1 in row 40 (a header or '[' line first in .csv/.json), far past the codec's first chunk: the error
    names the line an editor shows, not the codec's byte offset; the CLI prints it as one line."""
    from rloo_lightning.cli_errors import error_line

    path = tmp_path / f"latin1{suffix}"
    rows = [{"prompt": f"row {i}="} for i in range(1, 201)]
    if suffix == ".jsonl":
        text = "".join(json.dumps(r) + "\n" for r in rows)
    elif suffix == ".json":
        text = "[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n"
    else:
        text = "prompt\n" + "".join(r["prompt"] + "\n" for r in rows)
    path.write_bytes(text.encode().replace(b"row 40=", b"r\xe9sum\xe9 40="))
    with pytest.raises(ValueError) as err:
        read_rows(str(path))
    column = text.splitlines()[line - 1].index("row 40=") + 2
    assert error_line(err.value) == (f"error: {path} line {line}: byte 0xe9 at column {column} is not UTF-8; the "
                                     "file must be UTF-8 text (re-save it with UTF-8 encoding)")


def test_unreadable_parquet_names_the_file(tiny_model_dir, tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"this is not parquet")
    dm = _dm(tiny_model_dir, str(path))
    with pytest.raises(ValueError, match=r"broken\.parquet.*cannot be read as parquet"):
        dm.setup("fit")


# ---------------------------------------------------------------------------------------------
# chat template
# ---------------------------------------------------------------------------------------------
def _chat_ids(tok, messages):
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, tok(text, add_special_tokens=False)["input_ids"]


def test_messages_prompt_is_formatted_with_the_template(chat_model_dir, tmp_path):
    messages = [{"role": "user", "content": "abc="}]
    multi = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"},
             {"role": "user", "content": "cd"}]
    rows = [{"prompt": messages, "answer": "cba"}, {"prompt": multi, "answer": "dc"}]
    path = _write(tmp_path / "chat.jsonl", rows)
    dm = _dm(chat_model_dir, path, val_file=path)
    dm.setup("fit")
    tok = dm.tokenizer
    text, ids = _chat_ids(tok, messages)
    assert text == "<bos>u:abc=;a:"  # the template really ran, with the generation prompt
    assert dm.val_rows[0]["input_ids"] == ids
    assert dm.val_rows[0]["input_ids"].count(tok.bos_token_id) == 1
    assert dm.val_rows[1]["input_ids"] == _chat_ids(tok, multi)[1]
    assert tok.decode(dm.val_rows[1]["input_ids"]) == "<bos>u:ab;a:ba;u:cd;a:"
    # the row keeps the prompt as given (a messages list), and its columns
    batch = collate_prompts(dm.val_rows, tok.pad_token_id)
    assert batch["prompt"] == [messages, multi]
    assert batch["columns"] == {"answer": ["cba", "dc"]}


def test_messages_prompt_from_parquet(chat_model_dir, tmp_path):
    messages = [{"role": "user", "content": "abc="}]
    path = _write(tmp_path / "chat.parquet", [{"prompt": messages, "answer": "cba"}] * 2)
    dm = _dm(chat_model_dir, path, val_file=path)
    dm.setup("fit")
    assert dm.val_rows[0]["prompt"] == messages
    assert dm.val_rows[0]["input_ids"] == _chat_ids(dm.tokenizer, messages)[1]


def test_auto_applies_template_to_strings_only_when_the_tokenizer_has_one(chat_model_dir, tiny_model_dir,
                                                                          tmp_path):
    rows = _rows(2)
    path = _write(tmp_path / "t.jsonl", rows)
    chat = _dm(chat_model_dir, path, val_file=path)  # use_chat_template="auto" by default
    chat.setup("fit")
    for row, r in zip(rows, chat.val_rows):
        assert r["input_ids"] == _chat_ids(chat.tokenizer, [{"role": "user", "content": row["prompt"]}])[1]
        assert chat.tokenizer.decode(r["input_ids"]) == f"<bos>u:{row['prompt']};a:"
        assert r["prompt"] == row["prompt"]  # the raw prompt is kept for the rewards

    plain = _dm(tiny_model_dir, path, val_file=path)
    plain.setup("fit")
    assert not plain.tokenizer.chat_template
    assert [r["input_ids"] for r in plain.val_rows] == [plain.tokenizer(r["prompt"])["input_ids"] for r in rows]

    # use_chat_template=False on a tokenizer that has one: the plain string
    off = _dm(chat_model_dir, path, val_file=path, use_chat_template=False)
    off.setup("fit")
    assert [r["input_ids"] for r in off.val_rows] == [off.tokenizer(r["prompt"])["input_ids"] for r in rows]


def test_system_prompt_comes_first(chat_model_dir, tmp_path):
    messages = [{"role": "user", "content": "abc="}]
    path = _write(tmp_path / "t.jsonl", [{"prompt": "abc="}, {"prompt": messages}])
    dm = _dm(chat_model_dir, path, val_file=path, system_prompt="ab")
    dm.setup("fit")
    tok = dm.tokenizer
    expected = _chat_ids(tok, [{"role": "system", "content": "ab"}, *messages])[1]
    assert dm.val_rows[0]["input_ids"] == expected  # string prompt
    assert dm.val_rows[1]["input_ids"] == expected  # messages prompt
    assert tok.decode(expected) == "<bos>s:ab;u:abc=;a:"


def test_messages_prompt_without_template_raises(tiny_model_dir, tmp_path):
    path = _write(tmp_path / "t.jsonl", [{"prompt": "abc="}, {"prompt": [{"role": "user", "content": "ab"}]}])
    dm = _dm(tiny_model_dir, path, val_file=path)
    with pytest.raises(ValueError, match=r"t\.jsonl line 2.*chat template"):
        dm.setup("fit")


def test_system_prompt_without_template_raises(tiny_model_dir, tmp_path):
    path = _write(tmp_path / "t.jsonl", _rows(2))
    dm = _dm(tiny_model_dir, path, val_file=path, system_prompt="ab")
    with pytest.raises(ValueError, match="chat template"):
        dm.setup("fit")


def test_messages_prompt_with_chat_template_off_raises(chat_model_dir, tmp_path):
    path = _write(tmp_path / "t.jsonl", [{"prompt": [{"role": "user", "content": "ab"}]}] * 2)
    dm = _dm(chat_model_dir, path, val_file=path, use_chat_template=False)
    with pytest.raises(ValueError, match=r"line 1.*use_chat_template"):
        dm.setup("fit")


def test_chat_template_required_but_missing_raises(tiny_model_dir, tmp_path):
    path = _write(tmp_path / "t.jsonl", _rows(2))
    dm = _dm(tiny_model_dir, path, val_file=path, use_chat_template=True)
    with pytest.raises(ValueError, match=r"use_chat_template=true.*none"):
        dm.setup("fit")


def test_invalid_use_chat_template_value_raises():
    with pytest.raises(ValueError, match="use_chat_template"):
        PromptDataModule(tokenizer_name_or_path="x", train_file="t.jsonl", use_chat_template="yes")


# ---------------------------------------------------------------------------------------------
# long prompts and the split
# ---------------------------------------------------------------------------------------------
def test_drop_long_prompts_drops_exactly_those_and_counts_them(tiny_model_dir, tmp_path):
    train = [{"prompt": p, "id": i} for i, p in enumerate(["abc=", "abcdefg=", "abcd=", "abcde=", "hgfedcba=", "h="])]
    val = [{"prompt": p, "id": i} for i, p in enumerate(["abcdefgh=", "ab="])]
    dm = _dm(tiny_model_dir, _write(tmp_path / "train.jsonl", train), val_file=_write(tmp_path / "val.jsonl", val),
             max_prompt_length=5, on_long_prompt="drop")
    dm.setup("fit")
    # "abcd=" has exactly 5 tokens: kept; 6 or more: dropped
    assert [r["prompt"] for r in dm.train_rows] == ["abc=", "abcd=", "h="]
    assert [r["prompt"] for r in dm.val_rows] == ["ab="]
    assert dm.dropped == {"train": 3, "validation": 1}
    assert all(len(r["input_ids"]) <= 5 for r in [*dm.train_rows, *dm.val_rows])


def test_drop_counts_nothing_when_nothing_is_long(tiny_model_dir, tmp_path):
    path = _write(tmp_path / "t.jsonl", _rows(4))
    dm = _dm(tiny_model_dir, path, val_file=path, max_prompt_length=4, on_long_prompt="drop")
    dm.setup("fit")
    assert dm.dropped == {} and len(dm.train_rows) == 4


def test_dropping_below_batch_size_raises_with_the_count(tiny_model_dir, tmp_path):
    rows = [{"prompt": p} for p in ["abc=", "abcdefg=", "abcdefgh=", "ab="]]
    path = _write(tmp_path / "t.jsonl", rows)
    dm = _dm(tiny_model_dir, path, val_file=path, max_prompt_length=5, on_long_prompt="drop", batch_size=3)
    with pytest.raises(ValueError, match=r"t\.jsonl.*2 rows after dropping 2 long prompts.*batch_size=3"):
        dm.setup("fit")


def test_long_prompt_error_names_file_and_row(tiny_model_dir, tmp_path):
    rows = [{"prompt": p} for p in ["abc=", "abcd=", "ab=", "abcdefg=", "a="]]
    path = _write(tmp_path / "long.csv", rows)
    dm = _dm(tiny_model_dir, path, val_file=path, max_prompt_length=5)  # on_long_prompt="error" by default
    with pytest.raises(ValueError) as err:
        dm.setup("fit")
    msg = str(err.value)
    assert "long.csv row 4" in msg and "8 tokens" in msg and "max_prompt_length=5" in msg, msg
    assert "on_long_prompt" in msg


def test_max_prompt_length_counts_templated_tokens(chat_model_dir, tmp_path):
    # "ab" is 2 characters but "<bos>u:ab;a:" is 8 tokens; "<bos>u:a;a:" is 7
    path = _write(tmp_path / "t.jsonl", [{"prompt": "ab"}, {"prompt": "a"}, {"prompt": "b"}])
    dm = _dm(chat_model_dir, path, val_file=path, max_prompt_length=7, on_long_prompt="drop")
    dm.setup("fit")
    assert [r["prompt"] for r in dm.train_rows] == ["a", "b"]
    assert dm.dropped == {"train": 1, "validation": 1}


@pytest.mark.parametrize("bad", [{"max_prompt_length": 0}, {"on_long_prompt": "truncate"}])
def test_invalid_long_prompt_options_raise(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        PromptDataModule(tokenizer_name_or_path="x", train_file="t.jsonl", **bad)


def test_split_deterministic_per_seed_with_count_and_drops(tiny_model_dir, tmp_path):
    rows = _rows(30)
    long_ids = {3, 7, 19, 25}
    for i in long_ids:
        rows[i]["prompt"] = "abcdefgh="
    path = _write(tmp_path / "t.parquet", rows)

    def split(seed, **kw):
        dm = _dm(tiny_model_dir, path, val_size=6, seed=seed, **kw)  # val_size >= 1: a row count
        dm.setup("fit")
        return [r["columns"]["id"] for r in dm.train_rows], [r["columns"]["id"] for r in dm.val_rows]

    train0, val0 = split(0)
    assert len(val0) == 6 and len(train0) == 24
    assert sorted(train0 + val0) == list(range(30))
    assert train0 == sorted(train0) and val0 == sorted(val0)  # file order kept within each split
    assert split(0) == (train0, val0)
    train1, val1 = split(1)
    assert set(val1) != set(val0) and sorted(train1 + val1) == list(range(30))
    # Dropping happens after the split: the same seed gives the same split minus the long rows.
    dtrain, dval = split(0, max_prompt_length=5, on_long_prompt="drop")
    assert dtrain == [i for i in train0 if i not in long_ids]
    assert dval == [i for i in val0 if i not in long_ids]


def test_train_loader_batches_are_full_and_cover_the_rows(tiny_model_dir, tmp_path):
    path = _write(tmp_path / "t.arrow", _rows(10))
    dm = _dm(tiny_model_dir, path, val_size=0, batch_size=4)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert [len(b["prompt"]) for b in batches] == [4, 4]  # drop_last
    seen = [i for b in batches for i in b["columns"]["id"]]
    assert len(set(seen)) == 8 and set(seen) <= set(range(10))
    assert isinstance(batches[0]["input_ids"], torch.Tensor)


# ---------------------------------------------------------------------------------------------
# data the model cannot read: unknown tokens, chat roles
# ---------------------------------------------------------------------------------------------
def test_a_prompt_more_than_half_unknown_is_refused_naming_the_file_and_line(tiny_model_dir, tmp_path):
    rows = _rows(8)
    rows[5]["prompt"] = "Какой ответ?"  # outside the tiny tokenizer's alphabet: every character is <unk>
    path = _write(tmp_path / "t.jsonl", rows)
    dm = _dm(tiny_model_dir, path, val_file=path)
    with pytest.raises(ValueError, match=r"t\.jsonl line 6: 12 of the prompt's 12 tokens are the unknown token "
                                         r"'<unk>': the tokenizer of .* cannot read it"):
        dm.setup("fit")
    kept = _dm(tiny_model_dir, path, val_file=path, on_unreadable_prompt="keep")
    with pytest.warns(UserWarning, match="are the unknown token"):  # the split's share is still reported
        kept.setup("fit")
    assert kept.val_rows[5]["prompt"] == "Какой ответ?"


def test_a_split_with_more_than_1_percent_unknown_tokens_warns_on_every_start(tiny_model_dir, tmp_path):
    rows = _rows(40)
    rows[3]["prompt"] = "abc?="  # 1 unknown of 5 tokens: the prompt is read, the split's share is 1 / 160
    rows[4]["prompt"] = "ab!c="
    path = _write(tmp_path / "t.jsonl", rows)
    for _ in range(2):  # the second start reads the cache: the counts are in its entry
        dm = _dm(tiny_model_dir, path, val_file=path)
        with pytest.warns(UserWarning, match=r"1\.2 % of the prompt tokens of .*t\.jsonl \(2 of 162\) are the "
                                             r"unknown token '<unk>'"):
            dm.setup("fit")
    clean = _write(tmp_path / "clean.jsonl", _rows(40))
    dm = _dm(tiny_model_dir, clean, val_file=clean)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dm.setup("fit")


def test_a_chat_role_outside_the_four_is_refused_unless_listed(chat_model_dir, tmp_path):
    messages = [{"role": "system", "content": "ab"}, {"role": "usr", "content": "abc="}]
    path = _write(tmp_path / "chat.jsonl", [{"prompt": messages, "answer": "cba"}] * 2)
    dm = _dm(chat_model_dir, path, val_file=path)
    with pytest.raises(ValueError, match=r"chat\.jsonl line 1: message 1 has role 'usr' \(did you mean 'user'\?\); "
                                         r"a chat role is one of system, user, assistant, tool.*data.extra_roles"):
        dm.setup("fit")
    listed = _dm(chat_model_dir, path, val_file=path, extra_roles=["usr"])
    listed.setup("fit")
    assert listed.val_rows[0]["prompt"] == messages
    with pytest.raises(ValueError, match="extra_roles lists \\['user'\\], which are always accepted"):
        _dm(chat_model_dir, path, val_file=path, extra_roles=["user"])
