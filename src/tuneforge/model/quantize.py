"""k-bit base weights through bitsandbytes (QLoRA), with the checks that turn its deep assertions into
clear messages."""

from __future__ import annotations

import torch
from torch import nn

from tuneforge.config.schema import QuantizationConfig
from tuneforge.errors import UserError

CPU_BLOCK = 32
"""bitsandbytes' CPU 4-bit kernels split a layer's outputs into blocks of this many rows."""

QUANT_BLOCK = 64  # bitsandbytes 4-bit: one absmax constant per 64 weights (fp32, or 8-bit with double quant)
DOUBLE_QUANT_GROUP = 256  # double quantization: one fp32 constant per 256 absmax values

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "uint8": torch.uint8}


OUTPUT_HEADS = ("lm_head", "score")
"""Kept in full precision: the language model head, and the score head of reward models."""


def storage_dtype(settings: QuantizationConfig, sharded_engine: bool) -> torch.dtype:
    """ZeRO-3 and FSDP partition only floating-point parameters: packed 4-bit data must be stored in a float
    dtype there, which bitsandbytes supports through its quant storage setting."""
    if settings.storage_dtype != "auto":
        return DTYPES[settings.storage_dtype]
    return DTYPES[settings.compute_dtype] if sharded_engine else torch.uint8


VISION_PARTS = [r"(?:.*\.)?vision_tower", r"(?:.*\.)?multi_modal_projector", r"(?:.*\.)?visual"]
"""A vision-language model's tower and projector (Qwen's `visual` holds its projector), at any depth: QLoRA
quantizes the language model only; the tower stays in 16 bits, as its adapters or frozen features need."""


def bitsandbytes_config(settings: QuantizationConfig, sharded_engine: bool):
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError:
        raise UserError(
            "model.quantization needs bitsandbytes: pip install 'tuneforge[qlora]' (or pip install bitsandbytes)"
        ) from None
    skip = [*OUTPUT_HEADS, *VISION_PARTS, *settings.skip_modules]
    if settings.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=settings.quant_type,
        bnb_4bit_use_double_quant=settings.double_quant,
        bnb_4bit_compute_dtype=DTYPES[settings.compute_dtype],
        bnb_4bit_quant_storage=storage_dtype(settings, sharded_engine),
        llm_int8_skip_modules=skip,
    )


def kept_in_full_precision(name: str, skip: list[str]) -> bool:
    """Whether the module at path `name` is left unquantized by `skip` (`skip_modules` plus the head), decided by
    the rule `transformers` applies to the linear layers it hands to bitsandbytes, so that the stacked experts
    follow the same names."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    return not should_convert_module(name, skip)


def matches_module_name(name: str, names: list[str]) -> bool:
    """`q_proj` names every module whose path is `q_proj` or ends with `.q_proj`."""
    return any(name == short or name.endswith("." + short) for short in names)


def quantized_linears(model: nn.Module, settings: QuantizationConfig) -> list[tuple[str, nn.Linear]]:
    """The layers bitsandbytes will quantize: linear layers except the output head, a vision-language model's
    tower and projector, and `skip_modules` (the list `bitsandbytes_config` gives)."""
    head = model.get_output_embeddings()
    skip = [*OUTPUT_HEADS, *VISION_PARTS, *settings.skip_modules]
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module is not head and not kept_in_full_precision(name, skip)
    ]


def stored_numel(param: torch.Tensor) -> int:
    """Values a parameter holds: packed k-bit weights hold several per element; their quantization state
    knows the real shape."""
    state = getattr(param, "quant_state", None)
    return int(torch.Size(state.shape).numel()) if state is not None else param.numel()


def check_cpu_kernel_sizes(skeleton: nn.Module, settings: QuantizationConfig) -> None:
    """On CPU, bitsandbytes' 4-bit kernels assert that every quantized layer's output size is a multiple of
    32 (deep inside the first single-token forward). Check the model's shapes before loading any weight."""
    if settings.bits != 4:
        return
    bad = [
        f"{name} ({module.out_features})"
        for name, module in quantized_linears(skeleton, settings)
        if module.out_features % CPU_BLOCK
    ]
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise UserError(
            f"model.quantization: bitsandbytes' CPU 4-bit kernels need every quantized layer's output size to be "
            f"a multiple of {CPU_BLOCK}; these are not: {shown}. Resize the model, list those modules in "
            "model.quantization.skip_modules, or train on a GPU"
        )


def keep_training_layout(model: nn.Module) -> int:
    """On CPUs with AVX512-BF16, bitsandbytes repacks a 4-bit layer's weight in place the first time it runs
    without gradients (generation, evaluation), into a layout only its inference kernel reads; that needs
    input sizes divisible by the quantization block, breaks sharded (ZeRO-3, FSDP) weights, and leaves a
    training model with rewritten weights. Quantized layers are told to keep the layout they were trained in;
    returns how many were."""
    count = 0
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count


def kbit_bytes(bits: int, double_quant: bool) -> float:
    """Bytes per k-bit weight, quantization constants included."""
    if bits == 8:
        return 1.0  # plus one fp32 scale per row: negligible
    constants = 8 / QUANT_BLOCK + 32 / (QUANT_BLOCK * DOUBLE_QUANT_GROUP) if double_quant else 32 / QUANT_BLOCK
    return (4 + constants) / 8
