"""The validation split held out of ``train_file``: 10 % capped at 1,000 prompts by default (one line when the cap
applies), the given ``val_size`` as it is, the split a run started with kept on resume, and an empty file reported
as one error."""

from __future__ import annotations

import warnings

import pytest
from lightning.pytorch import Trainer
from test_data_module import _rows, _write_jsonl, info_lines  # noqa: F401 (a fixture)

from rloo_lightning import RLOOModule
from rloo_lightning.data import PromptDataModule

CAP_LINE = "validation holds out 1000 of the 12000 rows"


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    return _write_jsonl(tmp_path_factory.mktemp("big") / "train.jsonl", _rows(12000))


def test_without_val_size_ten_percent_is_held_out_at_most_1000_and_one_line_says_so(tiny_model_dir, big_file,
                                                                                   tmp_path, info_lines):  # noqa: F811
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=big_file, batch_size=8,
                          cache_dir=str(tmp_path))
    dm.setup("fit")
    assert (len(dm.train_rows), len(dm.val_rows)) == (11000, 1000)
    assert sum(CAP_LINE in line for line in info_lines) == 1
    assert any("val_size=0.1 capped at 1000" in line for line in info_lines)


def test_a_given_val_size_is_not_capped_and_a_small_file_is_not_either(tiny_model_dir, big_file, tmp_path,
                                                                       info_lines):  # noqa: F811
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=big_file, batch_size=8, val_size=0.1,
                          cache_dir=str(tmp_path))
    dm.setup("fit")
    assert len(dm.val_rows) == 1200
    small = _write_jsonl(tmp_path / "small.jsonl", _rows(5000))
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=small, batch_size=8,
                          cache_dir=str(tmp_path))
    dm.setup("fit")
    assert len(dm.val_rows) == 500
    assert not any("capped" in line for line in info_lines)


def _prompts(rows) -> list[str]:
    return [rows[i]["prompt"] for i in range(len(rows))]


def test_a_resumed_datamodule_keeps_the_split_it_started_with(tiny_model_dir, tmp_path, info_lines):  # noqa: F811
    path = _write_jsonl(tmp_path / "train.jsonl", _rows(400))
    first = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=path, batch_size=8, val_size=0.25,
                             cache_dir=str(tmp_path))
    first.setup("fit")
    state = first.state_dict()
    assert state["held_out"]["validation_rows"] == 100
    resumed = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=path, batch_size=8,
                               cache_dir=str(tmp_path))  # the default rule would hold out 40
    resumed.setup("fit")
    assert len(resumed.val_rows) == 40
    resumed.load_state_dict(state)
    assert _prompts(resumed.val_rows) == _prompts(first.val_rows)
    assert _prompts(resumed.train_rows) == _prompts(first.train_rows)
    assert any("keeping the run's 100 validation prompts" in line for line in info_lines)


def test_a_changed_file_cannot_keep_the_split_and_says_so(tiny_model_dir, tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", _rows(400))
    first = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=path, batch_size=8,
                             cache_dir=str(tmp_path))
    first.setup("fit")
    state = first.state_dict()
    _write_jsonl(tmp_path / "train.jsonl", _rows(500))
    changed = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=path, batch_size=8,
                               cache_dir=str(tmp_path))
    changed.setup("fit")
    with pytest.warns(UserWarning, match="held its validation prompts out of 400 rows.*now has 500 rows"):
        changed.load_state_dict(state)


def test_fit_resumed_from_a_checkpoint_validates_on_the_prompts_it_started_with(tiny_model_dir, tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", _rows(64))

    def fit(val_size, ckpt_path=None):
        module = RLOOModule(tiny_model_dir, rewards={"funcs": ["rloo_lightning.tasks.reverse.reward"]},
                            sampling={"k": 2, "max_new_tokens": 4}, validation={"at_start": False})
        data = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=path, batch_size=4,
                                val_size=val_size, cache_dir=str(tmp_path / "cache"), max_new_tokens=4)
        trainer = Trainer(accelerator="cpu", max_steps=2 if ckpt_path is None else 3, limit_val_batches=0,
                          logger=False, enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=tmp_path, enable_checkpointing=False)
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return trainer, data

    trainer, first = fit(0.25)
    trainer.save_checkpoint(tmp_path / "step2.ckpt")
    _, resumed = fit(None, tmp_path / "step2.ckpt")
    assert len(first.val_rows) == 16 and _prompts(resumed.val_rows) == _prompts(first.val_rows)


def test_an_empty_file_is_one_error_with_no_validation_size_warning_first(tiny_model_dir, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    dm = PromptDataModule(tokenizer_name_or_path=tiny_model_dir, train_file=str(path), batch_size=4,
                          cache_dir=str(tmp_path))
    with warnings.catch_warnings(record=True) as record, pytest.raises(ValueError, match="the source is empty"):
        warnings.simplefilter("always")
        dm.setup("fit")
    assert not [w for w in record if "validation" in str(w.message)]
