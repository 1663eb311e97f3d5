"""A Hugging Face state dict as llama.cpp's tensors: names, layouts and the checks that nothing is lost.

Every tensor of the model must land under a name the architecture's llama.cpp loader reads (`gguf.MODEL_TENSORS`),
and every name must come from some tensor: a weight left over, or a name llama.cpp does not know, refuses the
conversion with the names instead of writing a file that loads with a piece missing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import gguf
import torch

from tuneforge.errors import UserError
from tuneforge.gguf_export.architectures import ROTATE_HALF_PAIRS, ArchitectureFacts, llama3_rope_factors

GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
"""A decoder layer's module (under `model.layers.N.`) -> its llama.cpp tensor (under `blk.N.`)."""

LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
FUSED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
ONE_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
NOT_WEIGHTS = re.compile(r"(rotary_emb\.inv_freq|\.original_inv_freq)$")
"""Buffers transformers recomputes from the config; llama.cpp does the same from the written settings."""


def _unpair_rotation(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers rotates the two halves of each head; llama.cpp's `llama` rotates adjacent pairs. Reorder
    each head's rows (first half, second half) -> interleaved, so both compute the same attention."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _layer_tensor(name: str, tensor: torch.Tensor, found: ArchitectureFacts) -> tuple[str, torch.Tensor] | None:
    match = LAYER.match(name)
    if match is None or match.group(2) not in LAYER_NAMES:
        return None
    block, module, kind = match.groups()
    if found.arch in ROTATE_HALF_PAIRS and module in ("self_attn.q_proj", "self_attn.k_proj"):
        heads = found.heads if module == "self_attn.q_proj" else found.kv_heads
        tensor = _unpair_rotation(tensor, heads)
    return f"blk.{block}.{LAYER_NAMES[module]}.{kind}", tensor


def gguf_tensors(
    state: dict[str, torch.Tensor], config: Any, found: ArchitectureFacts
) -> Iterator[tuple[str, torch.Tensor]]:
    """(llama.cpp name, tensor) for every weight of `state`; raises naming what would be lost or misnamed."""
    left = [name for name in state if not NOT_WEIGHTS.search(name)]
    if found.tied_embeddings:
        left = [name for name in left if name != "lm_head.weight"]  # llama.cpp reuses token_embd
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    unmapped = []
    written: list[str] = []

    def emit(gguf_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        written.append(gguf_name)
        return gguf_name, tensor

    for name in left:
        tensor = state[name]
        if name in GLOBAL_NAMES:
            yield emit(GLOBAL_NAMES[name], tensor)
        elif (mapped := _layer_tensor(name, tensor, found)) is not None:
            yield emit(*mapped)
        elif (match := FUSED_EXPERTS.match(name)) is not None:
            block, kind = match.groups()
            if kind == "gate_up_proj":  # (experts, 2 x expert width, hidden): the gate's rows first
                gate, up = tensor.chunk(2, dim=1)
                yield emit(f"blk.{block}.ffn_gate_exps.weight", gate)
                yield emit(f"blk.{block}.ffn_up_exps.weight", up)
            else:
                yield emit(f"blk.{block}.ffn_down_exps.weight", tensor)
        elif (match := ONE_EXPERT.match(name)) is not None:
            block, expert, kind = match.groups()
            experts.setdefault((int(block), kind), {})[int(expert)] = tensor
        else:
            unmapped.append(name)
    for (block, kind), per_expert in sorted(experts.items()):
        if sorted(per_expert) != list(range(len(per_expert))):
            raise UserError(f"export --format gguf: layer {block} has experts {sorted(per_expert)} of {kind}")
        stacked = torch.stack([per_expert[index] for index in range(len(per_expert))])
        yield emit(f"blk.{block}.ffn_{kind.removesuffix('_proj')}_exps.weight", stacked)
    if (factors := llama3_rope_factors(config, found.rope_dim)) is not None:
        yield emit("rope_freqs.weight", factors)
    if unmapped:
        shown = ", ".join(unmapped[:8]) + (f" and {len(unmapped) - 8} more" if len(unmapped) > 8 else "")
        raise UserError(
            f"export --format gguf: {len(unmapped)} weight(s) of this {found.model_type} model have no llama.cpp "
            f"name and would be lost: {shown}"
        )
    check_names(written, found)


def check_names(names: list[str], found: ArchitectureFacts) -> None:
    """Every name one the architecture's llama.cpp loader reads, none twice, every layer present."""
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == found.arch)
    known = {gguf.TENSOR_NAMES[tensor] for tensor in gguf.MODEL_TENSORS[arch]}
    unknown = []
    for name in names:
        base = re.sub(r"^blk\.\d+\.", "blk.{bid}.", name).rsplit(".", 1)[0]
        if base not in known:
            unknown.append(name)
    if unknown:
        raise UserError(f"export --format gguf: llama.cpp's {found.arch} reads no tensor named {', '.join(unknown)}")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise UserError(f"export --format gguf: tensors written twice: {', '.join(duplicates)}")
    blocks = {int(match.group(1)) for name in names if (match := re.match(r"blk\.(\d+)\.", name))}
    if blocks != set(range(found.layers)):
        missing = sorted(set(range(found.layers)) - blocks)
        raise UserError(f"export --format gguf: no weights for layer(s) {missing}")
