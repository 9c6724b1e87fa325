"""Collectives: every all-reduce of the training job goes through `all_reduce`, on the training device.

Ray Train picks the process group's backend: gloo on CPU, nccl with `--use-gpu`. nccl has no CPU path, so a
CPU tensor handed to a collective fails on GPU workers; `all_reduce` therefore takes the training device
explicitly and moves its tensor there first (a no-op on CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(t: torch.Tensor, device: torch.device, op: str = "sum") -> torch.Tensor:
    """`t` summed (op="sum") or maxed (op="max") over all ranks, returned on `device`; as-is (moved) alone."""
    t = t.to(device)
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


def world_info() -> tuple[int, int]:
    """(rank, world size) of this Ray Train worker."""
    import ray.train

    ctx = ray.train.get_context()
    return ctx.get_world_rank(), ctx.get_world_size()
