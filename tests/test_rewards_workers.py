"""Rewards in worker processes (``RewardSet(num_workers=...)``): the serial result, per-call timeouts, errors and
deaths of workers, start methods, pickling.
"""

from __future__ import annotations

import os
import pickle
import time
import warnings

import pytest
import torch

# The workers rebuild test reward functions from "reward_helpers.<name>": they inherit sys.path, which holds
# tests/helpers/ (pyproject's pythonpath) before the first worker starts.
from reward_helpers import assert_close, batch
from rloo_lightning.rewards import RewardError, RewardSet, RewardTimeoutError, RewardWarning

NAN = float("nan")


# -- workers and timeouts ----------------------------------------------------------------------
SPECS = [
    "reward_helpers.length_reward",
    {"class_path": "reward_helpers.Scaled", "init_args": {"factor": -0.5}},
    {"class_path": "rloo_lightning.rewards.builtin.ExactAnswer", "init_args": {"extract": "last_number"}},
    "reward_helpers.answer_match",
]


@pytest.mark.slow  # a pool of worker processes
def test_workers_give_the_serial_result():
    args = batch([f"{i} " * (i % 4) for i in range(10)], answer=[str(i) for i in range(10)])
    serial = RewardSet.from_specs(SPECS, [1.0, 2.0, 3.0, 4.0]).score(*args)
    with RewardSet.from_specs(SPECS + ["reward_helpers.pid"], [1.0, 2.0, 3.0, 4.0, 0.0], num_workers=2) as rs:
        total, per = rs.score(*args)
        pids = set(per.pop("pid").tolist())
        torch.testing.assert_close(total, serial[0])
        for name in serial[1]:
            torch.testing.assert_close(per[name], serial[1][name])
        assert os.getpid() not in pids and pids <= set(rs._pool.pids)
        # The pool lives across calls.
        before = list(rs._pool.pids)
        _, per2 = rs.score(*args)
        assert set(per2["pid"].tolist()) <= set(before) and rs._pool.pids == before
        procs = [w.proc for w in rs._pool._workers]
    assert rs._pool is None and not any(p.is_alive() for p in procs)


@pytest.mark.slow  # worker processes and a 1 s timeout to wait out (5-7 s)
def test_timeout_scores_and_warns_without_waiting():
    rs = RewardSet.from_specs(["reward_helpers.sleepy", "reward_helpers.length_reward"], timeout=1.0,
                              num_workers=2, chunk_size=1, on_error="none")
    try:
        rs.score(*batch(["warm"]))  # starts the workers: start-up is not counted against the timeout
        start = time.monotonic()
        with pytest.warns(RewardWarning, match=r"'sleepy' timed out after 1 s on prompt 'q1'.*None \(missing\)"):
            total, per = rs.score(*batch(["ab", "sleep", "abc"], prompts=["q0", "q1", "q2"]))
        elapsed = time.monotonic() - start
        assert elapsed < 10, elapsed  # about the timeout, not the 60 s sleep
        assert_close(per["sleepy"], [2.0, NAN, 3.0])
        assert_close(per["length_reward"], [2.0, 5.0, 3.0])
        assert_close(total, [4.0, NAN, 6.0])
        # The stuck worker was replaced: the next call is served.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _, per = rs.score(*batch(["abcd"]))
        assert_close(per["sleepy"], [4.0])
    finally:
        rs.close()


def test_timeout_in_process_mode_value_and_raise():
    # num_workers=0 with a timeout still runs the functions in one killable worker.
    rs = RewardSet.from_specs(["reward_helpers.sleepy"], timeout=0.5, on_error=-1.0)
    try:
        with pytest.warns(RewardWarning, match="scored as -1.0"):
            total, _ = rs.score(*batch(["sleep", "ab"]))
        assert_close(total, [-1.0, -1.0])  # one chunk for one worker: the whole chunk timed out
    finally:
        rs.close()
    with RewardSet.from_specs(["reward_helpers.sleepy"], timeout=0.5) as rs:
        with pytest.raises(RewardTimeoutError, match=r"'sleepy' timed out after 0.5 s on prompt 'p0'"):
            rs.score(*batch(["sleep"]))


def test_worker_errors_and_deaths():
    with RewardSet.from_specs(["reward_helpers.raises"], num_workers=1) as rs:
        with pytest.raises(RewardError, match=r"(?s)'raises' raised on prompt 'first'.*worker traceback") as info:
            rs.score(*batch(["boom"], prompts=["first"]))
        assert isinstance(info.value.__cause__, KeyError)
    with RewardSet.from_specs(["reward_helpers.crash"], num_workers=1, chunk_size=1, on_error=0.0) as rs:
        with pytest.warns(RewardWarning, match=r"'crash': its worker process died \(exit code 3\) on prompt 'p1'"):
            total, _ = rs.score(*batch(["ok", "crash", "ok"]))
        assert_close(total, [1.0, 0.0, 1.0])


def test_function_that_cannot_be_built_in_a_worker():
    rs = RewardSet.from_specs(["reward_helpers.FailsInWorker"], num_workers=1)
    with pytest.raises(RewardError, match=r"(?s)could not build the reward functions \['FailsInWorker'\].*no verifier"):
        rs.score(*batch(["a"]))
    assert rs._pool.closed
    rs.close()


@pytest.mark.slow  # spawned worker processes (~30 s)
def test_spawn_start_method():
    with RewardSet.from_specs(["reward_helpers.length_reward"], num_workers=1, start_method="spawn") as rs:
        assert rs.score(*batch(["abc"]))[0].tolist() == [3.0]
    with pytest.raises(ValueError, match="fork"):
        RewardSet.from_specs(["reward_helpers.length_reward"], num_workers=1, start_method="fork")


def test_unpicklable_function_with_workers_is_a_clear_error():
    with pytest.raises(ValueError, match=r"cannot be sent to a worker process.*import path"):
        RewardSet.from_specs([lambda prompts, completions, completion_ids, **c: [0.0] * len(completions)],
                             num_workers=1)


def test_reward_set_pickles_without_its_pool():
    rs = RewardSet.from_specs(["reward_helpers.length_reward"])
    clone = pickle.loads(pickle.dumps(rs))
    assert clone._pool is None and clone.names == rs.names
