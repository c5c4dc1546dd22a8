"""Fixed-lag rollouts (``rollout.lag``) through the CLI: a SIGTERM inside a step whose submission is
sampling the rollout K steps ahead keeps the step before, as a stop at that step's end does, and the resumed run ends
where the uninterrupted one does; two ranks under DDP resume bit-identically and FSDP2 trains with a lag; multi-turn
episodes are sampled ahead too. Every run is a subprocess, started together where independent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoint_helpers import _assert_same_checkpoint
from cli_harness import CONFIGS, make_env, start_cli, wait_all
from rloo_lightning.runtime.tensorboard_logs import read_scalars
from run_helpers import _assert_same_tensors, _load

pytestmark = pytest.mark.slow  # CLI subprocesses

LAG = ["--model.rollout.lag", "1"]


def _args(root: Path, model_dir: str, steps: int, *extra: str, config: str = "quickstart.yaml") -> list[str]:
    return ["fit", "--config", str(CONFIGS / config), "--model.model_name_or_path", model_dir,
            "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false",
            "--data.num_train_rows", "16", "--data.batch_size", "4", "--data.num_val_rows", "8",
            "--trainer.limit_val_batches", "0", "--model.validation.at_start", "false",
            "--trainer.max_steps", str(steps), *LAG, *extra]


def _last(root: Path, version: int = 0) -> Path:
    return root / "lightning_logs" / f"version_{version}" / "checkpoints" / "last.ckpt"


@pytest.mark.parametrize("lag,held", [(1, False), (2, True)])
def test_sigterm_while_a_step_samples_ahead_keeps_the_step_before_and_resumes_exactly(tmp_path, tiny_model_dir,
                                                                                     _cache_dir, lag, held):
    """K = 1 with the default engine: step g's submission samples step g+1's rollout inside step g. Run b stops at
    step 3's end; run c is signalled inside step 4's submission (generate call 4: calls 0 and 1 are steps 0 and 1's,
    made at step 0); their last.ckpt are the same (the rollouts ahead included), and c resumed to 6 ends where the
    uninterrupted run a does. K = 2 with an engine that keeps versions (``held``): step 3's end left steps 4 and 5's
    rollouts in flight, and the stop inside step 4 (call 5) collects them into the checkpoint of step 3's end."""
    env = make_env(_cache_dir, STOP_LOG=str(tmp_path / "events"))
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    engine = ["--model.generation_engine", "stop_helpers.SignallingEngine", "--model.rollout.lag", str(lag),
              "--model.generation_engine.return_logprobs", "true", "--model.generation_engine.held", str(held).lower(),
              "--model.generation_engine.at_call"]
    procs = [start_cli("a", _args(a, tiny_model_dir, 6, *engine, "-1"), a, env),
             start_cli("b", _args(b, tiny_model_dir, 6, "--trainer.callbacks+=reliability_helpers.callbacks.SigtermAt",
                                  "--trainer.callbacks.step=3", *engine, "-1"), b, env),
             start_cli("c", _args(c, tiny_model_dir, 6, *engine, str(3 + lag)), c, env)]
    wait_all(*procs)
    procs[0].check()
    assert all(p.rc == 143 for p in procs[1:]), "".join(p.explain() for p in procs[1:])
    state_c = _load(_last(c))
    assert state_c["global_step"] == 3
    # the rollouts of steps 3 .. 3 + K - 1, sampled at steps 3 - K .. 2, whole
    assert [e["position"] for e in state_c["rloo_pipeline"]["ranks"][0]["ahead"]] == list(range(3, 3 + lag))
    state_b = _load(_last(b))
    _assert_same_tensors(state_c["state_dict"], state_b["state_dict"], "weights")
    for ahead_b, ahead_c in zip(*(state["rloo_pipeline"]["ranks"][0]["ahead"] for state in (state_b, state_c)),
                                strict=True):
        assert torch.equal(ahead_b["fields"]["completion_ids"], ahead_c["fields"]["completion_ids"])
    assert state_b["loops"] == state_c["loops"]
    wait_all(start_cli("c2", _args(c, tiny_model_dir, 6, *engine, "-1", "--ckpt_path", str(_last(c))), c, env))
    _assert_same_checkpoint(_last(c, 1), _last(a))


def test_two_ddp_ranks_with_a_lag_resume_bit_identically(tmp_path, tiny_model_dir, _cache_dir):
    """Resumed at step 3: each rank's own rollouts ahead and, with updates_per_rollout 2, its own rollout between two
    updates come back from the checkpoint (either taken from rank 0 alone fails this test)."""
    env = make_env(_cache_dir)
    ddp = ["--trainer.devices", "2", "--trainer.strategy", "ddp",
           "--model.update.updates_per_rollout", "2", "--model.update.clip_mode", "token"]
    a, b = tmp_path / "a", tmp_path / "b"
    procs = [start_cli("a", _args(a, tiny_model_dir, 4, *ddp), a, env),
             start_cli("b", _args(b, tiny_model_dir, 3, *ddp), b, env)]
    wait_all(*procs)
    for p in procs:
        p.check()
    b2 = start_cli("b2", _args(b, tiny_model_dir, 4, *ddp, "--ckpt_path", str(_last(b))), b, env)
    wait_all(b2)
    b2.check()
    _assert_same_checkpoint(_last(b, 1), _last(a))
    staleness = read_scalars(a / "lightning_logs" / "version_0")["train/staleness"]
    assert [staleness[g] for g in range(4)] == [0, 1, 1, 2]


def test_fsdp2_and_multiturn_episodes_train_with_a_lag(tmp_path, tiny_model_dir, _cache_dir):
    env = make_env(_cache_dir)
    f, m = tmp_path / "fsdp2", tmp_path / "multiturn"
    multiturn = ["--model.rewards.funcs", "[]", "--model.environment.class_path", "multiturn_helpers.Noisy",
                 "--model.sampling.max_new_tokens", "4", "--model.environment.max_context_tokens", "64",
                 "--model.environment.max_turns", "3"]
    procs = [start_cli("fsdp2", _args(f, tiny_model_dir, 3, config="fsdp2_cpu.yaml"), f, env),
             start_cli("multiturn", _args(m, tiny_model_dir, 3, *multiturn), m, env)]
    wait_all(*procs)
    for p in procs:
        p.check()
    for root in (f, m):
        scalars = read_scalars(root / "lightning_logs" / "version_0")
        assert [scalars["train/staleness"][g] for g in range(3)] == [0, 1, 1], root
        assert scalars["train/mismatch/kl_k3"][0] < 1e-5 < scalars["train/mismatch/kl_k3"][2]  # stale from step 1
    assert "train/turns" in read_scalars(m / "lightning_logs" / "version_0")
