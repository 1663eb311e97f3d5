"""Making a loaded model trainable: k-bit preparation, activation checkpointing, then what trains (adapters, frozen
parameters, or a vision-language model's parts)."""

from __future__ import annotations

from torch import nn

from tuneforge.config.schema import ModelConfig
from tuneforge.model.adapters import apply_lora, freeze_parameters
from tuneforge.model.moe import MoEMap
from tuneforge.model.quantized_experts import quantized_experts_count
from tuneforge.model.vision import VisionParts
from tuneforge.model.vision_training import make_vision_trainable


def make_trainable(
    model: nn.Module, cfg: ModelConfig, gradient_checkpointing: bool, moe: MoEMap
) -> tuple[nn.Module, list[str]]:
    """k-bit preparation, activation checkpointing, then adapters or freezing; lines saying what was done.
    `moe`: the base model's MoE map, found on `model` before anything wraps it."""
    notes = []
    checkpointing = {"use_reentrant": False}  # the non-reentrant form needs no input gradients and nests safely
    if cfg.quantization is not None:
        from peft import prepare_model_for_kbit_training

        # Casts the remaining full-precision weights (norms, embeddings) to fp32 for stable training.
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing, gradient_checkpointing_kwargs=checkpointing
        )
        q = cfg.quantization
        kind = f"{q.bits}-bit" + (f" {q.quant_type}{', double quant' if q.double_quant else ''}" if q.bits == 4 else "")
        experts = quantized_experts_count(model)
        stacked = f"; the stacked experts of {experts} MoE block(s) too" if experts else ""
        notes.append(f"quantization: base weights {kind}, compute {q.compute_dtype}{stacked}")
    elif gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
        else:  # transformers before the rename (5.17 has only the old name)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    if gradient_checkpointing:
        notes.append("gradient checkpointing: on (activations recomputed in backward)")
    parts = VisionParts.of(model)
    if parts is not None:
        model, note = make_vision_trainable(model, cfg, moe, parts)
        notes.append(note)
    elif cfg.lora is not None:
        model, note = apply_lora(model, cfg.lora, moe)
        notes.append(note)
    elif cfg.freeze:
        notes.append(freeze_parameters(model, cfg.freeze))
    return model, notes
