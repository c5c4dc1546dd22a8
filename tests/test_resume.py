"""Exact resume and crash safety through the CLI: a run stopped mid-epoch or at an epoch's end and resumed ends
bit-identical to the uninterrupted one, a SIGKILL at any point leaves checkpoints that load and resume exactly, the
checkpoint holds the policy and beta only, and a DDP fit on CPU runs to completion.

Every training run is a subprocess (``python -m rloo_lightning fit``): DDP forks, and a SIGKILL needs a process of
its own. The model is the ``tiny_model_dir`` fixture (the quickstart's tokenizer and context, a smaller net) instead
of ``tiny:reverse``, whose warm start alone takes a minute on 2 cores; everything else is
``configs/quickstart.yaml`` with small data sizes (``tests/helpers/run_helpers.py``):

* ``--data.num_train_rows 16 --data.batch_size 4``: an epoch is 4 steps, so a run of 10 steps
  crosses two epoch boundaries and a resume at step 5 is mid-epoch.
* Independent runs are started together (2 cores), then checked.

Helpers (``tests/helpers/`` is put on the subprocesses' ``PYTHONPATH``):

* ``reliability_helpers.callbacks``: ``RolloutRecorder`` (prompts and completions of every step); its
  ``PoisonReward`` / ``PoisonGrad`` are the NaN/inf guard's (``test_update_nonfinite_guard_runs.py``).
* ``reliability_helpers/ddp_fixed_rollout.py``: a Trainer with an RLOOModule whose rollout is a
  fixed function of the prompt text, single-process or DDP, saving gradients and metrics. Its tests (DDP's
  sampler shards, kept rows, gradients and logged metrics equal one process's) are in
  ``test_models_sharding_runs.py``, whose helper process pair runs the DDP fits beside the FSDP2 ones.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path

import pytest
import torch

from cli_harness import Proc, entry_point, make_env, start_cli, wait_all
from rloo_lightning.runtime.tensorboard_logs import read_scalars
from run_helpers import (
    BATCH,
    FINAL_CHECKPOINT,
    N,
    ROWS,
    STEPS_PER_EPOCH,
    TIMEOUT,
    TOTAL,
    _assert_same_tensors,
    _check_checkpoint_folder,
    _ckpt_every_step,
    _cli,
    _fit_args,
    _flat_tensors,
    _jsonl,
    _load,
    _recorder,
    _step_of,
)

pytestmark = pytest.mark.slow  # every run here is a subprocess


def _only_ckpt(folder: Path) -> Path:
    """The run's one step checkpoint; a last.ckpt beside it (FinalCheckpoint's) must be of the same step."""
    ckpts = sorted(p for p in folder.glob("*.ckpt") if p.name != "last.ckpt")
    assert len(ckpts) == 1, sorted(p.name for p in folder.glob("*.ckpt"))
    if (folder / "last.ckpt").exists():
        assert _load(folder / "last.ckpt")["global_step"] == _load(ckpts[0])["global_step"]
    return ckpts[0]


def _policy_state(ckpt: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in ckpt["state_dict"].items() if k.startswith("policy.")}


def _train_tags(scalars: dict) -> list[str]:
    return sorted(t for t in scalars if t.startswith("train/"))


# ---------------------------------------------------------------------------------------------
# exact resume (its uninterrupted run is also the reference for the crash test and checkpoint size)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory, tiny_model_dir, _cache_dir):
    """A: fit to 2N. B1: fit to N, checkpointing every step; B2: ``--ckpt_path`` B1's last.ckpt, to 2N.

    Also E1: from B1's checkpoint at the last batch of epoch 0 (step 4) to 2N, checkpointing every
    step, and E2: from E1's checkpoint at the last batch of epoch 1 (step 8) to 2N.
    """
    env = make_env(_cache_dir)
    a_root, b_root, e_root = (tmp_path_factory.mktemp(n) for n in ("resume_a", "resume_b", "resume_e"))
    a = _cli("a", _fit_args(a_root, tiny_model_dir, TOTAL, *_recorder(a_root / "rollouts.jsonl")), a_root, env)
    b1 = _cli("b1", _fit_args(b_root, tiny_model_dir, N, *_ckpt_every_step(b_root / "ckpt"),
                              *_recorder(b_root / "rollouts.jsonl")), b_root, env)
    wait_all(a, b1)
    a.check()
    b1.check()
    b1_ckpt = b_root / "ckpt" / "last.ckpt"
    b2 = _cli("b2", _fit_args(b_root, tiny_model_dir, TOTAL, "--ckpt_path", str(b1_ckpt),
                              *_recorder(b_root / "rollouts.jsonl")), b_root, env)
    e1 = _cli("e1", _fit_args(e_root / "e1", tiny_model_dir, TOTAL, *_ckpt_every_step(e_root / "e1_ckpt"),
                              "--ckpt_path", str(b_root / "ckpt" / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt")),
              e_root, env)
    wait_all(b2, e1)
    b2.check()
    e1.check()
    e2 = _cli("e2", _fit_args(e_root / "e2", tiny_model_dir, TOTAL, *_ckpt_every_step(e_root / "e2_ckpt"),
                              "--ckpt_path", str(e_root / "e1_ckpt" / f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt"),
                              *_recorder(e_root / "e2_rollouts.jsonl")), e_root, env).wait()
    e2.check()
    return {
        "a": a_root / "lightning_logs" / "version_0",
        "b1": b_root / "lightning_logs" / "version_0",
        "b2": b_root / "lightning_logs" / "version_1",
        "b1_ckpt": b1_ckpt,
        "a_rollouts": _jsonl(a_root / "rollouts.jsonl"),
        "b_rollouts": _jsonl(b_root / "rollouts.jsonl"),
        "b2_log": b2.stdout + b2.stderr,
        "e1_ckpt": e_root / "e1_ckpt",
        "e2_ckpt": e_root / "e2_ckpt",
        "e2_rollouts": _jsonl(e_root / "e2_rollouts.jsonl"),
    }


def test_resume_checkpoint_is_mid_epoch(resume_runs):
    ckpt = _load(resume_runs["b1_ckpt"])
    assert ckpt["global_step"] == N
    assert N % STEPS_PER_EPOCH != 0  # the point of the test: N is not an epoch boundary
    assert ckpt["epoch"] == N // STEPS_PER_EPOCH
    assert "Restored all states from the checkpoint" in resume_runs["b2_log"]


def test_resume_to_2n_is_bit_identical_to_an_uninterrupted_run(resume_runs):
    a = _load(_only_ckpt(resume_runs["a"] / "checkpoints"))
    b = _load(_only_ckpt(resume_runs["b2"] / "checkpoints"))
    assert a["global_step"] == b["global_step"] == TOTAL
    assert a["epoch"] == b["epoch"] == TOTAL // STEPS_PER_EPOCH  # crossed epoch boundaries at 4 and 8
    _assert_same_tensors(a["state_dict"], b["state_dict"], "final state_dict")
    _assert_same_tensors(_flat_tensors(a["optimizer_states"]), _flat_tensors(b["optimizer_states"]),
                         "final optimizer state")
    assert a["lr_schedulers"] == b["lr_schedulers"]


def test_resume_replays_the_same_prompts_and_completions(resume_runs):
    """Data order (mid-epoch skip, next epoch's shuffle) and sampling seeds continue exactly."""
    a = {r["global_step"]: r for r in resume_runs["a_rollouts"]}
    b = resume_runs["b_rollouts"]  # B1's steps 0..N-1, then B2's N..2N-1
    assert [r["global_step"] for r in b] == list(range(TOTAL)), [r["global_step"] for r in b]
    assert sorted(a) == list(range(TOTAL))
    for r in b:
        ref = a[r["global_step"]]
        assert (r["epoch"], r["prompts"], r["completions"], r["rewards"]) == (
            ref["epoch"], ref["prompts"], ref["completions"], ref["rewards"]), f"step {r['global_step']}"
    # B2 continued epoch 1 mid-way (no prompt seen twice in that epoch) and went into epoch 2
    epoch1 = [p for r in b if r["epoch"] == 1 for p in r["prompts"]]
    assert len(epoch1) == len(set(epoch1)) == ROWS
    assert {r["epoch"] for r in b if r["global_step"] >= N} == {1, 2}


def test_resume_logs_identical_train_metrics(resume_runs):
    a, b1, b2 = (read_scalars(resume_runs[k]) for k in ("a", "b1", "b2"))
    tags = _train_tags(a)
    for tag in ("train/reward", "train/kl", "train/loss", "train/entropy", "train/completion_length"):
        assert tag in tags, tags
    for tag in tags:
        assert sorted(b1[tag]) == list(range(N)), (tag, sorted(b1[tag]))
        assert sorted(b2[tag]) == list(range(N, TOTAL)), (tag, sorted(b2[tag]))  # no step replayed or lost
        for step in range(N, TOTAL):
            assert b2[tag][step] == a[tag][step], (tag, step, b2[tag][step], a[tag][step])
        for step in range(N):
            assert b1[tag][step] == a[tag][step], (tag, step)


def test_resume_from_a_checkpoint_at_the_last_batch_of_an_epoch_is_exact(resume_runs):
    """E1 resumed from step 4, saved by ``every_n_train_steps`` on epoch 0's last batch (before the
    epoch's end hooks): Lightning finishes epoch 0 on restore and E1 goes on with epoch 1."""
    ref = _load(_only_ckpt(resume_runs["a"] / "checkpoints"))
    end = _load(resume_runs["e1_ckpt"] / "last.ckpt")
    assert end["global_step"] == TOTAL
    _assert_same_tensors(end["state_dict"], ref["state_dict"], "E1 (resumed from step 4) vs uninterrupted")


def test_second_resume_through_epoch_end_checkpoints_is_exact(resume_runs):
    # E1 was itself resumed from a last-batch checkpoint (step 4); Lightning 2.6's _FitLoop.reset()
    # then finishes epoch 0 but keeps restart stage RESTARTED_MID_EPOCH through the next
    # on_advance_start, so epoch 1 never gets epoch_progress.increment_ready/started: E1's step-8
    # checkpoint says epoch 1 where the uninterrupted run is in epoch 2. The data order must not
    # depend on that counter: ResumableSampler derives it from the global step, so steps 8 and 9
    # take epoch 2's batches and the weights match. (Lightning's own epoch label still lags: not compared.)
    ref = _load(_only_ckpt(resume_runs["a"] / "checkpoints"))
    a_rollouts = {r["global_step"]: r for r in resume_runs["a_rollouts"]}
    e2 = resume_runs["e2_rollouts"]
    seen = [(r["global_step"], r["prompts"]) for r in e2]
    expected = [(s, a_rollouts[s]["prompts"]) for s in range(2 * STEPS_PER_EPOCH, TOTAL)]
    assert seen == expected, f"E2 (resumed from E1's step 8) took {seen}; the uninterrupted run took {expected}"
    end = _load(resume_runs["e2_ckpt"] / "last.ckpt")
    _assert_same_tensors(end["state_dict"], ref["state_dict"], "E2 (resumed twice) vs uninterrupted")


# ---------------------------------------------------------------------------------------------
# lean checkpoints
# ---------------------------------------------------------------------------------------------
def test_checkpoint_holds_policy_and_beta_only_and_is_lean(resume_runs, tiny_model_dir):
    """The frozen reference is not a registered submodule, so it is not in the checkpoint.

    A full-training checkpoint holds weights (1x) plus AdamW's exp_avg and exp_avg_sq (2x): about
    3x the parameter bytes, so the bound is "params + optimizer state + 64 KiB" and "< 3.5x params"
    (a reference copy would make it >= 4x). Measured: 3.22x here, 3.06x for the quickstart's
    ``tiny:reverse`` (132,224 parameters: 1,616,493 bytes on disk).
    """
    from rloo_lightning.models import load_causal_lm

    path = _only_ckpt(resume_runs["a"] / "checkpoints")
    ckpt = _load(path)
    state = ckpt["state_dict"]
    policy = load_causal_lm(tiny_model_dir)
    # exactly the policy's state dict (tied lm_head included) plus the beta buffer
    assert set(state) == {f"policy.{k}" for k in policy.state_dict()} | {"beta"}, sorted(state)
    assert not any(re.search(r"ref", k, re.IGNORECASE) for k in state)
    assert state["beta"].numel() == 1

    param_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())  # tied weights once
    opt_bytes = sum(t.numel() * t.element_size() for t in _flat_tensors(ckpt["optimizer_states"]).values())
    size = path.stat().st_size
    figures = {
        "checkpoint_bytes": size,
        "policy_param_bytes": param_bytes,
        "optimizer_state_bytes": opt_bytes,
        "size_over_params": round(size / param_bytes, 3),
        "size_over_params_plus_optimizer": round(size / (param_bytes + opt_bytes), 3),
    }
    print(f"\nlean checkpoint figures ({path.name}): {json.dumps(figures)}")
    # AdamW keeps exp_avg and exp_avg_sq (2x the parameters) plus a step count per parameter
    assert 2 * param_bytes <= opt_bytes <= 2 * param_bytes + 64 * len(list(policy.parameters()))
    # weights 1x + AdamW 2x + metadata; a reference copy would add another 1x (>= 4x in all)
    margin = 64 * 1024
    assert size <= param_bytes + opt_bytes + margin, figures
    assert size < 3.5 * param_bytes, figures


# ---------------------------------------------------------------------------------------------
# DDP on CPU (gloo)
# ---------------------------------------------------------------------------------------------
def test_ddp_cli_fit_runs_to_completion(tmp_path, tiny_model_dir, _cache_dir):
    """Also the user's path under DDP: the reward is a file in the working directory and the run is the installed
    script, which does not put that folder on ``sys.path``. Lightning starts rank 1 by re-running the command,
    so ``main()`` adds the folder there too."""
    steps = 3
    (tmp_path / "myreward.py").write_text("from rloo_lightning.tasks.reverse import reward as score  # noqa: F401\n")
    # validation at the last step: with check_val_every_n_epoch=null (quickstart), Lightning's default
    # ModelCheckpoint saves after validation only, so a run that ends between validations has no checkpoint
    args = _fit_args(tmp_path, tiny_model_dir, steps, "--trainer.strategy", "ddp", "--trainer.devices", "2",
                     "--trainer.val_check_interval", str(steps), "--data.num_train_rows", "32",
                     "--model.rewards.funcs", "[myreward.score]",
                     *_recorder(tmp_path / "rollouts.jsonl"),
                     # callbacks that reduce across ranks (KL max, filter counts) or export on rank 0
                     "--trainer.callbacks+=rloo_lightning.callbacks.KLMonitor",
                     "--trainer.callbacks+=rloo_lightning.callbacks.ZeroVarianceFilter",
                     "--trainer.callbacks+=rloo_lightning.callbacks.RewardVarianceLogger",
                     "--trainer.callbacks+=rloo_lightning.callbacks.HFExport",
                     FINAL_CHECKPOINT)  # last.ckpt at the end: trainer.save_checkpoint on both ranks
    run = start_cli("ddp", args, tmp_path, make_env(_cache_dir), timeout=TIMEOUT, command=entry_point()).wait()
    run.check()
    assert "distributed_backend=gloo" in run.stdout + run.stderr, run.explain()
    assert "No module named" not in run.log
    version = tmp_path / "lightning_logs" / "version_0"
    scalars = read_scalars(version)
    for tag in ("train/reward", "train/kl", "train/loss", "train/entropy", "val/reward", "train/kl_token_max",
                "train/kl_seq_q90", "train/filtered_groups", "train/group_reward_std_mean"):
        assert tag in scalars, sorted(scalars)
    assert (version / "hf_model" / "config.json").is_file()  # HFExport on rank 0 without a hang
    assert sorted(scalars["train/reward"]) == list(range(steps))
    assert sorted(scalars["val/reward"]) == [0, steps - 1]  # before training (step 0) and after step 3
    ckpt = _load(_only_ckpt(version / "checkpoints"))
    assert ckpt["global_step"] == steps
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())
    last = _load(version / "checkpoints" / "last.ckpt")  # FinalCheckpoint's, beside the validation-time one
    assert last["global_step"] == steps
    _assert_same_tensors(last["state_dict"], ckpt["state_dict"], "last.ckpt vs the step checkpoint under DDP")
    # each rank rolled out its own shard: disjoint prompts, every step, both ranks
    rank0 = _jsonl(tmp_path / "rollouts.jsonl")
    rank1 = _jsonl(tmp_path / "rollouts.jsonl.rank1")
    assert [r["global_step"] for r in rank0] == [r["global_step"] for r in rank1] == list(range(steps))
    for r0, r1 in zip(rank0, rank1):
        assert len(r0["prompts"]) == len(r1["prompts"]) == BATCH
        assert not set(r0["prompts"]) & set(r1["prompts"]), (r0["prompts"], r1["prompts"])


# ---------------------------------------------------------------------------------------------
# crash safety: SIGKILL at several points, every checkpoint loads, resume finishes
# ---------------------------------------------------------------------------------------------
def _newest(steps: dict[Path, int]) -> Path:
    """last.ckpt if it is the newest, else the newest step file."""
    best = max(steps.values())
    last = [f for f, s in steps.items() if f.name == "last.ckpt" and s == best]
    return last[0] if last else max((f for f, s in steps.items() if s == best), key=lambda f: f.name)


def _resume_point(steps: dict[Path, int]) -> Path:
    """The newest complete checkpoint (epoch-end ones included: the data order follows the global step)."""
    return _newest(steps)


def _temp_files(folder: Path) -> set[str]:
    """``tmp*`` regular files: fsspec's ``tempfile.mkstemp()`` names (torch also makes a ``torchinductor_*`` dir)."""
    return {e.name for e in os.scandir(folder) if e.name.startswith("tmp") and e.is_file()}


def test_sigkill_leaves_loadable_checkpoints_and_resume_is_exact(tmp_path, tiny_model_dir, _cache_dir, resume_runs):
    """Kill -9 a fit that checkpoints every step (a step takes ~60 ms here, a save ~0.5 ms):

    1. as soon as the first checkpoint file appears;
    2. resumed, at a random delay after its first new checkpoint;
    3. resumed, the moment a temp file of a save in progress shows up in TMPDIR (Lightning's
       ``_atomic_save`` writes through an fsspec transaction: ``tempfile.mkstemp()`` then a move),
       else one step before the end.

    After each kill, every file in the checkpoint folder is a ``.ckpt`` that loads, with a global
    step matching its name and finite weights, and no file is versioned (``last-v1.ckpt``). last.ckpt
    is at most one step behind the newest step file and, after a resume, never behind the checkpoint
    resumed from. The last resume finishes with last.ckpt the newest checkpoint, bit-identical to the
    resume test's uninterrupted run (same arguments but the checkpoint callbacks).

    (The flake this guards against: a run resumed from a step file, with last.ckpt one step behind it,
    killed between its first step file and its first last.ckpt, left last.ckpt two steps behind; and a
    ModelCheckpoint restored from a checkpoint written before its run's first last.ckpt writes
    last-v1.ckpt beside an existing last.ckpt. FinalCheckpoint fixes both on resume.)
    """
    ckdir = tmp_path / "ckpt"
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    env = make_env(_cache_dir, TMPDIR=str(tmpdir))
    rng = random.Random(6)
    log = []

    def start(i: int, ckpt: Path | None) -> Proc:
        extra = _ckpt_every_step(ckdir) + (["--ckpt_path", str(ckpt)] if ckpt else [])
        return _cli(f"run{i}", _fit_args(tmp_path, tiny_model_dir, TOTAL, *extra), tmp_path, env)

    def newest_step() -> int:
        return max((_step_of(f) or 0 for f in ckdir.glob("*.ckpt")), default=0)

    def wait_until(proc: Proc, cond, poll: float = 0.005) -> None:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and proc.popen.poll() is None and not cond():
            time.sleep(poll)

    resume_from: Path | None = None
    known = _temp_files(tmpdir)
    mid_save = []  # temp files a kill left behind: (name, bytes, loads)
    newest_before = 0
    for i, how in enumerate(["first checkpoint", "random delay", "during a save"]):
        proc = start(i, resume_from)
        if how == "first checkpoint":
            wait_until(proc, lambda: any(ckdir.glob("*.ckpt")), poll=0.001)
        elif how == "random delay":
            wait_until(proc, lambda before=newest_before: newest_step() > before)
            time.sleep(rng.uniform(0.0, 0.15))
        else:
            wait_until(proc, lambda before=newest_before: newest_step() > before)
            polls = 0
            while proc.popen.poll() is None:  # busy poll: a temp file lives ~0.5 ms
                if _temp_files(tmpdir) - known:
                    break
                polls += 1
                if polls % 256 == 0 and newest_step() >= TOTAL - 1:
                    break
        alive = proc.popen.poll() is None
        proc.sigkill()
        leftovers = sorted(_temp_files(tmpdir) - known)
        known |= set(leftovers)
        for name in leftovers:
            try:
                _load(tmpdir / name)
                loads = True
            except Exception:  # noqa: BLE001 - a partial write
                loads = False
            mid_save.append((name, (tmpdir / name).stat().st_size, loads))
        # a kill inside an atomic save leaves its hidden temporary file beside last.ckpt: the next save removes it
        # (checked after the final run, below)
        steps = _check_checkpoint_folder(ckdir, killed=proc.popen.pid)
        assert steps, f"kill {i} ({how}): no checkpoint at all\n{proc.explain()}"
        assert alive or proc.rc == 0, proc.explain()
        if how != "during a save":  # these two must be real kills, or the test tests nothing
            assert alive, f"kill {i} ({how}): the run had already ended\n{proc.explain()}"
        newest = max(steps.values())
        assert newest > newest_before, (how, steps)  # every run got at least one step further
        if resume_from is not None:
            # a resumed run makes last.ckpt the checkpoint it resumed from before its first step: a kill
            # before its first save of last.ckpt must not leave last.ckpt behind the resume point
            resumed_at = _load(resume_from)["global_step"]
            assert steps.get(ckdir / "last.ckpt", -1) >= resumed_at, (how, resume_from.name, steps)
        log.append((how, "killed" if alive else "finished", newest, leftovers))
        newest_before = newest
        resume_from = _resume_point(steps)

    final = _cli("final", _fit_args(tmp_path, tiny_model_dir, TOTAL, *_ckpt_every_step(ckdir),
                                    "--ckpt_path", str(resume_from)), tmp_path, env).wait()
    final.check()
    steps = _check_checkpoint_folder(ckdir)
    print(f"\nkill log (how, outcome, newest step, temp files left in TMPDIR): {log}\n"
          f"temp files left by a kill mid-save (name, bytes, loads): {mid_save}")
    # a temp file never lands in the checkpoint folder (checked above) and never looks like one
    assert not [name for name, _, _ in mid_save if name.endswith(".ckpt")]
    # after the last resume, last.ckpt is the newest checkpoint: the end of the chain
    last = ckdir / "last.ckpt"
    assert last in steps and steps[last] == max(steps.values()) == TOTAL, steps
    end = _load(last)
    reference = _load(_only_ckpt(resume_runs["a"] / "checkpoints"))
    _assert_same_tensors(end["state_dict"], reference["state_dict"], "crash-and-resume vs uninterrupted weights")
