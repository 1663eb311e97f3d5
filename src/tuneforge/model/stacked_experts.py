"""The one place that knows how `transformers` lays out stacked routed experts, and how their weights read.

`transformers` stores the routed experts of its MoE models (DeepSeek-V2, Mixtral, Qwen3-MoE, ...) as stacked
3-D parameters on experts classes built with `use_experts_implementation`, whose attributes (`has_gate`,
`is_transposed`, ...) describe the layout. A stacked weight may be stored in 4 bits behind bitsandbytes'
dequantizing parametrization (`quantized_experts`); reading it then dequantizes it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn


def stacked_weight_names(experts: nn.Module) -> list[str]:
    """The stacked weights of a `transformers` experts module (laid out as its attributes describe)."""
    return ["gate_up_proj" if experts.has_gate else "up_proj", "down_proj"]


def has_stacked_layout(experts: nn.Module) -> bool:
    """Whether `experts` is a `transformers` experts class (`use_experts_implementation`) with stacked weights."""
    if not all(hasattr(experts, a) for a in ("has_gate", "has_bias", "is_transposed", "num_experts")):
        return False
    # Looked up without reading them: reading a quantized weight dequantizes it.
    return all(
        isinstance(experts._parameters.get(name), nn.Parameter) or parametrize.is_parametrized(experts, name)
        for name in stacked_weight_names(experts)
    )


def _dequantizer(experts: nn.Module, name: str) -> nn.Module | None:
    """The bitsandbytes parametrization that dequantizes a stacked weight stored in 4 bits, else None."""
    if not parametrize.is_parametrized(experts, name):
        return None
    from bitsandbytes.nn.parametrize import Bnb4bitParametrization

    found = [p for p in experts.parametrizations[name] if isinstance(p, Bnb4bitParametrization)]
    return found[0] if found else None


def quant_state(experts: nn.Module, name: str):
    """The bitsandbytes quantization state of a stacked weight that is stored in 4 bits, else None."""
    dequantizer = _dequantizer(experts, name)
    return dequantizer.quant_state if dequantizer is not None else None


def only_quantized(experts: nn.Module, name: str) -> bool:
    """Stored in 4 bits with nothing else on top (no PEFT delta parametrization): reading it is a frozen
    dequantization, which `dequantizing_matmul` can redo in backward instead of keeping."""
    return quant_state(experts, name) is not None and len(experts.parametrizations[name]) == 1


def compute_dtype(experts: nn.Module) -> torch.dtype:
    """The dtype the experts compute in outside autocast: the quantization's compute dtype for 4-bit experts,
    as for bitsandbytes' 4-bit linear layers (both then follow autocast where it is on); else their weights'."""
    name = stacked_weight_names(experts)[-1]
    dequantizer = _dequantizer(experts, name)
    if dequantizer is not None:
        return getattr(dequantizer, "compute_dtype", dequantizer.quant_state.dtype)
    return getattr(experts, name).dtype


class _DequantizingMatmul(torch.autograd.Function):
    """rows x weight() where weight() dequantizes a frozen 4-bit weight: called again in backward rather than
    keeping the full-size dequantized copy between forward and backward."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, matmul: Callable, weight: Callable[[], torch.Tensor]) -> torch.Tensor:
        ctx.matmul, ctx.weight = matmul, weight
        return matmul(rows, weight())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.matmul(grad, ctx.weight().transpose(1, 2)), None, None


def dequantizing_matmul(
    rows: torch.Tensor,
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    weight: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """`matmul(rows, weight())` for a frozen (experts, in, out) `weight()` that is rebuilt, not kept, for the
    gradient of `rows`."""
    return _DequantizingMatmul.apply(rows, matmul, weight)
