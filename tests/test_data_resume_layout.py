"""A resumed fit's data layout: the data position is a per-rank batch count, so a resume that changes what it counts
in (data.batch_size x world size, updates_per_rollout, accumulate_grad_batches) is refused in one line; a global
batch split over another number of ranks continues exactly (the same prompts a step)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn

from cli_harness import CONFIGS, entry_point, make_env, start_cli, wait_all
from rloo_lightning.data import PromptDataModule, ResumableSampler
from rloo_lightning.data.resume_layout import data_layout, layout_change

QUICKSTART = str(CONFIGS / "quickstart.yaml")
FINAL = "--trainer.callbacks+=rloo_lightning.callbacks.checkpoint.FinalCheckpoint"
RECORDER = "--trainer.callbacks+=reliability_helpers.callbacks.RolloutRecorder"
CKPT = "runs/last.ckpt"


def _global_batches(n: int, world: int, batch: int, repeat: int, consumed: int) -> list[list[int]]:
    """The prompts of each step from ``consumed`` per-rank batches on (one epoch's rest), all ranks together."""
    per_rank = [list(ResumableSampler(range(n), num_replicas=world, rank=r, seed=3, batch_size=batch, repeat=repeat,
                                      position=lambda: consumed)) for r in range(world)]
    steps = len(per_rank[0]) // batch
    return [sorted(i for rank in per_rank for i in rank[s * batch:(s + 1) * batch]) for s in range(steps)]


@pytest.mark.parametrize("n", [37, 64])
@pytest.mark.parametrize("repeat", [1, 2])
def test_a_global_batch_split_over_other_ranks_is_the_same_prompts_at_every_position(n, repeat):
    """The rule's ground: with batch_size x world size unchanged, every position (mid-epoch, in a later epoch, between
    two updates of a rollout) points at the same prompts, only split differently over the ranks."""
    per_epoch = n // 8 * repeat
    for consumed in range(3 * per_epoch):
        ref = _global_batches(n, 1, 8, repeat, consumed)
        assert ref, consumed
        for world, batch in ((2, 4), (4, 2), (8, 1)):
            assert _global_batches(n, world, batch, repeat, consumed) == ref, (world, batch, consumed)
    # the control: another global batch at the same position is other prompts
    assert _global_batches(n, 1, 4, repeat, repeat) != _global_batches(n, 1, 8, repeat, repeat)


BASE = data_layout(batch_size=8, world_size=1, repeat_batches=1, accumulate_grad_batches=1)


@pytest.mark.parametrize("now, expected", [
    (dict(batch_size=4, world_size=2), None),  # the same 8 prompts a step
    (dict(batch_size=1, world_size=8), None),
    (dict(batch_size=4), "data.batch_size was 8 in runs/last.ckpt, is 4 now: the data position it holds counts "
                         "batches of 8 prompts on each of 1 rank (8 a step), so this run would not continue from the "
                         "prompt where that one stopped; resume with data.batch_size 8, or start a new run from its "
                         "weights (rloo-lightning export, then --model.model_name_or_path)"),
    (dict(world_size=2), "the world size (trainer.devices x trainer.num_nodes) was 1 in runs/last.ckpt, is 2 now: "),
    (dict(world_size=2), "resume with data.batch_size 4, or"),
    (dict(world_size=3), "resume with data.batch_size 8 on 1 rank, or"),
    (dict(batch_size=3, world_size=2), "data.batch_size was 8 in runs/last.ckpt, is 3 now; the world size "
                                       "(trainer.devices x trainer.num_nodes) was 1 in runs/last.ckpt, is 2 now"),
    (dict(repeat_batches=2), "model.update.updates_per_rollout was 1 in runs/last.ckpt, is 2 now: "),
    (dict(repeat_batches=2, batch_size=4, world_size=2), "resume with model.update.updates_per_rollout 1, or"),
    (dict(accumulate_grad_batches=2), "resume with trainer.accumulate_grad_batches 1, or"),
])
def test_layout_change_names_each_changed_option_or_accepts_the_same_global_batch(now, expected):
    got = layout_change(BASE, {**BASE, **now}, CKPT)
    if expected is None:
        assert got is None
    else:
        assert got is not None and expected in got, got
        assert "\n" not in got


def test_layout_change_names_the_saved_runs_repeats_and_accumulation():
    saved = data_layout(batch_size=4, world_size=2, repeat_batches=2, accumulate_grad_batches=3)
    got = layout_change(saved, {**saved, "batch_size": 2}, CKPT)
    assert "counts batches of 4 prompts on each of 2 ranks (8 a step, each used for 2 updates, 3 an optimizer " \
           "step)" in got, got
    assert "resume with data.batch_size 4, or" in got, got


def test_a_checkpoint_without_a_layout_is_not_checked():
    assert layout_change({}, BASE, CKPT) is None  # written before the layout was stored: resumes as before
    assert layout_change({"batch_size": 8}, {**BASE, "batch_size": 4}, CKPT) is None


# --- the data module's state (a trainer stand-in: no model, no data loaded) ----------------------------------


def _data(batch_size: int = 8, repeat_batches: int = 1, fn=TrainerFn.FITTING, world_size: int = 1,
          accumulate: int = 1) -> PromptDataModule:
    data = PromptDataModule(tokenizer_name_or_path="unused", task="reverse", batch_size=batch_size,
                            repeat_batches=repeat_batches)
    data.trainer = SimpleNamespace(state=SimpleNamespace(fn=fn), world_size=world_size, global_rank=0,
                                   accumulate_grad_batches=accumulate, ckpt_path=CKPT)
    return data


def test_fit_checkpoint_stores_the_layout_and_a_resume_with_another_is_refused():
    saved = _data(world_size=2, accumulate=2).state_dict()
    assert saved == {"layout": {"batch_size": 8, "world_size": 2, "repeat_batches": 1, "accumulate_grad_batches": 2}}
    with pytest.raises(ValueError, match=r"^data.batch_size was 8 in runs/last.ckpt, is 2 now; the world size"):
        _data(batch_size=2, world_size=4, accumulate=1).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"^the world size \(trainer.devices x trainer.num_nodes\) was 2 in "
                                         r"runs/last.ckpt, is 1 now: .* resume with data.batch_size 16, or "):
        _data(world_size=1, accumulate=2).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"^model.update.updates_per_rollout was 1 in runs/last.ckpt, is 3 now"):
        _data(repeat_batches=3, world_size=2, accumulate=2).load_state_dict(saved)


def test_same_global_batch_on_other_ranks_resumes_with_one_line(caplog):
    saved = _data(world_size=2).state_dict()
    with caplog.at_level("INFO"):
        _data(batch_size=4, world_size=4).load_state_dict(saved)
        _data(world_size=2).load_state_dict(saved)  # unchanged: no line
    lines = [r.getMessage() for r in caplog.records if "resumed with" in r.getMessage()]
    assert lines == ["PromptDataModule: resumed with data.batch_size 4 on 4 ranks, where the checkpoint's run had 8 "
                     "on 2: the same 16 prompts a step, so it continues from the prompt where that run stopped"], lines


@pytest.mark.parametrize("fn", [TrainerFn.VALIDATING, TrainerFn.TESTING, TrainerFn.PREDICTING])
def test_evaluation_from_a_checkpoint_takes_any_batch_size(fn):
    saved = _data().state_dict()
    data = _data(batch_size=2, fn=fn)
    data.load_state_dict(saved)  # no data position is used: nothing to refuse
    assert data.state_dict() == {}  # and nothing to store outside fit


def test_a_checkpoint_of_an_earlier_version_resumes_unchecked():
    _data(batch_size=2).load_state_dict({})  # no layout: the position is taken as before
    _data(batch_size=2).load_state_dict({"held_out": {"validation_rows": 3, "source_rows": 30, "seed": 0,
                                                      "train_file": "x.jsonl"}})


# --- the real command (subprocesses) -------------------------------------------------------------------------


def _fit_args(root: Path, model_dir: str, max_steps: int, *extra) -> list:
    """The quickstart with 16 rows in batches of 4 (an epoch is 4 steps) and last.ckpt at the end."""
    return ["fit", "--config", QUICKSTART, "--model.model_name_or_path", model_dir, "--trainer.max_steps", max_steps,
            "--trainer.val_check_interval", 100, "--trainer.limit_val_batches", 0, "--trainer.default_root_dir", root,
            "--trainer.enable_progress_bar", "false", "--data.num_val_rows", 8, "--data.num_train_rows", 16,
            "--data.batch_size", 4, FINAL, *extra]


def _records(path: Path) -> dict[int, list[str]]:
    """``{step: the step's prompts, all ranks together}`` of a RolloutRecorder file and its ``.rank<r>`` siblings."""
    steps: dict[int, list[str]] = {}
    for file in sorted(path.parent.glob(path.name + "*")):
        for line in file.read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["global_step"], []).extend(record["prompts"])
    return {step: sorted(prompts) for step, prompts in steps.items()}


@pytest.fixture(scope="module")
def started(tmp_path_factory, tiny_model_dir, _cache_dir):
    """``first``: fit 2 steps (last.ckpt mid-epoch); ``whole``: fit 6 steps uninterrupted, its prompts recorded."""
    env = make_env(_cache_dir)
    root = tmp_path_factory.mktemp("resume_layout")
    first = start_cli("first", _fit_args(root / "first", tiny_model_dir, 2), root / "first", env)
    whole = start_cli("whole", _fit_args(root / "whole", tiny_model_dir, 6, RECORDER,
                                         f"--trainer.callbacks.path={root / 'whole' / 'rollouts.jsonl'}"),
                      root / "whole", env)
    wait_all(first, whole)
    first.check()
    whole.check()
    ckpt = root / "first" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"] == 2
    return {"root": root, "ckpt": ckpt, "env": env, "whole": _records(root / "whole" / "rollouts.jsonl")}


@pytest.mark.slow
def test_cli_resume_with_another_batch_size_or_updates_per_rollout_is_refused_before_a_step(started, tiny_model_dir):
    root, ckpt = started["root"], started["ckpt"]
    runs = {name: start_cli(name, _fit_args(root / name, tiny_model_dir, 4, "--ckpt_path", ckpt, *extra), root / name,
                            started["env"])
            for name, extra in (("batch", ("--data.batch_size", 2)),
                                ("updates", ("--model.update.updates_per_rollout", 2)))}
    wait_all(*runs.values())
    expected = {"batch": f"error: data.batch_size was 4 in {ckpt}, is 2 now: the data position it holds counts "
                         "batches of 4 prompts on each of 1 rank (4 a step), so this run would not continue from the "
                         "prompt where that one stopped; resume with data.batch_size 4, or start a new run from its "
                         "weights (rloo-lightning export, then --model.model_name_or_path)",
                "updates": f"error: model.update.updates_per_rollout was 1 in {ckpt}, is 2 now: "}
    for name, run in runs.items():
        assert run.rc == 1, run.explain()
        errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(expected[name]), run.explain()
        assert "train step" not in run.log, run.explain()  # refused before the first step
        assert not list((root / name).rglob("*.ckpt")), run.explain()


@pytest.mark.slow
def test_cli_resume_on_two_ranks_with_half_the_batch_sees_the_uninterrupted_runs_prompts(started, tiny_model_dir):
    """Resumed from step 2 (1 rank x 4 prompts) with DDP on 2 ranks x 2 prompts, to step 6 (across an epoch's end):
    each step's prompts, both ranks together, are those of the uninterrupted 1-rank run."""
    root, ckpt = started["root"], started["ckpt"]
    name = "ddp"
    run = start_cli(name, _fit_args(root / name, tiny_model_dir, 6, "--ckpt_path", ckpt, "--data.batch_size", 2,
                                    "--trainer.strategy", "ddp", "--trainer.devices", 2, RECORDER,
                                    f"--trainer.callbacks.path={root / name / 'rollouts.jsonl'}"),
                    root / name, started["env"], command=entry_point()).wait()
    run.check()
    assert "the same 4 prompts a step, so it continues from the prompt where that run stopped" in run.log, run.explain()
    resumed, whole = _records(root / name / "rollouts.jsonl"), started["whole"]
    assert sorted(resumed) == [2, 3, 4, 5], sorted(resumed)
    assert resumed == {step: whole[step] for step in resumed}, (resumed, whole)
