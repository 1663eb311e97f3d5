"""The live policy's weights as a checkpoint would hold them, streamed layer by layer, without touching the model.

A generation engine that keeps its own copy of the weights (vLLM) is refreshed from this stream before each
rollout. What it yields is what a merged export of this moment would hold: adapters folded into their base
weights (LoRA on linear layers and on stacked experts, each active adapter's `get_delta_weight`), 4-bit bases
and quantized stacked experts dequantized, and names in the checkpoint's layout (transformers' own reverse
conversion, so fused experts come out per expert as the model's checkpoints name them). The model is only read:
merging in place would round a 4-bit base through a second quantization and change the training.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.utils import parametrize

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")
"""A name's decoder layer (`model.layers.7`): transformers' conversions group tensors within one layer."""


def policy_weights(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of every weight of `model` (a transformers model, or a PEFT model around one),
    adapters merged and quantized weights dequantized, cast to `dtype` when given; one decoder layer at a time."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    group, chunk = None, {}
    with torch.no_grad():
        for name, tensor in _effective(base, ""):
            key = _group_of(name)
            if key != group and chunk:
                yield from _checkpoint_names(base, chunk, dtype)
                chunk = {}
            group = key
            chunk[name] = tensor
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


def _effective(module: nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's tensors as the forward uses them, by their names in the plain (unwrapped) model."""
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
            yield from _effective(child, f"{prefix}{name}.")


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
    """A bitsandbytes 4-bit or 8-bit weight as the compute dtype holds it; any other tensor as it is."""
    if name == "weight" and type(parameter).__name__ in ("Params4bit", "Int8Params"):
        from peft.utils.integrations import dequantize_module_weight

        return dequantize_module_weight(module)
    return parameter
