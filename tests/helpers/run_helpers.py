"""The run shape and plumbing shared by the tests that train through the CLI and compare runs (first written for
the resume and crash tests, ``tests/test_resume.py``): the quickstart config at small sizes (an epoch of 4 steps,
validation at step 5), checkpoints every step, the rollout recorder, and loading and comparing checkpoints, their
tensors and JSONL records.

The names keep the leading underscore they had as that test module's own helpers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from cli_harness import CONFIGS, Proc, start_cli

CONFIG = str(CONFIGS / "quickstart.yaml")
HELPERS = "reliability_helpers.callbacks"
TIMEOUT = 300  # per subprocess; a healthy run takes 10-30 s

# The run shape shared by the resume and crash tests: 4 steps per epoch, validation at step 5.
ROWS, BATCH, STEPS_PER_EPOCH = 16, 4, 4
N = 5  # resume point: mid-epoch (epoch 1, batch 1)
TOTAL = 2 * N


# ---------------------------------------------------------------------------------------------
# subprocess plumbing (tests/helpers/cli_harness.py: this folder on PYTHONPATH, output in files, timeouts)
# ---------------------------------------------------------------------------------------------
def _fit_args(root: Path, model_dir: str, max_steps: int, *extra: str) -> list[str]:
    """``fit`` with the quickstart config and small sizes (epoch = 4 steps, validation at step 5)."""
    return [
        "fit", "--config", CONFIG,
        "--model.model_name_or_path", model_dir,
        "--trainer.max_steps", str(max_steps),
        "--trainer.val_check_interval", str(N),
        "--trainer.default_root_dir", str(root),
        "--trainer.enable_progress_bar", "false",
        "--data.num_train_rows", str(ROWS),
        "--data.num_val_rows", "8",
        "--data.batch_size", str(BATCH),
        *extra,
    ]


# FinalCheckpoint keeps last.ckpt the newest checkpoint after a resume (and writes it at the end of fit)
FINAL_CHECKPOINT = "--trainer.callbacks+=rloo_lightning.callbacks.checkpoint.FinalCheckpoint"


def _ckpt_every_step(dirpath: Path) -> list[str]:
    return [
        FINAL_CHECKPOINT,
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={dirpath}",
        "--trainer.callbacks.every_n_train_steps=1",
        "--trainer.callbacks.save_last=true",
        "--trainer.callbacks.save_top_k=-1",
    ]


def _recorder(path: Path) -> list[str]:
    return [f"--trainer.callbacks+={HELPERS}.RolloutRecorder", f"--trainer.callbacks.path={path}"]


def _cli(name: str, args: list[str], cwd: Path, env: dict) -> Proc:
    return start_cli(name, args, cwd, env, timeout=TIMEOUT)


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def _assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(set(a) ^ set(b))}"
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{what}: {len(differ)} tensors differ, e.g. {differ[:5]}"


def _flat_tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested dict/list (e.g. an optimizer state dict), by path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else []
    out = {}
    for k, v in items:
        out.update(_flat_tensors(v, f"{prefix}/{k}"))
    return out


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------
# a checkpoint folder: every file loads, with the step its name says
# ---------------------------------------------------------------------------------------------
def _step_of(path: Path) -> int | None:
    m = re.search(r"step=(\d+)", path.name)
    return int(m.group(1)) if m else None


def _check_checkpoint_folder(folder: Path, killed: int | None = None) -> dict[Path, int]:
    """Every file in ``folder`` is a ``.ckpt`` that loads, with the global step its name says. ``killed``: the pid
    of a process SIGKILLed while it wrote here, whose hidden temporary files (``.<name>.tmp-<pid>@<host>-...``, which
    the next save into the folder removes) are set aside."""
    files = sorted(folder.iterdir()) if folder.exists() else []
    if killed is not None:
        files = [f for f in files if not (f.name.startswith(".") and f".tmp-{killed}@" in f.name)]
    strays = [f.name for f in files if f.suffix != ".ckpt"]
    assert not strays, f"non-checkpoint files in the checkpoint folder: {strays}"
    steps = {}
    for f in files:
        try:
            ckpt = _load(f)
        except Exception as err:  # noqa: BLE001 - report which file and why
            raise AssertionError(f"{f.name} ({f.stat().st_size} bytes) does not load: {err!r}") from err
        step = ckpt["global_step"]
        if _step_of(f) is not None:
            assert step == _step_of(f), (f.name, step)
        assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values()), f.name
        steps[f] = step
    listing = {f.name: s for f, s in steps.items()}
    # no versioned file (last-v1.ckpt, epoch=0-step=3-v1.ckpt): nothing was written twice under one name
    assert not [name for name in listing if re.search(r"-v\d+\.ckpt$", name)], f"versioned checkpoints: {listing}"
    named = [s for f, s in steps.items() if _step_of(f) is not None]
    last = folder / "last.ckpt"
    if last in steps and named:
        # last.ckpt is written right after the step file: at most one step behind it, even after a kill
        assert steps[last] >= max(named) - 1, f"a stale last.ckpt: {listing}"
    return steps
