"""4-bit routed experts stored as stacked parameters (QLoRA on MoE models).

bitsandbytes' loader quantizes linear layers only. `transformers` stores the routed experts of its MoE models
(DeepSeek-V2, Mixtral, Qwen3-MoE, ...) as stacked 3-D parameters, so 4-bit loading left them, 90% or more of
such a model, in full precision. Here each stacked weight is quantized with bitsandbytes' own 4-bit format
(NF4/FP4, double quant, quant storage, as the config asks) and put back behind bitsandbytes' dequantizing
parametrization: `experts.gate_up_proj` still reads as the full weight, so `transformers`' experts code, PEFT's
`target_parameters` and tuneforge's grouped adapters run unchanged on it.

Reading the parametrized weight dequantizes it without a gradient; a matmul then keeps that full-size copy
for its backward. `dequantizing_matmul` keeps nothing and dequantizes again in backward, as bitsandbytes'
4-bit linear layers do, and `grouped_experts_forward` uses it for every quantized stacked weight (also through
the `tuneforge_grouped` experts implementation, set on models whose experts are quantized).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn

from tuneforge.config.schema import QuantizationConfig
from tuneforge.model.expert_lora import grouped_experts_forward
from tuneforge.model.quantize import DTYPES as QUANT_DTYPES
from tuneforge.model.quantize import kept_in_full_precision
from tuneforge.model.stacked_experts import has_stacked_layout, quant_state, stacked_weight_names


def quantizable_experts(model: nn.Module, settings: QuantizationConfig) -> list[tuple[str, nn.Module]]:
    """The experts modules whose stacked weights 4-bit loading quantizes: every `transformers` experts class
    with stacked weights, except those named in `skip_modules`."""
    return [
        (path, module)
        for path, module in model.named_modules()
        if has_stacked_layout(module) and not kept_in_full_precision(path, settings.skip_modules)
    ]


def quantizable_weights(model: nn.Module, settings: QuantizationConfig) -> list[nn.Parameter]:
    """The stacked expert weights that loading with `settings` stores in 4 bits, of a model not loaded yet
    (a meta-device skeleton): none for 8 bits, which bitsandbytes has no stacked format for."""
    if settings.bits != 4:
        return []
    experts = quantizable_experts(model, settings)
    return [getattr(module, name) for _, module in experts for name in stacked_weight_names(module)]


def stacked_numel(model: nn.Module, settings: QuantizationConfig) -> int:
    """Values in the stacked expert weights that loading with `settings` stores in 4 bits (on a skeleton)."""
    return sum(weight.numel() for weight in quantizable_weights(model, settings))


_DEQUANTIZE: type | None = None


def _dequantize_class() -> type:
    """bitsandbytes' dequantizing parametrization, reading the packed data as the one flat run of blocks it is:
    its CPU kernel takes blocks row by row, which is wrong for rows shorter than a block (as in tiny models).
    Built on first use, since bitsandbytes is optional."""
    global _DEQUANTIZE
    if _DEQUANTIZE is None:
        import bitsandbytes.functional as bnb_functional
        from bitsandbytes.nn.parametrize import Bnb4bitParametrization

        class FlatBnb4bitParametrization(Bnb4bitParametrization):
            def __init__(self, quant_state, compute_dtype: torch.dtype) -> None:
                super().__init__(quant_state)
                self.compute_dtype = compute_dtype

            @torch.no_grad()
            def forward(self, quantized_param: torch.Tensor) -> torch.Tensor:
                flat = copy.copy(self.quant_state)
                flat.shape = torch.Size([self.quant_state.shape.numel()])
                return bnb_functional.dequantize_4bit(quantized_param, flat).view(self.quant_state.shape)

        _DEQUANTIZE = FlatBnb4bitParametrization
    return _DEQUANTIZE


def _quantize_weight(
    experts: nn.Module, name: str, settings: QuantizationConfig, storage: torch.dtype, device: torch.device | None
) -> None:
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_functional

    weight = getattr(experts, name)
    values = weight.data if device is None else weight.data.to(device)  # from host RAM: this stack only
    packed, state = bnb_functional.quantize_4bit(
        values.reshape(-1),
        compress_statistics=settings.double_quant,
        quant_type=settings.quant_type,
        quant_storage=storage,
    )
    # A Params4bit, like the quantized linear layers' weights: PEFT's k-bit preparation leaves it uncast (its
    # float storage is packed data), and moving it moves its quantization state along.
    stored = bnb.nn.Params4bit(
        packed,
        requires_grad=False,
        quant_state=state,
        blocksize=state.blocksize,
        compress_statistics=settings.double_quant,
        quant_type=settings.quant_type,
        quant_storage=storage,
        bnb_quantized=True,
    )
    state.shape = weight.shape  # quantized flat (see _dequantize_class); read in its own shape
    setattr(experts, name, stored)
    del weight, values
    dequantize = _dequantize_class()(state, QUANT_DTYPES[settings.compute_dtype])
    parametrize.register_parametrization(experts, name, dequantize, unsafe=True)


def quantize_stacked_experts(
    model: nn.Module, settings: QuantizationConfig, storage: torch.dtype, device: torch.device | None = None
) -> int:
    """Quantizes the stacked expert weights of `model` in place (4-bit settings), on `device` if given (each
    stack is moved there alone: a model staged in host RAM); returns how many experts modules were. Their
    experts then run through `tuneforge_grouped`."""
    blocks = quantizable_experts(model, settings)
    for _, experts in blocks:
        for name in stacked_weight_names(experts):
            _quantize_weight(experts, name, settings, storage, device)
    if not blocks:
        return 0
    if model._can_set_experts_implementation():
        model.set_experts_implementation(register_experts_implementation())
    else:
        # transformers decides this from the modeling source, which it cannot read for some installs.
        current = getattr(model.config, "_experts_implementation", None)
        print(
            f"model: transformers cannot switch the experts of {type(model).__name__} to tuneforge's grouped "
            f"forward; its 4-bit experts run through '{current}' in the dtype they were loaded in, which keeps each "
            "dequantized expert stack for backward (more memory). model.quantization.skip_modules: [experts] keeps "
            "them in full precision instead"
        )
    return len(blocks)


def quantized_experts_count(model: nn.Module) -> int:
    """How many experts modules of `model` hold their stacked weights in 4 bits."""
    return sum(
        1
        for module in model.modules()
        if has_stacked_layout(module) and quant_state(module, stacked_weight_names(module)[-1]) is not None
    )


def dequantize_stacked_experts(model: nn.Module) -> int:
    """Undoes `quantize_stacked_experts`: each quantized stacked weight becomes a plain parameter holding its
    dequantized values (what adapters were trained against). Returns how many weights were."""
    count = 0
    for module in model.modules():
        if not has_stacked_layout(module):
            continue
        for name in stacked_weight_names(module):
            if quant_state(module, name) is not None:
                values = getattr(module, name).detach().clone()
                # Not leave_parametrized=True: that writes into the stored Params4bit, of another shape.
                parametrize.remove_parametrizations(module, name, leave_parametrized=False)
                setattr(module, name, nn.Parameter(values, requires_grad=False))
                count += 1
    return count


@contextlib.contextmanager
def plain_for_peft(model: nn.Module) -> Iterator[None]:
    """While PEFT adds or loads adapters: 4-bit stacked weights stood in for by plain placeholders.

    PEFT nests the wrappers of two targeted weights of one experts module in the module's parameter order
    when they are plain parameters, but in name order when they are parametrized. The keys of the adapter file
    (`experts.lora_A` for the outer wrapper, `experts.base_layer.lora_A` for the inner) would then mean other
    weights than for an unquantized base, and PEFT could not load a QLoRA adapter on the full model. Each
    placeholder has the weight's shape, dtype and device but no storage (a broadcast zero), so PEFT sizes
    the adapters as for the plain model; the stored 4-bit weights come back afterwards."""
    swapped = []
    for module in model.modules():
        if not has_stacked_layout(module):
            continue
        for name in stacked_weight_names(module):
            state = quant_state(module, name)
            if state is None:
                continue
            assert len(module.parametrizations[name]) == 1, "4-bit weights get adapters only once"
            dequantize, stored = module.parametrizations[name][0], module.parametrizations[name].original
            parametrize.remove_parametrizations(module, name, leave_parametrized=False)
            zero = torch.zeros((), dtype=state.dtype, device=stored.device)
            setattr(module, name, nn.Parameter(zero.expand(state.shape), requires_grad=False))
            swapped.append((module, name, stored, dequantize))
    try:
        yield
    finally:
        for module, name, stored, dequantize in swapped:
            delattr(module, name)
            setattr(module, name, stored)
            parametrize.register_parametrization(module, name, dequantize, unsafe=True)


EXPERTS_IMPLEMENTATION = "tuneforge_grouped"


def register_experts_implementation() -> str:
    """Registers tuneforge's grouped experts forward (no adapters) with `transformers`' experts interface,
    its documented extension point; returns its name."""
    from transformers.integrations.moe import ExpertsInterface

    def forward(
        experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return grouped_experts_forward(experts, hidden_states, top_k_index, top_k_weights, adapters={})

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, forward)
    return EXPERTS_IMPLEMENTATION
