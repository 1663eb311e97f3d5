"""The live policy's weights as a checkpoint would hold them, streamed layer by layer, without touching the model.

A generation engine that keeps its own copy of the weights (vLLM) is refreshed from this stream before each
rollout. What it yields is what a merged export of this moment would hold: adapters folded into their base
weights (LoRA on linear layers and on stacked experts, each active adapter's `get_delta_weight`), 4-bit bases
and quantized stacked experts dequantized, and names in the checkpoint's layout (transformers' own reverse
conversion, so fused experts come out per expert as the model's checkpoints name them). The model is only read:
merging in place would round a 4-bit base through a second quantization and change the training.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.nn.utils import parametrize

from tuneforge.model.structure import decoder_layers

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")
"""A name's decoder layer (`model.layers.7`): transformers' conversions group tensors within one layer."""


Whole = Callable[[nn.Module], AbstractContextManager]
"""`Engine.whole`: a unit's (the root's, a decoder layer's) parameters gathered while inside, under sharding."""


def policy_weights(
    model: nn.Module, dtype: torch.dtype | None = None, whole: Whole | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of every weight of `model` (a transformers model, or a PEFT model around one),
    adapters merged and quantized weights dequantized, cast to `dtype` when given; one decoder layer at a time.
    With `whole` (sharded weights: a collective, every rank reads the same), each unit is gathered in turn and
    what it yields copied before it is released."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = {id(layer) for layer in decoder_layers(base)} if whole else set()
    group, chunk = None, {}
    with torch.no_grad(), whole(base) if whole else contextlib.nullcontext():
        for name, tensor in _effective(base, "", layers, whole):
            key = _group_of(name)
            if key != group and chunk:
                yield from _checkpoint_names(base, chunk, dtype)
                chunk = {}
            group = key
            chunk[name] = tensor.clone() if whole else tensor  # taken while its unit is gathered
        if chunk:
            yield from _checkpoint_names(base, chunk, dtype)


def _group_of(name: str) -> str:
    found = _LAYER.match(name)
    return found.group(1) if found else ""


def _checkpoint_names(
    base: nn.Module, chunk: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    from transformers.core_model_loading import revert_weight_conversion

    for name, tensor in revert_weight_conversion(base, chunk).items():
        yield name, tensor if dtype is None else tensor.to(dtype)


def _effective(
    module: nn.Module, prefix: str, layers: set[int] = frozenset(), whole: Whole | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's tensors as the forward uses them, by their names in the plain (unwrapped) model; a decoder
    layer among `layers` gathered by `whole` while its tensors are taken."""
    if id(module) in layers and whole is not None:
        with whole(module):
            yield from _effective(module, prefix)
        return
    if _is_adapter_layer(module):
        yield from _merged(module, prefix)
        return
    parametrized = set(module.parametrizations.keys()) if parametrize.is_parametrized(module) else set()
    for name in parametrized:
        yield prefix + name, getattr(module, name)  # the parametrization's output: dequantized experts
    for name, parameter in module.named_parameters(recurse=False):
        if name not in parametrized:
            yield prefix + name, _dequantized(module, name, parameter)
    for name, buffer in module.named_buffers(recurse=False):
        if buffer is not None and name not in module._non_persistent_buffers_set:
            yield prefix + name, buffer
    for name, child in module.named_children():
        if name != "parametrizations":
            yield from _effective(child, f"{prefix}{name}.", layers, whole)


def _merged(layer: nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """An adapter layer's base tensors with each active adapter's delta added to the one it adapts (`weight` of a
    linear layer, `parameter_name` of a wrapped stacked-experts parameter; wrappers nest, one per parameter)."""
    tensors = dict(_effective(layer.base_layer, ""))
    target = getattr(layer, "parameter_name", None) or "weight"
    if not layer.merged and not layer.disable_adapters:
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                delta = layer.get_delta_weight(adapter)
                tensors[target] = tensors[target] + delta.to(tensors[target].dtype)
    for name, tensor in tensors.items():
        yield prefix + name, tensor


def _is_adapter_layer(module: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def _dequantized(module: nn.Module, name: str, parameter: torch.Tensor) -> torch.Tensor:
    """A bitsandbytes 4-bit or 8-bit weight as the compute dtype holds it; any other tensor as it is. A sharded
    engine's gathered 4-bit weight is a plain tensor of the packed data: its quantization state is the module's
    (where bitsandbytes keeps it for sharding)."""
    if name != "weight":
        return parameter
    kind = type(parameter).__name__
    if kind == "Int8Params":
        from peft.utils.integrations import dequantize_module_weight

        return dequantize_module_weight(module)
    if kind == "Params4bit" or any(c.__name__ == "Linear4bit" for c in type(module).__mro__):
        import bitsandbytes

        state = getattr(parameter, "quant_state", None) or getattr(module, "quant_state", None)
        return bitsandbytes.functional.dequantize_4bit(parameter.data, state)
    return parameter
