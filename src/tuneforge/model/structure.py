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
    return max(stacks, key=lambda stack: sum(_full_numel(p) for p in stack.parameters()))


def _full_numel(parameter: nn.Parameter) -> int:
    # ZeRO-3 leaves each rank an empty placeholder; DeepSpeed records the whole size beside it.
    return getattr(parameter, "ds_numel", None) or parameter.numel()
