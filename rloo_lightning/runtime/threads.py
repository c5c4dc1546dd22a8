"""How many threads torch uses for CPU work in each process: never more than the CPUs this process may run on,
shared among the processes of this node.

torch's default is the machine's core count in every process, whatever the process's CPU affinity (a container's
or a scheduler's limit) and however many ranks share the node. Two ranks on a 2-core CPU then run 4 threads on
2 cores; threads that wait for a busy core make every parallel operator wait for its slowest thread (measured in
``docs/threads.md``). The rule, in order:

1. ``OMP_NUM_THREADS`` set: it is honoured (torch reads it itself);
2. ``SLURM_CPUS_PER_TASK`` set: that many (Slurm gives each task its own CPUs), at most the affinity's;
3. otherwise the CPUs in this process's affinity divided by the processes of this node (at least 1).
"""

from __future__ import annotations

import os

import torch

__all__ = ["choose_threads", "use_threads"]


def choose_threads(processes_on_node: int, env: dict | None = None, affinity: int | None = None) -> tuple[int, str]:
    """``(threads, why)`` by the module docstring's rule. ``affinity``: the CPUs this process may run on."""
    env = os.environ if env is None else env
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if env.get("OMP_NUM_THREADS", "").strip():
        return torch.get_num_threads(), f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}"
    slurm = env.get("SLURM_CPUS_PER_TASK", "").strip()
    if slurm.isdigit() and int(slurm) > 0:
        return min(int(slurm), affinity), f"SLURM_CPUS_PER_TASK={slurm}"
    processes = max(1, processes_on_node)
    share = f" shared by {processes} processes on this node" if processes > 1 else ""
    return max(1, affinity // processes), f"{affinity} CPUs in this process's affinity{share}"


def use_threads(processes_on_node: int) -> str:
    """Set torch's intra-op threads by :func:`choose_threads`; the line that says what was chosen and why."""
    threads, why = choose_threads(processes_on_node)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return f"torch uses {threads} CPU thread{'s' if threads != 1 else ''} per process ({why}; set OMP_NUM_THREADS " \
           "to choose)"
