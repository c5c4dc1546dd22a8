"""SIGTERM at any point of a run: before the first step it ends at once with one line (nothing to save); during a
validation it ends at the next generated token, keeping the step just finished. Through the real CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_harness import CONFIGS, make_env, run_cli
from checkpoint_helpers import _assert_same_checkpoint

pytestmark = pytest.mark.slow  # CLI subprocesses

REWARD = ["--model.rewards.funcs", "[stop_helpers.reward_that_signals]"]  # later options override it


def _args(root: Path, model_dir: str, *extra: str) -> list[str]:
    return ["fit", "--config", CONFIGS / "quickstart.yaml", "--model.model_name_or_path", model_dir,
            "--trainer.default_root_dir", root, "--trainer.enable_progress_bar", "false",
            "--data.num_train_rows", "16", "--data.batch_size", "4", *REWARD, *extra]


# 4 steps after a validation of 50 batches of 4 prompts before training
VALIDATE_FIRST = ["--trainer.max_steps", "4", "--data.num_val_rows", "200", "--data.val_batch_size", "4",
                  "--trainer.limit_val_batches", "50", "--model.validation.at_start", "true"]


def _events(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_sigterm_at_validation_batch_1_of_50_before_training_ends_the_run_at_once(tmp_path, tiny_model_dir,
                                                                                 _cache_dir):
    log = tmp_path / "events"
    env = make_env(_cache_dir, STOP_LOG=str(log), STOP_AT_CALL="1")
    proc = run_cli("fit", _args(tmp_path, tiny_model_dir, *VALIDATE_FIRST), tmp_path, env, check=False)
    assert proc.rc == 143, proc.explain()
    assert _events(log) == ["reward", "reward"]  # validation batches 0 and 1 scored; batch 2 never ran
    assert "stopped by SIGTERM before the first training step of this run: nothing to save" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.rglob("*.ckpt"))


def test_sigterm_while_the_run_sets_up_ends_it_with_one_line(tmp_path, tiny_model_dir, _cache_dir):
    log = tmp_path / "events"
    env = make_env(_cache_dir, STOP_LOG=str(log))
    proc = run_cli("fit", _args(tmp_path, tiny_model_dir, "--trainer.max_steps", "4", "--trainer.callbacks+="
                                "stop_helpers.SignalAt", "--trainer.callbacks.at=setup"), tmp_path, env, check=False)
    assert proc.rc == 143, proc.explain()
    assert _events(log) == ["setup"]
    assert proc.stderr.count("stopped by SIGTERM before the first training step") == 1
    assert "Traceback" not in proc.stderr


def test_sigterm_during_a_validation_after_step_2_keeps_step_2_and_runs_no_later_batch(tmp_path, tiny_model_dir,
                                                                                      _cache_dir):
    log = tmp_path / "events"
    env = make_env(_cache_dir, STOP_LOG=str(log))
    proc = run_cli("fit", _args(tmp_path, tiny_model_dir, "--trainer.max_steps", "6", "--trainer.val_check_interval",
                                "2", "--data.num_val_rows", "200", "--data.val_batch_size", "4",
                                "--trainer.limit_val_batches", "50", "--model.validation.at_start", "false",
                                "--model.rewards.funcs", "[rloo_lightning.tasks.reverse.reward]",
                                "--trainer.callbacks+=stop_helpers.SignalAt", "--trainer.callbacks.step=2",
                                "--trainer.callbacks.val_batch=1",
                                "--trainer.callbacks+=rloo_lightning.callbacks.checkpoint.FinalCheckpoint"),
                   tmp_path, env, check=False)
    assert proc.rc == 143, proc.explain()
    events = _events(log)
    assert events[-1] == "val_start 2 1" and "val_end 2 0" in events and "step 3" not in events
    (last,) = tmp_path.rglob("last.ckpt")
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 2
    assert f"stopped by SIGTERM after step 2; {last}" in proc.log


def test_under_ddp_a_sigterm_to_rank_0_during_validation_before_training_ends_every_rank(tmp_path, tiny_model_dir,
                                                                                      _cache_dir):
    log = tmp_path / "events"
    env = make_env(_cache_dir, STOP_LOG=str(log), STOP_AT_CALL="1")
    proc = run_cli("fit", _args(tmp_path, tiny_model_dir, *VALIDATE_FIRST, "--trainer.strategy", "ddp",
                                "--trainer.devices", "2"), tmp_path, env, check=False, timeout=240)
    assert proc.rc == 143 and not proc.timed_out, proc.explain()  # every rank ended: none waited in a collective
    assert _events(log) == ["reward", "reward"]


def _flat(d, prefix=""):
    """Every leaf of a checkpoint as ``{path: value}`` (tensors compared with torch.equal)."""
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}/{k}"))
    elif isinstance(d, (list, tuple)):
        for i, v in enumerate(d):
            out.update(_flat(v, f"{prefix}/{i}"))
    else:
        out[prefix] = d
    return out


ENGINE_HPARAM = "/hyper_parameters/generation_engine"  # the engine that sends the signal is the test's, not state


def _assert_same(got: Path, ref: Path) -> None:
    a, b = ({k: v for k, v in _flat(torch.load(p, map_location="cpu", weights_only=False)).items()
             if not k.startswith(ENGINE_HPARAM)} for p in (got, ref))
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for key in b:
        if isinstance(b[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        elif "callbacks" in key and ("dirpath" in key or "best_model_path" in key or "last_model_path" in key):
            continue  # the run's own folder
        else:
            assert a[key] == b[key], (key, a[key], b[key])


ENGINE_AT = ["--model.generation_engine", "stop_helpers.SignallingEngine", "--model.generation_engine.at_call"]


# (extra options, the step b stops at, c's generate call inside the next step, d's batch between that step's two
# micro-batches). Accumulation: 24 prompts (6 batches, 3 steps an epoch): b stops at the end of epoch 0, c inside
# step 4's second micro-batch's generation (generate call 7: one per micro-batch), d after step 4's first micro-batch
# (batch 6, the first of epoch 1). updates_per_rollout 2: steps 1 and 3 sample, 2 and 4 reuse (call 1 is step 3's).
CASES = {"plain": ([], 2, 2, None),
         "accumulate-2": (["--trainer.accumulate_grad_batches", "2", "--data.num_train_rows", "24"], 3, 7, 6),
         "updates-per-rollout-2": (["--model.update.updates_per_rollout", "2"], 2, 1, None)}


@pytest.mark.parametrize("case", list(CASES))
def test_sigterm_inside_a_steps_generation_keeps_the_step_before_as_a_stop_there_would_and_resumes_exactly(
        tmp_path, tiny_model_dir, _cache_dir, case):
    """Run b stops at step s's end (Lightning's stop); run c gets the signal inside step s+1's generation, run d
    between its micro-batches; their last.ckpt are the same, and c resumed to step 6 ends where an uninterrupted
    run a does."""
    from cli_harness import start_cli, wait_all  # noqa: I001

    env = make_env(_cache_dir, STOP_LOG=str(tmp_path / "events"))
    extra, step, call, batch = CASES[case]
    common = ["--trainer.limit_val_batches", "0", "--model.validation.at_start", "false", "--data.num_val_rows", "8",
              "--model.rewards.funcs", "[rloo_lightning.tasks.reverse.reward]", "--trainer.max_steps", "6", *extra]
    a, b, c, d = tmp_path / "a", tmp_path / "b", tmp_path / "c", tmp_path / "d"
    sigterm_at = ["--trainer.callbacks+=reliability_helpers.callbacks.SigtermAt"]
    procs = [start_cli("a", _args(a, tiny_model_dir, *common), a, env),
             start_cli("b", _args(b, tiny_model_dir, *common, *sigterm_at, f"--trainer.callbacks.step={step}"), b, env),
             start_cli("c", _args(c, tiny_model_dir, *common, *ENGINE_AT, str(call)), c, env)]
    if batch is not None:
        between = f"--trainer.callbacks.batch={batch}"
        procs.append(start_cli("d", _args(d, tiny_model_dir, *common, *sigterm_at, between), d, env))
    wait_all(*procs)
    procs[0].check()
    assert all(p.rc == 143 for p in procs[1:]), "".join(p.explain() for p in procs[1:])
    last_b, last_c, last_d = (p / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt" for p in (b, c, d))
    assert torch.load(last_c, map_location="cpu", weights_only=False)["global_step"] == step
    _assert_same(last_c, last_b)
    if batch is not None:
        _assert_same(last_d, last_b)
    # c's last.ckpt is b's, bit for bit: resumed, it ends where the uninterrupted run does (the same weights,
    # optimizer state and schedules); b's resume, the same file, would only repeat it
    # the checkpoint stores c's engine, which a resume rebuilds: told never to signal
    wait_all(start_cli("c2", _args(c, tiny_model_dir, *common, *ENGINE_AT, "-1", "--ckpt_path", last_c), c, env))
    end_c = c / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt"
    _assert_same_checkpoint(end_c, a / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt")
