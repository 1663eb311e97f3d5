"""Figures for the step line: peak memory and the parameters a token multiplies with (for model FLOP/s and, on
GPUs whose peak `estimate.hardware` knows, the model FLOPs utilisation)."""

from __future__ import annotations

import resource

import torch
from torch import nn

from tuneforge.model.moe import MoEMap
from tuneforge.model.quantize import stored_numel


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated GPU memory on GPU; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kilobytes on Linux


def active_matmul_parameters(model: nn.Module, moe: MoEMap) -> int:
    """Parameters a token multiplies with: all but the input embedding, and for MoE only the routed experts
    a token is sent to (top_k of num_experts, from the run's MoE map). Call it before an engine shards the
    model."""
    total = sum(stored_numel(p) for p in model.parameters())
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embedding is not None:
        total -= embedding.weight.numel()
    return total - moe.idle_numel()
