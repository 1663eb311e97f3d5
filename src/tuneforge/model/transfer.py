"""Batch tensors from the host to the model's device without making the host wait."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU batch tensor on `device`. To a GPU through pinned memory without blocking: a plain copy from
    pageable memory makes the host wait for the GPU's queue to drain."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
