"""One clear line for a damaged ``--ckpt_path`` (``rloo_lightning.runtime.checkpoint_check``): each kind of damage
(truncated, cut anywhere, a text file, not a checkpoint, ...) is named in one line, whole checkpoints pass, and
``checkpoint_hparams``, ``export`` and every CLI subcommand refuse a damaged file with that line, exit status 1.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
import torch

from checkpoint_helpers import NO_VALIDATION, _ckpt, _trainer
from rloo_lightning.runtime.checkpoint_check import check_checkpoint_path, checkpoint_file_problem


HERE = Path(__file__).resolve()
TRUNCATED = "truncated (the file ends before its zip directory; a save was cut off?)"


# -- checking ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lightning_ckpt(tmp_path_factory) -> Path:
    """A real Lightning checkpoint (a Trainer's, through the atomic IO)."""
    from checkpoint_helpers import Boring

    from rloo_lightning.callbacks import FinalCheckpoint

    root = tmp_path_factory.mktemp("real")
    _trainer(max_steps=2, callbacks=[FinalCheckpoint()], default_root_dir=root, **NO_VALIDATION).fit(Boring())
    return root / "checkpoints" / "last.ckpt"


def _damaged(kind: str, folder: Path, good: Path) -> Path:
    path = folder / f"{kind}.ckpt"
    data = good.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "truncated_in_header":
        path.write_bytes(data[:2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text("step 3, loss 0.1\n")
    elif kind == "json":
        path.write_text(json.dumps({"state_dict": {}}))
    elif kind == "safetensors":
        from safetensors.torch import save_file

        save_file({"w": torch.zeros(3)}, str(path))
    elif kind == "tensor":
        torch.save(torch.zeros(3), path)
    elif kind == "state_dict":
        torch.save({"layer.weight": torch.zeros(3)}, path)  # a model's weights, not a Lightning checkpoint
    elif kind == "pickle":
        path.write_bytes(pickle.dumps({"state_dict": {}}, protocol=4))
    elif kind == "zip":
        import zipfile

        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("notes.txt", "hello")
    elif kind == "folder":
        path.mkdir()
        (path / "notes.txt").write_text("hello")
    elif kind == "sharded_without_meta":
        path.mkdir()
        (path / ".metadata").write_bytes(b"dcp")
        (path / "__0_0.distcp").write_bytes(b"shard")
    elif kind == "sharded_truncated_meta":
        path.mkdir()
        (path / ".metadata").write_bytes(b"dcp")
        (path / "meta.pt").write_bytes(data[: len(data) // 3])
    elif kind == "sharded_without_metadata":
        path.mkdir()
        torch.save({"pytorch-lightning_version": "2.6.6", "global_step": 1}, path / "meta.pt")
    return path


DAMAGE = {
    "truncated": TRUNCATED,
    "truncated_in_header": TRUNCATED,
    "empty": "truncated (an empty file; a save was cut off?)",
    "text": "is not a checkpoint (a text file)",
    "json": "is not a checkpoint (a JSON file)",
    "safetensors": "is not a checkpoint (a safetensors file: weights only)",
    "tensor": "is not a checkpoint (a torch.save file without Lightning's 'pytorch-lightning_version' and "
              "'state_dict')",
    "state_dict": "is not a checkpoint (a torch.save file without Lightning's 'pytorch-lightning_version' and "
                  "'state_dict')",
    "pickle": "is not a checkpoint (a pickle file, not one written by torch.save)",
    "zip": "is not a checkpoint (a zip archive, but not one written by torch.save)",
    "folder": "is a folder, not a checkpoint (a sharded checkpoint folder holds meta.pt and .metadata)",
    "sharded_without_meta": "is an incomplete sharded checkpoint (no meta.pt: a save was cut off?)",
    "sharded_truncated_meta": f"is a sharded checkpoint whose meta.pt is {TRUNCATED}",
    "sharded_without_metadata": "is an incomplete sharded checkpoint (no .metadata: a save was cut off?)",
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_each_kind_of_damage_gets_one_line_naming_the_file(kind, tmp_path, lightning_ckpt):
    path = _damaged(kind, tmp_path, lightning_ckpt)
    with pytest.raises(ValueError) as err:
        check_checkpoint_path(path)
    assert str(err.value) == f"--ckpt_path {path}: {DAMAGE[kind]}"
    assert "\n" not in str(err.value)


def test_what_torch_says_about_a_truncated_file_without_the_check(tmp_path, lightning_ckpt):
    """The message the check replaces: torch's, without the file's name."""
    path = _damaged("truncated", tmp_path, lightning_ckpt)
    with pytest.raises(RuntimeError, match="failed finding central directory") as err:
        torch.load(path, weights_only=True)
    assert str(path) not in str(err.value)


def test_a_cut_anywhere_is_reported_as_truncated(tmp_path, lightning_ckpt):
    data = lightning_ckpt.read_bytes()
    path = tmp_path / "cut.ckpt"
    for end in [1, 4, 30, 100, 1000, *range(2000, len(data), max(1, len(data) // 40)), len(data) - 1]:
        path.write_bytes(data[:end])
        assert checkpoint_file_problem(path) == TRUNCATED, end


def test_whole_checkpoints_and_lightnings_own_values_pass(tmp_path, lightning_ckpt):
    check_checkpoint_path(lightning_ckpt)
    check_checkpoint_path(str(lightning_ckpt), "--ckpt_path")
    check_checkpoint_path(f"file://{lightning_ckpt}")
    torch.save(_ckpt(0), tmp_path / "legacy.ckpt", _use_new_zipfile_serialization=False)
    check_checkpoint_path(tmp_path / "legacy.ckpt")  # torch's old format: passed on to torch.load
    sharded = tmp_path / "sharded.ckpt"
    sharded.mkdir()
    (sharded / ".metadata").write_bytes(b"dcp")
    torch.save({"pytorch-lightning_version": "2.6.6", "global_step": 1}, sharded / "meta.pt")
    check_checkpoint_path(sharded)
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "latest").write_text("checkpoint")  # DeepSpeed's folder: its own loader checks it
    check_checkpoint_path(tmp_path / "ds")
    for value in ("last", "best", "hpc", "registry", "registry:my-model:v1", "s3://bucket/last.ckpt", None):
        check_checkpoint_path(value)
    with pytest.raises(FileNotFoundError, match=r"^--ckpt_path .*nope\.ckpt: does not exist$"):
        check_checkpoint_path(tmp_path / "nope.ckpt")
    # export has no trainer: there "last" is a file name like any other
    with pytest.raises(FileNotFoundError, match="^checkpoint last: does not exist$"):
        check_checkpoint_path("last", "checkpoint", lightning_values=False)


def test_checkpoint_hparams_and_export_name_a_damaged_file(tmp_path, lightning_ckpt):
    from rloo_lightning.export import checkpoint_hparams, export_checkpoint, main

    path = _damaged("truncated", tmp_path, lightning_ckpt)
    with pytest.raises(ValueError, match=f"^checkpoint {re.escape(str(path))}: truncated"):
        checkpoint_hparams(path)
    with pytest.raises(ValueError, match="is not a checkpoint"):
        export_checkpoint(_damaged("state_dict", tmp_path, lightning_ckpt), tmp_path / "out")
    with pytest.raises(ValueError, match=f"^--ckpt_path {re.escape(str(path))}: truncated"):
        main(["--ckpt_path", str(path), "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["command line", "config file"])
def test_cli_subcommands_refuse_a_damaged_ckpt_path_with_one_line(where, tmp_path, lightning_ckpt, capsys,
                                                                   monkeypatch):
    """Before the model is built: given on the command line (checked where its options are read) or in a config
    file (checked before the classes are instantiated)."""
    from rloo_lightning.cli import TRACEBACK_ENV, _run_reporting_errors

    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    path = _damaged("truncated", tmp_path, lightning_ckpt)
    quickstart = str(HERE.parents[1] / "configs" / "quickstart.yaml")
    if where == "config file":
        config = tmp_path / "ckpt.yaml"
        config.write_text(f"ckpt_path: {path}\nmodel:\n  model_name_or_path: no/such-model\n")
        args = ["validate", "--config", quickstart, "--config", str(config)]
    else:
        args = ["validate", "--config", quickstart, "--ckpt_path", str(path)]
    with pytest.raises(SystemExit) as exit_:
        _run_reporting_errors(args)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [f"error: --ckpt_path {path}: "
                                                                                 f"{TRUNCATED}"], err
    assert "PytorchStreamReader" not in err and "Traceback" not in err, err


@pytest.mark.slow  # CLI subprocesses
def test_cli_and_export_print_one_line_and_exit_1(tmp_path, lightning_ckpt, _cache_dir):
    from cli_harness import CONFIGS, make_env, start_cli, wait_all

    env = make_env(_cache_dir)
    truncated = _damaged("truncated", tmp_path, lightning_ckpt)
    text = _damaged("text", tmp_path, lightning_ckpt)
    procs = [start_cli("test", ["test", "--config", CONFIGS / "quickstart.yaml", "--ckpt_path", truncated],
                       tmp_path, env),
             start_cli("export", ["export", "--ckpt_path", text], tmp_path, env)]
    wait_all(*procs)
    expected = {"test": f"error: --ckpt_path {truncated}: {TRUNCATED}",
                "export": f"error: --ckpt_path {text}: is not a checkpoint (a text file)"}
    for proc in procs:
        assert proc.rc == 1, proc.explain()
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert errors == [expected[proc.name]], proc.explain()
        assert "PytorchStreamReader" not in proc.log and "Traceback" not in proc.log, proc.explain()
