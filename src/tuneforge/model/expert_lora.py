"""LoRA on stacked routed experts as grouped low-rank products, with no full-size deltas.

PEFT adapts a stacked expert weight W (one slice per expert) named in `target_parameters` by forming
W + s·B_e·A_e for every expert on every forward, then running the experts on that full-size tensor; backward
then computes a full-size weight gradient that is only reduced to A and B afterwards. For DeepSeek-V2-Lite
(64 experts of 3 x 2048 x 1408 per layer) that is 577M values built and differentiated per layer per pass for
adapters of rank 64.

`GroupedExpertLora` is PEFT's own `ParamWrapper` (same modules, keys and shapes, so the adapter files and
PEFT's loader are unchanged) with another forward: the tokens routed to each expert are multiplied by the frozen
weight and, separately, by the expert's two low-rank factors, (x·A_e)·B_e, each as one grouped matmul over all
experts (`torch.nn.functional.grouped_mm` where its layout rules hold). Up to rounding this is
x·(W_e + s·B_e·A_e): the same function as PEFT's, without any tensor the size of W besides W itself.

It is registered with PEFT through `LoraConfig._register_custom_module` for experts classes that
`transformers` builds with `use_experts_implementation` (their layout is described by its attributes); others
keep PEFT's own wrapper. Since the low-rank branch is separate, it also takes input dropout, which PEFT's
wrapper cannot apply to stacked weights.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrize import type_before_parametrizations

from tuneforge.model.stacked_experts import (
    compute_dtype,
    dequantizing_matmul,
    has_stacked_layout,
    only_quantized,
    stacked_weight_names,
)

GROUPED_MM_ALIGNMENT = 16
"""Bytes: grouped_mm's kernels need every non-unit stride and the data pointers on this boundary."""


def grouped_experts_unsupported(experts: nn.Module) -> str | None:
    """Why the grouped form cannot run `experts` (None when it can): it reads the layout attributes that
    `transformers`' `use_experts_implementation` sets on an experts class."""
    if not all(hasattr(experts, a) for a in ("has_gate", "has_bias", "is_transposed", "num_experts")):
        return f"{type(experts).__name__} does not describe its layout (not a transformers experts class)"
    if getattr(experts, "_is_expert_parallel", False):
        return "experts are split across ranks (expert parallelism)"
    if not has_stacked_layout(experts):
        return f"{type(experts).__name__} has no stacked {' and '.join(stacked_weight_names(experts))} weights"
    return None


def _kernel_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `grouped_mm` takes these operands as they are (CUDA: bfloat16 on sm80+; both: aligned strides)."""
    if a.dtype != b.dtype or not hasattr(F, "grouped_mm"):
        return False
    if a.is_cuda and (a.dtype != torch.bfloat16 or torch.cuda.get_device_capability(a.device) < (8, 0)):
        return False
    for t in (a, b):
        size = t.element_size()
        if t.data_ptr() % GROUPED_MM_ALIGNMENT or any((s * size) % GROUPED_MM_ALIGNMENT for s in t.stride() if s != 1):
            return False
    return True


class _Groups:
    """Rows sorted by expert: the `grouped_mm` offsets, and the per-expert counts for the fallback loop
    (read from the device only if the fallback is needed)."""

    def __init__(self, expert_of_row: torch.Tensor, num_experts: int) -> None:
        # histc, not bincount: bincount on CUDA reads the largest id on the host to size its output. histc takes
        # integers on CUDA and (deterministically) only floats on CPU.
        ids = expert_of_row.int() if expert_of_row.is_cuda else expert_of_row.float()
        counts = torch.histc(ids, bins=num_experts, min=0, max=num_experts - 1).long()
        self.offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        self._counts = counts
        self._host_counts: list[int] | None = None

    def matmul(self, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """rows (S, in) grouped by expert times weight (E, in, out): (S, out)."""
        if _kernel_applies(rows, weight):
            return F.grouped_mm(rows, weight, offs=self.offsets)
        if self._host_counts is None:
            # The fallback (CPU without aligned shapes, non-bf16 on CUDA) needs the split on the host; on CUDA
            # that is one device-to-host copy per MoE block forward.
            self._host_counts = self._counts.tolist()
        pieces = torch.split(rows, self._host_counts)
        return torch.cat([piece @ weight[e] for e, piece in enumerate(pieces)])


def _as_in_out(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """A stacked weight as (experts, in, out): transformers stores (experts, out, in) unless transposed."""
    return weight if transposed else weight.transpose(1, 2)


def _low_rank(wrapper: nn.Module, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A as (experts, in, r), B as (experts, r, out), scaling) of one ParamWrapper's adapter, in its own dtype
    (the grouped forward casts them to the one it computes in).

    PEFT lays the factors out as lora_A.weight (experts·r, in), rows grouped by expert, and lora_B.weight
    (out, r·experts), columns interleaved as r·experts + e, whether the weight is stored transposed or not
    (its in/out are then swapped)."""
    down, up = expert_factors(wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight, wrapper.num_experts)
    # grouped_mm takes A's transposed view as it is; B's interleaved columns leave the expert stride at one
    # element, which its kernels refuse, so B is copied (rank-sized, not weight-sized).
    return down, up.contiguous(), wrapper.scaling[adapter]


def expert_factors(a: torch.Tensor, b: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's saved factors of a stacked weight, lora_A (experts·r, in) and lora_B (out, r·experts), as one
    (in, r) and one (r, out) factor per expert (views)."""
    down = a.reshape(experts, -1, a.shape[-1]).transpose(1, 2)  # (E, in, r)
    up = b.reshape(b.shape[0], -1, experts).permute(2, 1, 0)  # (E, r, out)
    return down, up


def grouped_experts_forward(
    experts: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    adapters: dict[str, tuple[torch.Tensor, torch.Tensor, float, nn.Module]],
) -> torch.Tensor:
    """What `experts(hidden_states, top_k_index, top_k_weights)` computes with W + s·B·A in place of each adapted
    weight W, computed as x·W + s·(dropout(x)·A)·B. `adapters`: parameter name -> (A, B, s, dropout)."""
    device_type = hidden_states.device.type
    autocast = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type) if autocast else compute_dtype(experts)
    num_tokens, top_k = top_k_index.shape
    expert_of_pair = top_k_index.reshape(-1)
    order = torch.argsort(expert_of_pair, stable=True)
    groups = _Groups(expert_of_pair[order], experts.num_experts)
    rows = hidden_states[order // top_k].to(dtype)

    def weight(name: str) -> torch.Tensor:
        return _as_in_out(getattr(experts, name), experts.is_transposed).to(dtype)

    def project(name: str, x: torch.Tensor) -> torch.Tensor:
        if only_quantized(experts, name):
            out = dequantizing_matmul(x, groups.matmul, lambda: weight(name))
        else:
            out = groups.matmul(x, weight(name))
        if experts.has_bias:
            out = out + getattr(experts, f"{name}_bias")[expert_of_pair[order]].to(dtype)
        if name in adapters:
            down, up, scaling, dropout = adapters[name]
            out = out + groups.matmul(groups.matmul(dropout(x), down.to(dtype)), up.to(dtype)) * scaling
        return out

    with torch.autocast(device_type, enabled=False):
        if experts.has_gate:
            inner = experts._apply_gate(project("gate_up_proj", rows))
        else:
            inner = experts.act_fn(project("up_proj", rows))
        out = project("down_proj", inner)
        if getattr(experts, "has_post_expert_norm", False):
            out = experts.post_expert_norm(out)
        out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        # Back to (token, k) order, then a plain sum over k: deterministic, unlike a scatter-add.
        unsorted = torch.empty_like(out).index_copy_(0, order, out)
        return unsorted.view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def _grouped_wrapper_class() -> type:
    from peft.tuners.lora import layer as peft_lora

    class ParamWrapper(peft_lora.ParamWrapper):
        """PEFT's wrapper of one stacked expert weight, whose outermost instance runs all the experts' adapters
        as grouped low-rank products (see the module docstring). It keeps PEFT's class name because PEFT
        recognises wrappers of parameters by that name when it nests a second one on the same experts."""

        def __init__(self, base_layer: nn.Module, adapter_name: str, config: Any, **kwargs: Any) -> None:
            # PEFT's wrapper refuses input dropout (it cannot drop inside W + B·A); this one applies it.
            dropout = config.lora_dropout
            if dropout:
                config = copy.copy(config)
                config.lora_dropout = 0.0
            super().__init__(base_layer, adapter_name, config=config, **kwargs)
            if dropout:
                self.lora_dropout[adapter_name] = nn.Dropout(p=dropout)

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            adapters, layer = {}, self
            while isinstance(layer, peft_lora.ParamWrapper):
                active = [a for a in layer.active_adapters if a in layer.lora_A]
                if layer.disable_adapters or layer.merged or len(active) > 1 or kwargs.get("adapter_names"):
                    return super().forward(x, *args, **kwargs)  # PEFT's own path for its other modes
                if active:
                    down, up, scaling = _low_rank(layer, active[0])
                    adapters[layer.parameter_name] = (down, up, scaling, layer.lora_dropout[active[0]])
                layer = layer.base_layer
            return grouped_experts_forward(layer, x, *args, adapters=adapters, **kwargs)

    return ParamWrapper


_WRAPPER: type | None = None


def grouped_expert_lora_class() -> type:
    """The PEFT layer class (built on first use: PEFT is imported only when adapters are)."""
    global _WRAPPER
    if _WRAPPER is None:
        _WRAPPER = _grouped_wrapper_class()
    return _WRAPPER


def grouped_layers(model: nn.Module, parameter_names: list[str]) -> tuple[dict[type, type], dict[str, str]]:
    """For adapters on `parameter_names` (full names of weights in `model`): the PEFT custom-layer mapping
    that runs those on stacked experts as grouped low-rank products, and the experts modules (by path) that
    cannot, with the reason. Names of linear layers' weights are left out of both."""
    layers, refused = {}, {}
    for path in sorted({name.rsplit(".", 1)[0] for name in parameter_names}):
        module = model.get_submodule(path)
        if isinstance(module, nn.Linear):
            continue
        if (reason := grouped_experts_unsupported(module)) is not None:
            refused[path] = reason
        else:
            # The class before any parametrization (4-bit weights): PEFT matches it by isinstance.
            layers[type_before_parametrizations(module)] = grouped_expert_lora_class()
    return layers, refused
