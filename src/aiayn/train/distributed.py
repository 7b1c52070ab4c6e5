"""torch.distributed for several GPUs or machines: DistributedDataParallel under ``torchrun``.

``torchrun --nproc_per_node N -m aiayn train ...`` sets RANK, WORLD_SIZE and LOCAL_RANK; the
trainer then uses NCCL on GPUs and gloo on CPUs. Each rank reads its own share of the batches
(batch i of a step goes to rank i % WORLD_SIZE).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Dist", "setup_distributed", "all_reduce_sum", "barrier", "teardown_distributed"]


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: str | None = None) -> Dist:
    """Join the process group if launched by torchrun; choose the device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank, world, local_rank, dev)


def all_reduce_sum(value: torch.Tensor, d: Dist) -> torch.Tensor:
    """The sum of ``value`` over the processes, on ``value``'s device. The reduction itself runs
    on the process's device: NCCL reduces CUDA tensors only."""
    if d.world > 1:
        on_device = value.to(d.device)
        dist.all_reduce(on_device, op=dist.ReduceOp.SUM)
        return on_device.to(value.device)
    return value


def barrier(d: Dist) -> None:
    """Wait until every process gets here (nothing to do in one process)."""
    if d.world > 1:
        dist.barrier()


def teardown_distributed(d: Dist) -> None:
    """Wait for every process (rank 0 saves and evaluates last), then leave the process group."""
    if d.world > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
