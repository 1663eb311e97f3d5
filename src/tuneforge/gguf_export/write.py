"""Write one GGUF file from a loaded model and its tokenizer: settings, vocabulary, chat template, tensors."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from tuneforge.errors import UserError
from tuneforge.gguf_export.architectures import facts, write_hyperparameters
from tuneforge.gguf_export.tensors import gguf_tensors
from tuneforge.gguf_export.vocab import vocabulary, write_vocabulary
from tuneforge.model.unloaded_weights import recall

OUTTYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}
KEPT_F32 = ("_norm.weight", "ffn_gate_inp.weight", "rope_freqs.weight")
"""Norms, routers and rotary factors stay in 32 bits at every outtype: they are tiny and precision-sensitive
(a router in 8 bits can pick different experts)."""


@dataclass(frozen=True)
class Written:
    path: Path
    arch: str
    tensors: int
    scheme: str
    bytes: int


def _kind(name: str, tensor: torch.Tensor, outtype: str) -> gguf.GGMLQuantizationType:
    if outtype == "f32" or tensor.dim() == 1 or name.endswith(KEPT_F32):
        return gguf.GGMLQuantizationType.F32
    if outtype == "q8_0":
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]
        # Rows that are no whole number of blocks stay in 16 bits, as llama.cpp's own converter does.
        return gguf.GGMLQuantizationType.Q8_0 if tensor.shape[-1] % block == 0 else gguf.GGMLQuantizationType.F16
    return gguf.GGMLQuantizationType.BF16 if outtype == "bf16" else gguf.GGMLQuantizationType.F16


PLAIN = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}


def _declare(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, kind: gguf.GGMLQuantizationType) -> None:
    shape = tuple(tensor.shape)
    if kind in PLAIN:
        dtype = np.dtype(PLAIN[kind])
        writer.add_tensor_info(name, shape, dtype, tensor.numel() * dtype.itemsize)
    else:
        byte_shape = gguf.quant_shape_to_byte_shape(shape, kind)
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=kind)


def _encode(tensor: torch.Tensor, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    data = tensor.detach().to(torch.float32).contiguous().numpy()
    if kind in PLAIN:
        return data.astype(PLAIN[kind], copy=False)
    return gguf.quants.quantize(data, kind)


def write_gguf(
    model: Any,
    tokenizer: Any,
    chat_template: str | None,
    out: Path,
    outtype: str,
    name: str,
    stop_ids: list[int] | None = None,
) -> Written:
    """`model` a loaded transformers causal LM (adapters merged); written to `out` through a temporary file in
    the same folder, so a stopped export leaves no half file under the final name. `stop_ids`: the training
    template's stop tokens, EOS first; the next one becomes the end-of-turn token llama.cpp also stops at."""
    config = model.config
    found = facts(config)  # refuses an unconverted architecture before anything is read
    if (unloaded := recall(model)) is not None:
        raise UserError(
            f"export --format gguf: the model holds {unloaded.describe()}; this GGUF would lose them (llama.cpp's "
            f"{found.arch} has no place for them): export --merge keeps them, for vLLM or SGLang"
        )
    state = model.state_dict()
    rows = state["model.embed_tokens.weight"].shape[0]
    vocab = vocabulary(tokenizer, rows)
    vocab = replace(vocab, eot_id=next((i for i in stop_ids or [] if i != vocab.eos_id), None))
    tensors = list(gguf_tensors(state, config, found))  # every name checked before a byte is written
    write_hyperparameters(gguf.GGUFWriter(None, found.arch), config, rows)  # its refusals, before a file exists
    partial = out.with_name(f".{out.name}.partial")
    writer = gguf.GGUFWriter(partial, found.arch)
    try:
        writer.add_name(name)
        writer.add_file_type(OUTTYPES[outtype])
        if outtype in ("q8_0", "bf16"):
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        write_hyperparameters(writer, config, rows)
        write_vocabulary(writer, vocab)
        if chat_template:
            writer.add_chat_template(chat_template)
        kinds = [_kind(tensor_name, tensor, outtype) for tensor_name, tensor in tensors]
        for (tensor_name, tensor), kind in zip(tensors, kinds, strict=True):
            _declare(writer, tensor_name, tensor, kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        # One tensor encoded at a time: the export needs the model's memory plus its largest tensor, not twice.
        for (_tensor_name, tensor), kind in zip(tensors, kinds, strict=True):
            writer.write_tensor_data(_encode(tensor, kind))
        writer.close()
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, out)
    return Written(out, found.arch, len(tensors), vocab.scheme, out.stat().st_size)
