"""Mixture-of-experts blocks, found by structure for any model.

An MoE block is a module with a router (a child whose weight has one row per expert) and experts,
held either as a list of identical expert modules (DeepSeek's remote code, older Mixtral) or as
stacked expert parameters (one tensor with a leading expert dimension, `transformers` 5).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class MoEBlock:
    name: str
    module: nn.Module
    num_experts: int
    layout: str
    """`list`: one module per expert; `stacked`: expert weights stacked in 3-D parameters."""
    router: nn.Module
    """The child that scores experts (its weight has one row per expert)."""
    experts_name: str
    """Name of the child holding the routed experts (shared experts, if any, are not in it)."""


def _expert_count(child: nn.Module) -> tuple[int, str] | None:
    if isinstance(child, nn.ModuleList) and len(child) >= 2:
        shapes = {tuple((n, tuple(p.shape)) for n, p in expert.named_parameters()) for expert in child}
        if len({type(expert) for expert in child}) == 1 and len(shapes) == 1:
            return len(child), "list"
        return None
    stacked = {p.shape[0] for p in child.parameters(recurse=False) if p.ndim == 3}
    if len(stacked) == 1 and (count := stacked.pop()) >= 2:
        return count, "stacked"
    return None


def _router_rows(child: nn.Module) -> int | None:
    weight = getattr(child, "weight", None)
    if isinstance(weight, nn.Parameter) and weight.ndim == 2:
        return weight.shape[0]
    return None


def find_moe_blocks(model: nn.Module) -> list[MoEBlock]:
    blocks = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        experts = [(child, *found) for child, m in children.items() if (found := _expert_count(m)) is not None]
        if len(experts) != 1:
            continue
        experts_name, count, layout = experts[0]
        router = next((child for child in children.values() if _router_rows(child) == count), None)
        if router is not None:
            blocks.append(MoEBlock(name, module, count, layout, router, experts_name))
    return blocks


def describe(blocks: list[MoEBlock]) -> str:
    classes = sorted({type(b.module).__name__ for b in blocks})
    layouts = sorted({b.layout for b in blocks})
    experts = sorted({b.num_experts for b in blocks})
    return (
        f"{len(blocks)} MoE blocks ({', '.join(classes)}), {'/'.join(map(str, experts))} routed experts each, "
        f"experts {' and '.join(layouts)}"
    )
