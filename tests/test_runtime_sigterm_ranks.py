"""SIGTERM inside a training step with several ranks (DDP, FSDP2 on 2 CPU processes): no rank stops alone, every
rank ends, ``last.ckpt`` holds the step before, and a resume from it ends where the uninterrupted run does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_helpers import _assert_same_checkpoint, _dcp_to_dict
from cli_harness import make_env, start_cli, wait_all
from run_helpers import _flat_tensors
from test_runtime_sigterm import ENGINE_AT, _args

pytestmark = pytest.mark.slow  # distributed CLI subprocesses

TIMEOUT = 240  # a healthy run takes 20-60 s here; a rank left waiting in a collective is killed and fails the test
COMMON = ["--trainer.limit_val_batches", "0", "--model.validation.at_start", "false", "--data.num_val_rows", "8",
          "--model.rewards.funcs", "[rloo_lightning.tasks.reverse.reward]", "--trainer.max_steps", "4"]
STRATEGIES = {
    "ddp": ["--trainer.strategy", "ddp", "--trainer.devices", "2"],
    "fsdp2": ["--trainer.strategy", "lightning.pytorch.strategies.ModelParallelStrategy",
              "--trainer.strategy.data_parallel_size", "2", "--trainer.strategy.tensor_parallel_size", "1",
              "--trainer.devices", "2"],
}


def _last(root: Path, version: int) -> Path:
    return root / "lightning_logs" / f"version_{version}" / "checkpoints" / "last.ckpt"


def _weights_and_optimizer(path: Path, tmp: Path) -> dict:
    """A checkpoint file, or a sharded (FSDP2) checkpoint folder read without a process group."""
    return _dcp_to_dict(path, tmp) if path.is_dir() else torch.load(path, map_location="cpu", weights_only=False)


# DDP: the signal reaches rank 1 alone (nobody forwards it to rank 0, which learns of it from the process group's
# store while it generates). FSDP2: rank 0 gets it and passes it to rank 1, as a scheduler signalling the launcher.
@pytest.mark.parametrize("strategy,rank", [("ddp", 1), ("fsdp2", 0)], ids=["ddp-rank-1-only", "fsdp2-rank-0"])
def test_sigterm_inside_step_3s_generation_on_one_rank_ends_every_rank_keeping_step_2(tmp_path, tiny_model_dir,
                                                                                    _cache_dir, strategy, rank):
    env = make_env(_cache_dir, STOP_LOG=str(tmp_path / "events"))
    extra = [*COMMON, *STRATEGIES[strategy]]
    a, c = tmp_path / "a", tmp_path / "c"
    procs = [start_cli("a", _args(a, tiny_model_dir, *extra), a, env, timeout=TIMEOUT),
             start_cli("c", _args(c, tiny_model_dir, *extra, *ENGINE_AT, "2", "--model.generation_engine.rank",
                                  str(rank)), c, env, timeout=TIMEOUT)]
    wait_all(*procs)
    procs[0].check()
    stopped = procs[1]
    assert stopped.rc == 143 and not stopped.timed_out, stopped.explain()  # every rank ended: none left waiting
    assert "Traceback" not in stopped.stderr, stopped.explain()
    assert (tmp_path / "events").read_text().splitlines() == ["signal at generate call 2"]
    last = _last(c, 0)
    meta = torch.load(last / "meta.pt" if last.is_dir() else last, map_location="cpu", weights_only=False)
    assert meta["global_step"] == 2
    assert f"stopped by SIGTERM after step 2; {last}" in stopped.log
    wait_all(start_cli("c2", _args(c, tiny_model_dir, *extra, "--ckpt_path", last), c, env, timeout=TIMEOUT))
    end, ref = _last(c, 1), _last(a, 0)
    if not end.is_dir():
        _assert_same_checkpoint(end, ref)  # the same weights, optimizer state and schedules
        return
    got, want = _weights_and_optimizer(end, tmp_path / "got"), _weights_and_optimizer(ref, tmp_path / "want")
    for what in ("state_dict", "optimizer_0"):
        flat_g, flat_w = _flat_tensors(got[what]), _flat_tensors(want[what])
        assert flat_g.keys() == flat_w.keys() and flat_g, what
        assert not [k for k in flat_w if not torch.equal(flat_g[k], flat_w[k])], what



# -- a failure on one rank: every rank ends together, keeping the step before -----------------------------------
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_reward_error_on_rank_1_in_step_3_ends_every_rank_with_one_line_keeping_step_2(tmp_path, tiny_model_dir,
                                                                                         _cache_dir, strategy):
    """Rank 1's reward raises (``rewards.on_error: raise``) in step 3; rank 0 is not left waiting in a collective:
    both end with exit 1 at the step's agreement point, the line names rank 1 and its error and the last.ckpt of
    step 2, written by every rank together (the rewound checkpoint of a stop inside a step: its resume is checked
    bit-identical by the SIGTERM test above and, for a failure, with one process in test_callbacks_final_checkpoint)."""
    env = make_env(_cache_dir, STOP_LOG=str(tmp_path / "events"), FAIL_AT_CALL="2", FAIL_RANK="1")
    extra = [*COMMON, *STRATEGIES[strategy], "--model.rewards.funcs", "[stop_helpers.reward_that_fails]",
             "--model.rewards.on_error", "raise"]
    failed = start_cli("c", _args(tmp_path, tiny_model_dir, *extra), tmp_path, env, timeout=TIMEOUT)
    wait_all(failed)
    assert failed.rc == 1 and not failed.timed_out, failed.explain()  # every rank ended: none left waiting
    last = _last(tmp_path, 0)
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
    assert errors and all("rank 1: " in e and "reward failed on call 2" in e for e in errors), failed.explain()
    assert any(e.endswith(f"{last} holds step 2: resume with --ckpt_path {last}") for e in errors), failed.explain()
    assert "Connection closed by peer" not in failed.stderr and "Traceback" not in failed.stderr, failed.explain()
    meta = torch.load(last / "meta.pt" if last.is_dir() else last, map_location="cpu", weights_only=False)
    assert meta["global_step"] == 2
    if last.is_dir():  # FSDP2: both ranks wrote their shards of it
        assert len(list(last.glob("*.distcp"))) == 2, sorted(p.name for p in last.iterdir())


# -- two nodes (one process each, as two machines sharing a file system): a stop during one node's set-up ---------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_sigterm_to_node_1_during_set_up_ends_both_nodes_with_one_line_and_exit_143(tmp_path, tiny_model_dir,
                                                                                      _cache_dir):
    port = str(_free_port())

    def node(rank: int) -> dict:
        return make_env(_cache_dir, STOP_LOG=str(tmp_path / f"events-{rank}"), NODE_RANK=str(rank),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port)

    extra = [*COMMON, "--trainer.strategy", "ddp", "--trainer.num_nodes", "2", "--trainer.devices", "1"]
    stop = ["--trainer.callbacks+=stop_helpers.SignalAt", "--trainer.callbacks.at=setup"]
    procs = [start_cli("node0", _args(tmp_path, tiny_model_dir, *extra), tmp_path, node(0), timeout=TIMEOUT),
             start_cli("node1", _args(tmp_path, tiny_model_dir, *extra, *stop), tmp_path, node(1), timeout=TIMEOUT)]
    wait_all(*procs)
    for proc in procs:
        assert proc.rc == 143 and not proc.timed_out, proc.explain()
        lines = [line for line in proc.stderr.splitlines() if "stopped by SIGTERM" in line or "error" in line]
        assert len(lines) == 1 and "before the first training step" in lines[0], proc.explain()
        assert "Traceback" not in proc.stderr and "GLHF" not in proc.stderr, proc.explain()
    assert not list(tmp_path.rglob("*.ckpt"))
