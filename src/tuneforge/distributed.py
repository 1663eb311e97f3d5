"""Which process am I: rank, world size and device, from torchrun's or SLURM's environment."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tuneforge.errors import UserError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: data-parallel group `data_rank` of `data_size`, sequence shard `shard` of `size`."""

    size: int = 1
    shard: int = 0
    data_rank: int = 0
    data_size: int = 1

    @classmethod
    def of(cls, rank: int, world_size: int, size: int) -> Layout:
        """Groups are consecutive ranks: (0..N-1), (N..2N-1), ...: on one node they talk over the fastest links."""
        return cls(size, rank % size, rank // size, world_size // size)


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _env_from_slurm() -> None:
    """`srun tuneforge train ...` with one task per process: map SLURM's variables to torch's."""
    if launched_by_torchrun() or "SLURM_PROCID" not in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) < 2:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in os.environ:
        raise UserError("srun: set MASTER_ADDR (the first node's address) and MASTER_PORT before srun")
    os.environ.setdefault("MASTER_PORT", "29500")


def init_distributed(timeout_s: float = 1800.0) -> DistInfo:
    """Join the process group when launched with several processes (gloo on CPU, NCCL on GPU)."""
    _env_from_slurm()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return DistInfo(rank, world_size, local_rank, device)


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def gather_objects(value: object, info: DistInfo) -> list[object]:
    """Every rank's `value`, in rank order (a collective: all ranks call it)."""
    if not info.distributed:
        return [value]
    gathered: list[object] = [None] * info.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def all_reduce_sum(values: list[float], info: DistInfo) -> list[float]:
    """Element-wise sums over all ranks in one collective (float64, so token counts stay exact)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(tensor)
    return tensor.tolist()
