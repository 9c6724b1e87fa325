"""Connecting to Ray: the cluster a job was submitted to, an explicit address, or an embedded local one."""

from __future__ import annotations

import os


def local_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and `taskset` narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def connect(address: str | None = None, num_cpus: int | None = None):
    """`ray.init` that works under `ray job submit` (RAY_ADDRESS set), with an address, or standalone.

    Standalone on a small machine we declare more logical CPUs than cores: Ray Data's read tasks must
    never be starved by actors that hold every CPU (DESIGN.md pitfalls).
    """
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return ray
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        cpus = num_cpus or max(4, 2 * local_cores())
        ray.init(address="local", num_cpus=cpus, include_dashboard=False)
    return ray


def alive_nodes() -> int:
    """Nodes of the connected Ray cluster (1 when Ray is not initialised: everything runs here)."""
    import ray

    return sum(1 for node in ray.nodes() if node["Alive"]) if ray.is_initialized() else 1


def use_assigned_cpus() -> int:
    """Give torch as many threads as whole CPUs Ray assigned to the calling task or actor; returns the count.

    Ray sets OMP_NUM_THREADS per task, but torch reads it once per process: a pooled worker that imported torch
    for an earlier, smaller task keeps that thread count, and a 2-CPU evaluation task could run on one thread.
    (This also overrides an OMP_NUM_THREADS the user set for Ray's workers: the task's CPUs are what it holds.) Outside a Ray task or actor (or with no CPU assigned) torch is left as it is.
    """
    import ray
    import torch

    context = ray.get_runtime_context() if ray.is_initialized() else None
    if context is not None and context.worker.mode == ray.WORKER_MODE:  # a task or actor, not a driver
        cpus = context.get_assigned_resources().get("CPU", 0)
        if cpus >= 1:
            torch.set_num_threads(int(cpus))
    return torch.get_num_threads()
