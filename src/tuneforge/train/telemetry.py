"""Figures for the step line: peak memory (the model FLOPs a token needs are `model.flops`)."""

from __future__ import annotations

import resource

import torch


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated GPU memory on GPU; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kilobytes on Linux
