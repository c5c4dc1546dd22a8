"""Sharded training: FSDP2 through ``ModelParallelStrategy`` on 2 CPU processes (gloo), end to end.

Every distributed run is a subprocess (the CLI, or ``tests/helpers/reliability_helpers/sharded_fits.py`` run as a
script); nothing forks inside pytest. The runs start together (2 cores) in one module fixture:

* ``a``: the CLI with ``configs/fsdp2_cpu.yaml``, 4 steps, a sharded checkpoint every step;
* ``b`` (once ``a`` is done): the same, ``--ckpt_path`` A's step-2 checkpoint, to step 4;
* the helper: one pair of processes running ``HELPER_RUNS`` one after another (one start-up, one process
  group, instead of a pair each):
* ``helper_fsdp2`` / ``helper_ddp``: a Trainer on FIXED rollouts (``reliability_helpers.ddp_fixed_rollout``'s
  module: completions a function of the prompt text, plain SGD, rows dropped unevenly from step 1), under
  FSDP2 and under DDP, saving full gradients and weights; FSDP2's run first probes generation (below);
* ``helper_fsdp2_micro``: FSDP2's run with micro-batches, compared with the same DDP run;
* ``helper_fsdp1``: the same probe under Lightning's ``FSDPStrategy`` (FSDP1, ``auto_wrap_policy`` = the
  decoder layer), which refuses a CPU by an exact-type check: a subclass that only passes FSDP
  ``device_id=cpu`` gets past it, for this test only (Lightning itself runs FSDP on GPUs only);
* ``helper_ddp_micro``: the DDP run with micro-batches;
* ``single``: ``reliability_helpers/ddp_fixed_rollout.py`` on one process with both ranks' prompts (2B), the
  reference of the DDP tests at the end of this file (DDP = one process, with and without micro-batches). They
  read the helper's DDP runs, which write the files that script writes (same module, data, seed, steps and rows
  dropped).

The generation probe, in ``training_step`` at step 0 through ``RLOOModule.sample`` (so through
``gathered_for_generation``): rank 0 ends every completion after 1 token (every token is an EOS), rank 1
runs the whole budget (``min_new_tokens``). A ``TorchDispatchMode`` counts the collectives (c10d ops)
dispatched inside ``generate``: 0 with the gathering. The control, ``gather=False`` (policy left sharded,
``synced_gpus=True``): the same lengths, and the counter does see the per-forward all-gathers.

The tiny model is the ``tiny_model_dir`` fixture (conftest). The in-process tests of sharding are in
``test_models_sharding.py``.
"""

from __future__ import annotations

import csv
import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_harness import CONFIGS, HELPERS_DIR, Proc, make_env, start_cli, start_script
from checkpoint_helpers import _dcp_to_dict
from reliability_helpers.sharded_fits import DDP_B, DDP_ROWS, PROBE_TOKENS
from run_helpers import _assert_same_tensors, _flat_tensors, _jsonl


CONFIG = str(CONFIGS / "fsdp2_cpu.yaml")
TIMEOUT = 240  # per subprocess; a healthy run takes 15-40 s here. A deadlock is killed and fails the test.
STEPS, RESUME_AT = 4, 2


# ---------------------------------------------------------------------------------------------------------------
# subprocess plumbing (tests/helpers/cli_harness.py: a run and the ranks it starts are killed together at the timeout)
# ---------------------------------------------------------------------------------------------------------------
def _cli_fit(name: str, root: Path, model_dir: str, max_steps: int, env: dict, *extra: str) -> Proc:
    args = [
        "fit", "--config", CONFIG,
        "--model.model_name_or_path", model_dir,
        "--trainer.max_steps", str(max_steps),
        "--trainer.val_check_interval", str(max_steps),
        "--trainer.default_root_dir", str(root),
        "--trainer.enable_progress_bar", "false",
        "--data.num_train_rows", "32",
        "--data.num_val_rows", "8",
        "--data.batch_size", "4",
        # the reference trails the policy (gathered from the shards) and is checkpointed; HF export gathers too
        "--model.kl.ref_sync_steps", "2",
        "--trainer.callbacks+=rloo_lightning.callbacks.HFExport",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={root / 'ckpt'}",
        "--trainer.callbacks.every_n_train_steps=1",
        "--trainer.callbacks.save_top_k=-1",
        # last.ckpt at the end of fit: a sharded save from on_train_end, on both ranks
        "--trainer.callbacks+=rloo_lightning.callbacks.checkpoint.FinalCheckpoint",
        *extra,
    ]
    return start_cli(name, args, root, env, timeout=TIMEOUT)


# The helper's runs, in order, in one pair of processes (NAME, STRATEGY, STEPS, MICRO-BATCH SIZE, 0 for none):
# FSDP2, FSDP2 with micro-batches (gradient sync off for all but the last micro-batch's backward), DDP, DDP with
# micro-batches (16 rows per rank: 5 + 5 + 5 + 1), FSDP1.
HELPER_RUNS = [("helper_fsdp2", "fsdp2", 2, 0), ("helper_fsdp2_micro", "fsdp2", 2, 5), ("helper_ddp", "ddp", 2, 0),
               ("helper_ddp_micro", "ddp", 2, 5), ("helper_fsdp1", "fsdp1", 1, 0)]
SHARDED_FITS_SCRIPT = str(HELPERS_DIR / "reliability_helpers" / "sharded_fits.py")

# The DDP tests' shapes (the helper's fits take them too): B prompts per rank (DDP_B), 2 steps, 64 rows (DDP_ROWS)
FIXED_ROLLOUT_SCRIPT = str(HELPERS_DIR / "reliability_helpers" / "ddp_fixed_rollout.py")
DDP_STEPS = 2


def _helpers(root: Path, model_dir: str, env: dict) -> Proc:
    args = ["helper", "--model", model_dir, "--out", root / "out"]
    for run in HELPER_RUNS:
        args += ["--run", *run]
    return start_script("helpers", SHARDED_FITS_SCRIPT, args, root, env, timeout=TIMEOUT)


def _single(root: Path, model_dir: str, env: dict) -> Proc:
    """The fixed-rollout script on one process with 2B prompts a step: what the helper's DDP runs equal."""
    args = ["--model", model_dir, "--out", root / "out", "--devices", 1, "--batch-size", 2 * DDP_B,
            "--steps", DDP_STEPS, "--num-train-rows", DDP_ROWS]
    return start_script("single", FIXED_ROLLOUT_SCRIPT, args, root, env, timeout=TIMEOUT)


# ---------------------------------------------------------------------------------------------------------------
# the runs
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, _cache_dir):
    env = make_env(_cache_dir)
    root = tmp_path_factory.mktemp("sharded")
    t0 = time.monotonic()
    procs = {"a": _cli_fit("a", root / "a", tiny_model_dir, STEPS, env),
             "helpers": _helpers(root / "helpers", tiny_model_dir, env),
             "single": _single(root / "single", tiny_model_dir, env)}
    if procs["a"].wait().rc == 0:  # resume from A's own step-2 checkpoint, to step 4: compared with A's step 4
        procs["b"] = _cli_fit("b", root / "b", tiny_model_dir, STEPS, env, "--ckpt_path",
                              str(_ckpt(root / "a", RESUME_AT)))
    for p in procs.values():
        p.wait()
    print(f"sharded runs: {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return {"root": root, "procs": procs}


def _ckpt(run_root: Path, step: int) -> Path:
    found = sorted((run_root / "ckpt").glob(f"epoch=*-step={step}.ckpt"))
    assert len(found) == 1, sorted(p.name for p in (run_root / "ckpt").iterdir())
    return found[0]


def _ok(runs, name: str) -> Proc:
    assert name in runs["procs"], f"{name} did not run (an earlier run failed)"
    return runs["procs"][name].check()


def _helper_out(runs, name: str) -> Path:
    """The output folder of one of the helper's runs (all of them succeeded: the process exited 0)."""
    return _ok(runs, "helpers").cwd / "out" / name


# ---------------------------------------------------------------------------------------------------------------
# FSDP2 through the CLI: fit, sharded checkpoints, resume
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # the `runs` fixture: distributed subprocesses
def test_fsdp2_cli_fit_shards_the_policy_and_writes_sharded_checkpoints(runs):
    a = _ok(runs, "a")
    log = a.log
    assert "distributed_backend=gloo" in log, a.explain()
    assert "ModelParallelStrategy" in (runs["root"] / "a" / "lightning_logs" / "version_0" / "config.yaml").read_text()
    ckpt = _ckpt(runs["root"] / "a", STEPS)
    assert ckpt.is_dir(), ckpt  # a sharded checkpoint is a folder
    shards = sorted(p.name for p in ckpt.glob("*.distcp"))
    assert len(shards) == 2, shards  # one file per rank: the policy really was sharded
    meta = torch.load(ckpt / "meta.pt", map_location="cpu", weights_only=False)
    assert meta["global_step"] == STEPS
    last = runs["root"] / "a" / "ckpt" / "last.ckpt"  # FinalCheckpoint's, sharded too
    assert len(list(last.glob("*.distcp"))) == 2, sorted(p.name for p in last.parent.iterdir())
    assert torch.load(last / "meta.pt", map_location="cpu", weights_only=False)["global_step"] == STEPS


@pytest.mark.slow  # the `runs` fixture: distributed subprocesses
def test_fsdp2_checkpoint_holds_the_whole_policy_and_no_reference(runs, tmp_path, tiny_model_dir):
    _ok(runs, "a")
    state = _dcp_to_dict(_ckpt(runs["root"] / "a", STEPS), tmp_path)["state_dict"]
    from transformers import AutoModelForCausalLM

    expected = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    policy = {k[len("policy."):]: v for k, v in state.items() if k.startswith("policy.")}
    assert set(expected) <= set(policy), sorted(set(expected) - set(policy))
    for name, value in expected.items():
        assert policy[name].shape == value.shape, name  # whole tensors, gathered from both shards
        assert torch.isfinite(policy[name]).all(), name
    assert any(not torch.equal(policy[n], v) for n, v in expected.items())  # it trained
    assert not [k for k in state if "ref" in k.split(".")[0]], sorted(state)[:10]  # no reference copy


@pytest.mark.slow  # the `runs` fixture: distributed subprocesses
def test_fsdp2_hf_export_writes_the_gathered_policy(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    _ok(runs, "a")
    exported = AutoModelForCausalLM.from_pretrained(runs["root"] / "a" / "lightning_logs" / "version_0" / "hf_model")
    state = _dcp_to_dict(_ckpt(runs["root"] / "a", STEPS), tmp_path)["state_dict"]
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(value, state[f"policy.{name}"], msg=name)


@pytest.mark.slow  # the `runs` fixture: distributed subprocesses
def test_export_of_a_sharded_checkpoint_folder(runs, tmp_path):
    """``rloo-lightning export`` reads the FSDP2 folder (every rank's shard) in one process, no process group."""
    from transformers import AutoModelForCausalLM

    from rloo_lightning.export import export_checkpoint

    _ok(runs, "a")
    folder = _ckpt(runs["root"] / "a", STEPS)
    exported = AutoModelForCausalLM.from_pretrained(export_checkpoint(folder, tmp_path / "hf"))
    state = _dcp_to_dict(folder, tmp_path)["state_dict"]
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(value, state[f"policy.{name}"], msg=name)


@pytest.mark.slow  # the `runs` fixture: distributed subprocesses
def test_fsdp2_resume_from_a_sharded_checkpoint_matches_the_uninterrupted_run(runs, tmp_path):
    """B resumes from A's sharded step-2 checkpoint and runs to step 4: weights and optimizer state equal A's."""
    _ok(runs, "a")
    b = _ok(runs, "b")
    assert "Restored all states from the checkpoint" in b.log, b.explain()
    a_end = _dcp_to_dict(_ckpt(runs["root"] / "a", STEPS), tmp_path / "a")
    b_end = _dcp_to_dict(_ckpt(runs["root"] / "b", STEPS), tmp_path / "b")
    assert torch.load(_ckpt(runs["root"] / "b", STEPS) / "meta.pt", weights_only=False)["global_step"] == STEPS
    b_steps = sorted(int(p.name.split("step=")[1].split(".")[0]) for p in (runs["root"] / "b" / "ckpt").iterdir()
                     if "step=" in p.name)
    assert b_steps == list(range(RESUME_AT + 1, STEPS + 1)), b_steps  # B started after the resume point
    # ref_sync_steps: the moving reference is part of the checkpoint (meta.pt, beside the sharded state)
    a_meta, b_meta = (torch.load(_ckpt(runs["root"] / r, STEPS) / "meta.pt", weights_only=False) for r in "ab")
    a_end["rloo_reference"], b_end["rloo_reference"] = a_meta["rloo_reference"], b_meta["rloo_reference"]
    for what in ("state_dict", "optimizer_0", "rloo_reference"):
        fa, fb = _flat_tensors(a_end[what]), _flat_tensors(b_end[what])
        assert fa.keys() == fb.keys() and fa, what
        differ = [k for k in fa if not torch.equal(fa[k], fb[k])]
        assert not differ, f"{what}: {len(differ)} tensors differ after resume, e.g. {differ[:3]}"
    start = _dcp_to_dict(_ckpt(runs["root"] / "a", RESUME_AT), tmp_path / "start")
    assert any(not torch.equal(start["state_dict"][k], v) for k, v in b_end["state_dict"].items()
               if k.startswith("policy."))  # B trained from the checkpoint on


# ---------------------------------------------------------------------------------------------------------------
# generation: gathered once, no collective inside generate, ranks at different lengths
# ---------------------------------------------------------------------------------------------------------------
def _probe(runs, name: str) -> list[dict]:
    return [json.loads((_helper_out(runs, name) / f"probe_rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow  # the `runs` fixture: distributed subprocesses
@pytest.mark.parametrize("name", ["helper_fsdp2", "helper_fsdp1"])
def test_generation_with_different_lengths_per_rank_issues_no_collective(runs, name):
    r0, r1 = _probe(runs, name)
    assert r0["sharded"] and r1["sharded"], (r0, r1)  # the policy really held sharded parameters
    assert r0["path"] == r1["path"] == ("fsdp2" if name == "helper_fsdp2" else "fsdp")
    assert set(r0["lengths"]) == {1}, r0["lengths"]  # rank 0 stopped after one token
    assert set(r1["lengths"]) == {PROBE_TOKENS}, r1["lengths"]  # rank 1 ran the whole budget
    assert r0["gathered_collectives"] == r1["gathered_collectives"] == 0, (r0, r1)
    assert r0["generate_kwargs"]["synced_gpus"] is False, r0
    # the control, gather=False: the counter does see the per-forward all-gathers of a sharded policy, and
    # synced_gpus=True keeps the ranks paired at different lengths (rank 0 steps on with dummy forwards)
    assert r0["ungathered_generate_kwargs"]["synced_gpus"] is True, r0
    assert r0["ungathered_collectives"] == r1["ungathered_collectives"] > PROBE_TOKENS, (r0, r1)
    assert set(r0["ungathered_lengths"]) == {1} and set(r1["ungathered_lengths"]) == {PROBE_TOKENS}, (r0, r1)
    # afterwards the parameters are sharded again, and the run went on to train
    assert r0["sharded_after"] and r1["sharded_after"], (r0, r1)


# ---------------------------------------------------------------------------------------------------------------
# one update under FSDP2 == the DDP update, on the same injected rollout
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # the `runs` fixture: distributed subprocesses
@pytest.mark.parametrize("run", ["helper_fsdp2", "helper_fsdp2_micro"])
def test_fsdp2_gradients_and_update_equal_ddp_on_a_fixed_rollout(runs, run):
    fsdp2, ddp = _helper_out(runs, run), _helper_out(runs, "helper_ddp")
    kept = [json.loads(line) for line in (ddp / "kept_rank0.jsonl").read_text().splitlines()]
    kept1 = [json.loads(line) for line in (ddp / "kept_rank1.jsonl").read_text().splitlines()]
    assert kept[1]["kept"] != kept1[1]["kept"]  # step 1: the ranks keep unequal numbers of rows
    for step in (0, 1):
        g_ddp = torch.load(ddp / f"full_grads_rank0_step{step}.pt")
        for rank in (0, 1):
            g = torch.load(fsdp2 / f"full_grads_rank{rank}_step{step}.pt")
            assert g.keys() == g_ddp.keys() and g, sorted(set(g) ^ set(g_ddp))
            assert any(v.abs().max() > 1e-3 for v in g_ddp.values())  # a real gradient
            for n in g:
                torch.testing.assert_close(g[n], g_ddp[n], rtol=1e-5, atol=1e-6, msg=f"step {step} {n}")
    w_ddp = torch.load(ddp / "full_weights_rank0.pt")
    for rank in (0, 1):
        w = torch.load(fsdp2 / f"full_weights_rank{rank}.pt")
        assert w.keys() == w_ddp.keys()
        for n in w:
            torch.testing.assert_close(w[n], w_ddp[n], rtol=1e-5, atol=1e-6, msg=f"weights {n}")


# ---------------------------------------------------------------------------------------------------------------
# DDP on CPU (gloo) == one process, on the same fixed rollouts. Moved from the resume tests, whose DDP runs of the
# fixed-rollout script were the same fits as the helper's DDP runs: here they are those, two DDP start-ups fewer.
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ddp_fixed(runs):
    """The fixed-rollout runs' output folders: one process x 2B prompts (``single``), 2 DDP ranks x B prompts
    (``ddp``), and the same with micro-batches (``ddp_micro``)."""
    return {"single": _ok(runs, "single").cwd / "out", "ddp": _helper_out(runs, "helper_ddp"),
            "ddp_micro": _helper_out(runs, "helper_ddp_micro")}


@pytest.mark.slow  # the `runs` fixture: distributed subprocesses
def test_ddp_ranks_get_the_distributed_sampler_shards(ddp_fixed):
    """ResumableSampler = DistributedSampler(shuffle, seed, drop_last): rank r takes perm[r::2].

    So each step, the two ranks' batches together are exactly the single process's batch of 2B.
    """
    from rloo_lightning.tasks.reverse import make_rows

    prompts = [r["prompt"] for r in make_rows(DDP_ROWS, 0)]  # PromptDataModule(task=reverse, seed=0)
    perm = torch.randperm(DDP_ROWS, generator=torch.Generator().manual_seed(0)).tolist()  # seed + epoch 0
    single = _jsonl(ddp_fixed["single"] / "prompts_rank0.jsonl")
    ranks = [_jsonl(ddp_fixed["ddp"] / f"prompts_rank{r}.jsonl") for r in (0, 1)]
    assert [s["step"] for s in single] == list(range(DDP_STEPS))
    for step in range(DDP_STEPS):
        window = perm[2 * DDP_B * step: 2 * DDP_B * (step + 1)]
        assert single[step]["prompts"] == [prompts[i] for i in window]
        for r in (0, 1):
            assert ranks[r][step]["step"] == step
            assert ranks[r][step]["prompts"] == [prompts[i] for i in window[r::2]], (step, r)
        assert sorted(ranks[0][step]["prompts"] + ranks[1][step]["prompts"]) == sorted(single[step]["prompts"])


@pytest.mark.slow  # the `runs` fixture: distributed subprocesses
def test_ddp_ranks_keep_unequal_numbers_of_rows_at_step_1(ddp_fixed):
    """Step 1 drops rows by a hash of (prompt, sample): the ranks keep different counts, so the
    gradient check below also covers the kept-rows normalisation (``update.loss_denominators``)."""
    kept = {r: {e["step"]: e["kept"] for e in _jsonl(ddp_fixed["ddp"] / f"kept_rank{r}.jsonl")} for r in (0, 1)}
    single = {e["step"]: e["kept"] for e in _jsonl(ddp_fixed["single"] / "kept_rank0.jsonl")}
    assert kept[0][0] == kept[1][0] == 4 * DDP_B and single[0] == 8 * DDP_B
    assert kept[0][1] != kept[1][1], kept
    assert kept[0][1] + kept[1][1] == single[1] < 8 * DDP_B


@pytest.mark.slow  # the `runs` fixture: distributed subprocesses
@pytest.mark.parametrize("run", ["ddp", "ddp_micro"])
def test_ddp_gradient_equals_single_process_gradient(ddp_fixed, run):
    """Also with ``micro_batch_size``: each rank's rollout in 4 forward/backward passes, one all-reduce."""
    for step in range(DDP_STEPS):
        single = torch.load(ddp_fixed["single"] / f"grads_rank0_step{step}.pt")
        g0 = torch.load(ddp_fixed[run] / f"grads_rank0_step{step}.pt")
        g1 = torch.load(ddp_fixed[run] / f"grads_rank1_step{step}.pt")
        assert single.keys() == g0.keys() == g1.keys() and len(single) > 0
        _assert_same_tensors(g0, g1, f"rank 0 vs rank 1 all-reduced gradient, step {step}")
        assert any(g.abs().max() > 1e-3 for g in single.values())  # a real gradient, not ~0
        bad = {n: (single[n] - g0[n]).abs().max().item() for n in single
               if not torch.allclose(single[n], g0[n], rtol=1e-5, atol=1e-6)}
        assert not bad, f"step {step}: DDP gradient != single-process gradient: {bad}"
    # and so are the weights after the SGD steps
    w = [torch.load(ddp_fixed[k] / f"weights_rank{r}.pt") for k, r in (("single", 0), (run, 0), (run, 1))]
    _assert_same_tensors(w[1], w[2], "final weights, rank 0 vs rank 1")
    for name in w[0]:
        torch.testing.assert_close(w[1][name], w[0][name], rtol=1e-5, atol=1e-6)


def _csv_metrics(path: Path) -> dict[int, dict[str, float]]:
    rows = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            values = {k: float(v) for k, v in row.items() if k.startswith("train/") and v != ""}
            rows.setdefault(int(row["step"]), {}).update(values)
    return rows


@pytest.mark.slow  # the `runs` fixture: distributed subprocesses
def test_ddp_logged_train_metrics_equal_single_process(ddp_fixed):
    """Every train/* metric is an all-reduced sum over an all-reduced count, train/loss included:
    rank r's loss is S_r / (K / W) (K kept rows in all, W ranks), so the mean over ranks is
    sum_r S_r / K, the single-process loss, even when the ranks keep unequal numbers of rows."""
    single = _csv_metrics(ddp_fixed["single"] / "metrics.csv")
    ddp = _csv_metrics(ddp_fixed["ddp"] / "metrics.csv")
    assert sorted(single) == sorted(ddp) == list(range(DDP_STEPS))
    for step in range(DDP_STEPS):
        assert single[step].keys() == ddp[step].keys()
        for tag in ("train/reward", "train/kl", "train/completion_length", "train/entropy", "train/loss",
                    "train/advantage_abs", "train/reward_std", "train/zero_std_groups", "train/clipped_ratio"):
            assert tag in single[step], sorted(single[step])
        for tag, value in single[step].items():
            assert math.isclose(ddp[step][tag], value, rel_tol=1e-5, abs_tol=1e-6), (step, tag, ddp[step][tag], value)
