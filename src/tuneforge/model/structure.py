"""Model facts found by structure, not by name: the decoder layers, the MoE blocks."""

from __future__ import annotations

from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of identical blocks that holds most of the parameters (the decoder layers)."""
    stacks = [
        module
        for module in model.modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0 and len({type(child) for child in module}) == 1
    ]
    assert stacks, f"{type(model).__name__} has no stack of identical layers"
    return max(stacks, key=lambda stack: sum(p.numel() for p in stack.parameters()))
