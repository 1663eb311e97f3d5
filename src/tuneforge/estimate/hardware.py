"""The accelerators tuneforge knows: memory, dense bf16 peak and memory bandwidth, from the vendors' data sheets.
One table for the whole package: the estimate sizes jobs with it, the step log's MFU divides by its peak."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 2**30


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gib: float
    bf16_flops: float | None
    """Dense bf16 tensor-core peak (no sparsity); None: unknown, no time estimate."""
    memory_bytes_per_s: float | None = None
    """HBM bandwidth, for the memory-bound work (expert adapter deltas)."""


ACCELERATORS = {
    "h100": Accelerator("H100 80GB", 80.0, 989e12, 3.35e12),
    "h200": Accelerator("H200 141GB", 141.0, 989e12, 4.8e12),
    "a100-80gb": Accelerator("A100 80GB", 80.0, 312e12, 2.0e12),
    "a100-40gb": Accelerator("A100 40GB", 40.0, 312e12, 1.55e12),
    "l40s": Accelerator("L40S", 48.0, 362e12, 0.864e12),
    "a10g": Accelerator("A10G", 24.0, 125e12, 0.6e12),
    "l4": Accelerator("L4", 24.0, 121e12, 0.3e12),
}
"""SXM parts where there are several; memory is nominal (the estimate's CUDA allowance covers what the driver
keeps)."""


def accelerator_key(device_name: str, memory_gib: float) -> str | None:
    """The table's name (`--gpu`) for a device name as CUDA reports it (`NVIDIA H200`); None if unknown."""
    for key in ACCELERATORS:
        model, _, size = key.partition("-")
        if model.upper() in device_name.upper() and (not size or (memory_gib > 50) == (size == "80gb")):
            return key
    return None


def accelerator_for(device_name: str, memory_gib: float) -> Accelerator:
    """The table's entry for a device name as CUDA reports it, with the device's own memory; unknown parts get
    no peak."""
    key = accelerator_key(device_name, memory_gib)
    if key is None:
        return Accelerator(device_name, memory_gib, None)
    known = ACCELERATORS[key]
    return Accelerator(device_name, memory_gib, known.bf16_flops, known.memory_bytes_per_s)


def local_accelerator() -> Accelerator | None:
    """This machine's first GPU, with its peak and bandwidth when the table knows it; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    memory_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    return accelerator_for(torch.cuda.get_device_name(0), memory_gib)


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of `device`; None on CPU or for parts the table does not know."""
    if device.type != "cuda":
        return None
    memory_gib = torch.cuda.get_device_properties(device).total_memory / GIB
    return accelerator_for(torch.cuda.get_device_name(device), memory_gib).bf16_flops
