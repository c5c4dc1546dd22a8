"""PromptDataModule (embedded task and local files), collate, and the clear errors for bad configs/data."""

from __future__ import annotations

import json

import pytest
import torch

from rloo_lightning.data import PromptDataModule, collate_prompts
from rloo_lightning.module import RLOOModule
from rloo_lightning.rewards import RewardSet

REWARD = "rloo_lightning.tasks.reverse.reward"


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rows(n, start=0):
    letters = "abcdefgh"
    out = []
    for i in range(start, start + n):
        word = letters[i % 8] + letters[(i // 8) % 8] + letters[(i * 3) % 8]
        out.append({"prompt": word + "=", "answer": word[::-1], "id": i})
    return out


def _check_left_padded(batch, tok, pad_id):
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == mask.shape and ids.dtype == torch.long
    for i, prompt in enumerate(batch["prompt"]):
        expected = tok(prompt)["input_ids"]
        n = len(expected)
        assert ids[i, ids.shape[1] - n:].tolist() == expected
        assert mask[i].tolist() == [0] * (ids.shape[1] - n) + [1] * n
        assert torch.all(ids[i, : ids.shape[1] - n] == pad_id)
    # the longest prompt has no padding
    assert mask.sum(1).max() == ids.shape[1]


# ---------------------------------------------------------------------------------------------
# embedded task
# ---------------------------------------------------------------------------------------------
def test_task_reverse_batches(tiny_model_dir):
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="reverse", batch_size=8,
                          num_train_rows=40, num_val_rows=12, max_new_tokens=8)
    dm.setup("fit")
    assert len(dm.train_rows) == 40
    train_prompts = {r["prompt"] for r in dm.train_rows}
    assert dm.val_rows and not ({r["prompt"] for r in dm.val_rows} & train_prompts)  # held out
    batch = next(iter(dm.train_dataloader()))
    assert len(batch["prompt"]) == 8
    _check_left_padded(batch, dm.tokenizer, dm.tokenizer.pad_token_id)
    # the extra column of the task (the reference answer) travels per row
    assert batch["columns"]["answer"] == [p[:-1][::-1] for p in batch["prompt"]]
    # drop_last in training: every batch is full
    assert all(len(b["prompt"]) == 8 for b in dm.train_dataloader())
    val = list(dm.val_dataloader())
    assert sum(len(b["prompt"]) for b in val) == len(dm.val_rows)


def test_task_rows_deterministic_for_seed(tiny_model_dir):
    def prompts(seed):
        dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="reverse", batch_size=4,
                              num_train_rows=20, num_val_rows=10, seed=seed)
        dm.setup("fit")
        return [r["prompt"] for r in dm.train_rows], [r["prompt"] for r in dm.val_rows]

    assert prompts(0) == prompts(0)
    assert prompts(0) != prompts(1)


def test_collate_left_pads_and_passes_columns():
    rows = [
        {"input_ids": [4, 5, 12], "prompt": "ab=", "columns": {"answer": "ba", "x": 1}},
        {"input_ids": [6, 7, 8, 9, 12], "prompt": "cdef=", "columns": {"answer": "fedc"}},
    ]
    batch = collate_prompts(rows, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[0, 0, 4, 5, 12], [6, 7, 8, 9, 12]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch["prompt"] == ["ab=", "cdef="]
    assert batch["columns"] == {"answer": ["ba", "fedc"], "x": [1, None]}


# ---------------------------------------------------------------------------------------------
# local files
# ---------------------------------------------------------------------------------------------
def test_jsonl_file_columns_and_padding(tiny_model_dir, tmp_path):
    rows = _rows(10)
    rows[3]["prompt"] = "abcdefgh="  # a longer prompt, so that the others are left-padded
    rows[5]["note"] = "extra"
    train = _write_jsonl(tmp_path / "train.jsonl", rows)
    val = _write_jsonl(tmp_path / "val.jsonl", _rows(3, start=20))
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=train, val_file=val, batch_size=10)
    dm.setup("fit")
    assert len(dm.train_rows) == 10 and len(dm.val_rows) == 3
    batch = next(iter(dm.train_dataloader()))
    _check_left_padded(batch, dm.tokenizer, dm.tokenizer.pad_token_id)
    assert (batch["attention_mask"] == 0).any()
    by_prompt = {r["prompt"]: r for r in rows}
    for i, prompt in enumerate(batch["prompt"]):
        assert batch["columns"]["answer"][i] == by_prompt[prompt]["answer"]
        assert batch["columns"]["id"][i] == by_prompt[prompt]["id"]
        assert batch["columns"]["note"][i] == by_prompt[prompt].get("note")
    assert "prompt" not in batch["columns"]
    val_batch = next(iter(dm.val_dataloader()))
    assert val_batch["prompt"] == [r["prompt"] for r in _rows(3, start=20)]  # not shuffled


def test_json_file_custom_prompt_column(tiny_model_dir, tmp_path):
    rows = [{"question": r["prompt"], "answer": r["answer"]} for r in _rows(6)]
    (tmp_path / "train.json").write_text(json.dumps(rows))
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=str(tmp_path / "train.json"),
                          prompt_column="question", val_size=2, batch_size=2)
    dm.setup("fit")
    assert len(dm.train_rows) == 4 and len(dm.val_rows) == 2
    assert all(set(r["columns"]) == {"answer"} for r in [*dm.train_rows, *dm.val_rows])


def test_validation_split_deterministic_for_seed(tiny_model_dir, tmp_path):
    rows = _rows(50)
    path = _write_jsonl(tmp_path / "train.jsonl", rows)

    def split(seed):
        dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=path, val_size=0.2,
                              batch_size=4, seed=seed)
        dm.setup("fit")
        return [r["columns"]["id"] for r in dm.train_rows], [r["columns"]["id"] for r in dm.val_rows]

    train0, val0 = split(0)
    assert len(val0) == 10 and len(train0) == 40
    assert sorted(train0 + val0) == list(range(50))  # disjoint and complete
    assert split(0) == (train0, val0)
    assert set(split(1)[1]) != set(val0)


def test_train_shuffle_deterministic_for_seed(tiny_model_dir, tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", _rows(24))

    def order(seed):
        dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=path, val_size=0, batch_size=4,
                              seed=seed)
        dm.setup("fit")
        return [p for b in dm.train_dataloader() for p in b["prompt"]]

    assert order(0) == order(0)
    assert sorted(order(0)) == sorted(r["prompt"] for r in _rows(24))


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------
def test_empty_jsonl_file_raises(tiny_model_dir, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=str(path), batch_size=4)
    with pytest.raises(ValueError) as err:
        dm.setup("fit")
    msg = str(err.value)
    assert "empty.jsonl" in msg and "0 rows" in msg and "batch_size" in msg


def test_empty_json_list_raises(tiny_model_dir, tmp_path):
    path = tmp_path / "empty.json"
    path.write_text("[]")
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=str(path), batch_size=4)
    with pytest.raises(ValueError, match=r"empty\.json.*0 rows"):
        dm.setup("fit")


# A zero-byte or malformed .json file: the error names the file, not only the JSON decoder's position.
def test_zero_byte_json_file_error_names_the_file(tiny_model_dir, tmp_path):
    path = tmp_path / "nothing.json"
    path.write_text("")
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=str(path), batch_size=4)
    with pytest.raises(ValueError, match="nothing.json"):
        dm.setup("fit")


def test_missing_prompt_column_names_column_and_row(tiny_model_dir, tmp_path):
    rows = _rows(6)
    rows[4] = {"question": "abc=", "answer": "cba"}
    train = _write_jsonl(tmp_path / "train.jsonl", rows)
    val = _write_jsonl(tmp_path / "val.jsonl", _rows(2))
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=train, val_file=val, batch_size=2)
    with pytest.raises(ValueError) as err:
        dm.setup("fit")
    msg = str(err.value)
    assert "'prompt'" in msg and "line 5" in msg and "prompt_column" in msg and "question" in msg


# Row numbers in errors are the file's rows, not positions after the train/validation split.
def test_missing_prompt_column_row_refers_to_the_file_when_split(tiny_model_dir, tmp_path):
    rows = _rows(10)
    rows[9] = {"question": "abc=", "answer": "cba"}
    train = _write_jsonl(tmp_path / "train.jsonl", rows)
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=train, val_size=0.3, batch_size=2)
    with pytest.raises(ValueError) as err:
        dm.setup("fit")
    msg = str(err.value)
    assert "'prompt'" in msg
    assert "row 9" in msg or "line 10" in msg, msg


def test_prompt_longer_than_context_raises(tiny_model_dir, tmp_path):
    # the tiny model's max_position_embeddings is 32
    rows = _rows(4)
    rows[2]["prompt"] = "abcdefgh" * 5 + "="
    train = _write_jsonl(tmp_path / "train.jsonl", rows)
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=train, val_file=train, batch_size=2)
    with pytest.raises(ValueError) as err:
        dm.setup("fit")
    msg = str(err.value)
    assert "line 3" in msg and "32" in msg and "context" in msg


def test_prompt_plus_completion_budget_longer_than_context_raises(tiny_model_dir, tmp_path):
    rows = _rows(4)
    rows[1]["prompt"] = "abcdefgh" * 3 + "="  # 25 tokens: fits alone, not with 8 new tokens
    train = _write_jsonl(tmp_path / "train.jsonl", rows)
    ok = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=train, val_file=train, batch_size=2,
                          max_new_tokens=7)
    ok.setup("fit")  # 25 + 7 = 32 fits exactly
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=train, val_file=train, batch_size=2,
                          max_new_tokens=8)
    with pytest.raises(ValueError, match=r"line 2.*max_new_tokens=8.*32"):
        dm.setup("fit")


def test_a_train_file_over_a_task_uses_the_file_and_one_line_says_the_task_is_ignored(tiny_model_dir, tmp_path,
                                                                                      info_lines):
    path = _write_jsonl(tmp_path / "train.jsonl", _rows(40))
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="reverse", num_val_rows=200, train_file=path,
                          batch_size=4, cache_dir=str(tmp_path))
    assert dm.hparams.task is None
    said = [line for line in info_lines if "is ignored" in line]
    assert said == [f"PromptDataModule: train_file={path!r} is given, so task='reverse' (and num_val_rows=200) is "
                    "ignored"]
    dm.setup("fit")
    assert len(dm.train_rows) + len(dm.val_rows) == 40
    with pytest.raises(ValueError, match=r"task.*train_file"):
        PromptDataModule(tokenizer_name_or_path="x")


def test_unknown_task_raises_listing_tasks(tiny_model_dir):
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="nope")
    with pytest.raises(ValueError, match=r"nope.*reverse"):
        dm.setup("fit")


def test_malformed_jsonl_line_names_the_line(tiny_model_dir, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "abc="}\n{"prompt": "abd="}\n{"prompt": "ab\n{"prompt": "bbb="}\n')
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=str(path), batch_size=1)
    with pytest.raises(ValueError, match=r"bad\.jsonl.*line 3"):
        dm.setup("fit")


def test_missing_file_and_bad_extension(tiny_model_dir, tmp_path):
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=str(tmp_path / "absent.jsonl"))
    with pytest.raises(ValueError, match="absent.jsonl"):
        dm.setup("fit")
    (tmp_path / "data.csv").write_text("prompt\nabc=\n")
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=str(tmp_path / "data.csv"))
    with pytest.raises(ValueError, match=r"\.csv"):
        dm.setup("fit")


# ---------------------------------------------------------------------------------------------
# module / reward configuration errors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 0])
def test_module_k_below_2_raises(k):
    with pytest.raises(ValueError, match=r"sampling\.k must be >= 2"):
        RLOOModule(model_name_or_path="unused", rewards={"funcs": [REWARD]}, sampling={"k": k})


def test_unknown_reward_path_raises_naming_it():
    with pytest.raises(ValueError, match="no_such_package_xyz.reward"):
        RLOOModule(model_name_or_path="unused", rewards={"funcs": ["no_such_package_xyz.reward"]})
    with pytest.raises(ValueError, match="rloo_lightning.tasks.reverse.no_such_fn"):
        RLOOModule(model_name_or_path="unused", rewards={"funcs": ["rloo_lightning.tasks.reverse.no_such_fn"]})
    with pytest.raises(ValueError, match="not_a_path"):
        RLOOModule(model_name_or_path="unused", rewards={"funcs": ["not_a_path"]})


def too_few_values(prompts, completions, completion_ids, **columns):
    return [0.0] * (len(completions) - 1)


def test_reward_returning_wrong_number_of_values_names_the_function():
    rewards = RewardSet.from_specs([REWARD, too_few_values])
    with pytest.raises(ValueError, match=r"too_few_values.*2 values for 3 completions"):
        rewards.score(["ab="] * 3, ["ba", "ab", "b"], [[5, 4], [4, 5], [5]], {"answer": ["ba"] * 3})


def test_reward_wrong_count_through_the_module_by_import_path(tiny_model_dir):
    from rloo_lightning.rollout import Rollout

    module = RLOOModule(model_name_or_path=tiny_model_dir, rewards={"funcs": [f"{__name__}.too_few_values"]},
                        kl={"beta": 0.0})
    ids = torch.tensor([[4, 2], [5, 2]])
    rollout = Rollout(k=2, prompt_ids=ids, prompt_mask=torch.ones_like(ids), completion_ids=ids,
                      completion_mask=torch.ones(2, 2), truncated=torch.zeros(2, dtype=torch.bool),
                      prompts=["a=", "a="], completions=["a", "b"])
    with pytest.raises(ValueError, match="too_few_values"):
        rollout.scores, rollout.rewards = module.score(rollout)


def test_reward_weights_length_mismatch_raises():
    with pytest.raises(ValueError, match=r"rewards\.weights has 2 values for 1 rewards\.funcs"):
        RLOOModule(model_name_or_path="unused", rewards={"funcs": [REWARD], "weights": [1.0, 2.0]})


# ---------------------------------------------------------------------------------------------
# what the data module says about its splits: sizes, ignored options, skipped rows, small validation
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def info_lines():
    """Messages of ``rank_zero_info`` (the ``lightning.pytorch`` logger does not propagate to caplog's root)."""
    import logging

    lines = []
    handler = logging.Handler(level=logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


def _messages(record) -> list[str]:
    return [str(w.message) for w in record]


def _split_line(lines) -> str:
    found = [line for line in lines if "training prompts from" in line]
    assert len(found) == 1, lines
    return found[0]


def test_setup_logs_split_sizes_from_val_size(tiny_model_dir, tmp_path, info_lines):
    path = _write_jsonl(tmp_path / "train.jsonl", _rows(40))
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=path, val_size=0.25, batch_size=5)
    dm.setup("fit")
    line = _split_line(info_lines)
    assert "30 training prompts" in line and "10 validation prompts" in line
    assert "held out of the 40 rows" in line and "val_size=0.25" in line and path in line


def test_setup_logs_split_sizes_from_default_val_size(tiny_model_dir, tmp_path, info_lines):
    path = _write_jsonl(tmp_path / "train.jsonl", _rows(80))
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=path, batch_size=8)
    dm.setup("fit")
    line = _split_line(info_lines)
    assert "72 training prompts" in line and "8 validation prompts" in line and "val_size=0.1" in line


def test_setup_logs_split_sizes_from_val_file(tiny_model_dir, tmp_path, info_lines):
    train = _write_jsonl(tmp_path / "train.jsonl", _rows(8))
    val = _write_jsonl(tmp_path / "val.jsonl", _rows(8, start=20))
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=train, val_file=val, batch_size=4)
    dm.setup("fit")
    line = _split_line(info_lines)
    assert "8 training prompts" in line and f"8 validation prompts from val_file {val}" in line


def test_setup_logs_split_sizes_from_task(tiny_model_dir, info_lines):
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="reverse", batch_size=4,
                          num_train_rows=40, num_val_rows=12)
    dm.setup("fit")
    line = _split_line(info_lines)
    assert "40 training prompts from task 'reverse'" in line
    assert f"{len(dm.val_rows)} validation prompts from task 'reverse' (num_val_rows=12" in line


def test_task_only_options_with_train_file_warn(tiny_model_dir, tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", _rows(16))
    with pytest.warns(UserWarning, match=r"num_train_rows=100, num_val_rows=5 ignored") as record:
        PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=path, num_train_rows=100,
                         num_val_rows=5)
    assert len([m for m in _messages(record) if "ignored" in m]) == 1


def test_val_size_with_val_file_warns(tiny_model_dir, tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", _rows(16))
    with pytest.warns(UserWarning, match=r"val_size=0.2 is ignored: val_file="):
        PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=path, val_file=path, val_size=0.2)


def test_file_options_with_task_warn(tiny_model_dir):
    with pytest.warns(UserWarning, match=r"val_size=0.3.*ignored: task='reverse'"):
        PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="reverse", val_size=0.3)


def test_no_ignored_option_warning_by_default(tiny_model_dir, tmp_path, recwarn):
    path = _write_jsonl(tmp_path / "train.jsonl", _rows(16))
    PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=path, val_file=path)
    PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=path, val_size=0.5)
    PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="reverse", num_train_rows=8, num_val_rows=8)
    assert not [m for m in _messages(recwarn) if "ignored" in m]


def test_rows_that_do_not_fill_a_batch_warn_once_with_the_count(tiny_model_dir, tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", _rows(10))
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=path, val_file=path, batch_size=4)
    dm.setup("fit")
    with pytest.warns(UserWarning, match=r"2 of the 10 training prompts are skipped each epoch") as record:
        loader = dm.train_dataloader()
    assert any("batch_size=4" in m and "divides 10" in m for m in _messages(record))
    # the loader really leaves them out: two full batches, 8 distinct prompts
    batches = list(loader)
    assert [len(b["prompt"]) for b in batches] == [4, 4]
    assert len({p for b in batches for p in b["prompt"]}) == 8
    import warnings

    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        dm.train_dataloader()
    assert not [m for m in _messages(again) if "skipped each epoch" in m]  # once


def test_no_skipped_rows_warning_when_batch_size_divides(tiny_model_dir, tmp_path, recwarn):
    path = _write_jsonl(tmp_path / "train.jsonl", _rows(12))
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=path, val_file=path, batch_size=4)
    dm.setup("fit")
    dm.train_dataloader()
    assert not [m for m in _messages(recwarn) if "skipped each epoch" in m]


def test_small_validation_split_warns_naming_val_size_and_count(tiny_model_dir, tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", _rows(30))
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=path, batch_size=3)
    with pytest.warns(UserWarning, match=r"validation split has only 3 prompts.*val_size=0.1 gives 3"):
        dm.setup("fit")


def test_small_validation_from_task_or_file_warns(tiny_model_dir, tmp_path):
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, task="reverse", batch_size=4,
                          num_train_rows=16, num_val_rows=4)
    with pytest.warns(UserWarning, match=r"only \d prompts.*num_val_rows"):
        dm.setup("fit")
    path = _write_jsonl(tmp_path / "train.jsonl", _rows(8))
    val = _write_jsonl(tmp_path / "val.jsonl", _rows(2, start=20))
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=path, val_file=val, batch_size=4)
    with pytest.warns(UserWarning, match=r"only 2 prompts.*val_file"):
        dm.setup("fit")


def test_no_small_validation_warning_for_enough_prompts_or_val_size_0(tiny_model_dir, tmp_path, recwarn):
    path = _write_jsonl(tmp_path / "train.jsonl", _rows(16))
    for val_size in (8, 0):
        PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=path, val_size=val_size,
                         batch_size=4).setup("fit")
    assert not [m for m in _messages(recwarn) if "validation split has only" in m]


def test_under_the_cli_a_train_file_over_the_quickstart_config_reads_the_file(tiny_model_dir, tmp_path):
    """LightningCLI hands the parsed config to ``save_hyperparameters``: the task must leave the hparams too."""
    from cli_harness import CONFIGS

    from rloo_lightning.cli import RLOOCLI

    path = _write_jsonl(tmp_path / "train.jsonl", _rows(40))
    cli = RLOOCLI(RLOOModule, PromptDataModule, run=False, save_config_callback=None,
                  args=["--config", str(CONFIGS / "quickstart.yaml"), "--model.model_name_or_path", tiny_model_dir,
                        "--data.train_file", path, "--data.cache_dir", str(tmp_path / "cache")])
    assert cli.datamodule.hparams.task is None
    cli.datamodule.setup("fit")
    assert len(cli.datamodule.train_rows) + len(cli.datamodule.val_rows) == 40
