"""torch's CPU threads per process: OMP_NUM_THREADS honoured, else Slurm's CPUs per task, else the process's CPU
affinity shared by the processes of its node."""

from __future__ import annotations

import torch

from rloo_lightning.runtime.threads import choose_threads, use_threads


def test_the_affinity_is_shared_by_the_processes_of_the_node():
    assert choose_threads(1, env={}, affinity=8) == (8, "8 CPUs in this process's affinity")
    assert choose_threads(2, env={}, affinity=8) == (4, "8 CPUs in this process's affinity shared by 2 processes on "
                                                        "this node")
    assert choose_threads(4, env={}, affinity=2)[0] == 1  # never 0


def test_omp_num_threads_is_honoured_and_slurm_cpus_per_task_comes_next():
    threads, why = choose_threads(2, env={"OMP_NUM_THREADS": "3"}, affinity=8)
    assert threads == torch.get_num_threads() and why == "OMP_NUM_THREADS=3"  # torch read it itself
    assert choose_threads(2, env={"SLURM_CPUS_PER_TASK": "6"}, affinity=8) == (6, "SLURM_CPUS_PER_TASK=6")
    assert choose_threads(1, env={"SLURM_CPUS_PER_TASK": "16"}, affinity=8)[0] == 8  # at most the affinity's


def test_use_threads_sets_torch_and_says_what_and_why(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    try:
        line = use_threads(4)
        assert torch.get_num_threads() == 1
        assert line == ("torch uses 1 CPU thread per process (4 CPUs in this process's affinity shared by 4 "
                        "processes on this node; set OMP_NUM_THREADS to choose)")
    finally:
        torch.set_num_threads(before)
