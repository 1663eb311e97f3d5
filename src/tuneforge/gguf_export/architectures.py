"""Which Hugging Face models become which llama.cpp architecture, and the hyperparameters each one reads.

llama.cpp names an architecture's settings `<arch>.<key>`; `gguf.GGUFWriter` writes them under the architecture
it was opened with. A setting llama.cpp would compute differently from transformers (a rope scaling it does not
implement, routing it hard-codes) is refused here by name rather than written approximately: a GGUF that loads
but answers differently is worse than none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import gguf
import torch

from tuneforge.errors import UserError

GGUF_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "deepseek_v2": "deepseek2",
}
"""transformers `model_type` -> llama.cpp architecture."""

ROTATE_HALF_PAIRS = {"llama"}
"""Architectures whose rotary embedding in llama.cpp rotates adjacent pairs (GPT-J style) while transformers
rotates the two halves of each head: their query and key rows are reordered on the way out."""


@dataclass(frozen=True)
class ArchitectureFacts:
    model_type: str
    arch: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_dim: int
    tied_embeddings: bool


def gguf_architecture(config: Any) -> str:
    model_type = getattr(config, "model_type", None)
    if model_type not in GGUF_ARCHITECTURES:
        known = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise UserError(
            f"export --format gguf: the {model_type!r} architecture is not converted to GGUF by tuneforge "
            f"(it converts {known}); export --merge and use llama.cpp's own convert_hf_to_gguf.py"
        )
    return GGUF_ARCHITECTURES[model_type]


def rope_settings(config: Any) -> dict[str, Any]:
    """The rotary settings, as transformers 5 keeps them (`rope_parameters`) or older configs did."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if isinstance(legacy, dict):
        params = {**legacy, **params}
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10_000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def facts(config: Any) -> ArchitectureFacts:
    arch = gguf_architecture(config)
    heads = config.num_attention_heads
    if arch == "deepseek2":
        head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        rope_dim = config.qk_rope_head_dim
        kv_heads = heads  # each head's keys and values come out of the shared latent (kv_b)
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rope_dim = int(head_dim * rope_settings(config).get("partial_rotary_factor", 1.0))
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return ArchitectureFacts(
        model_type=config.model_type,
        arch=arch,
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        rope_dim=rope_dim,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


def _refuse(config: Any, field: str, value: Any, why: str) -> UserError:
    return UserError(
        f"export --format gguf: {config.model_type} with {field}={value!r} is not converted ({why}); "
        "export --merge and use llama.cpp's own converter if it supports it"
    )


def write_hyperparameters(writer: gguf.GGUFWriter, config: Any, vocab_rows: int) -> ArchitectureFacts:
    found = facts(config)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(found.layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(found.heads)
    writer.add_head_count_kv(found.kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(vocab_rows)
    writer.add_rope_dimension_count(found.rope_dim)
    if found.arch == "deepseek2":
        _deepseek2(writer, config)
    else:
        writer.add_key_length(found.head_dim)
        writer.add_value_length(found.head_dim)
    if found.arch == "qwen3moe":
        _qwen3_moe(writer, config)
    if getattr(config, "attention_bias", False) and found.arch in ("llama", "qwen3", "qwen3moe"):
        raise _refuse(config, "attention_bias", True, "llama.cpp's graph for it reads no attention biases")
    _rope(writer, config, found)
    return found


def _qwen3_moe(writer: gguf.GGUFWriter, config: Any) -> None:
    if not getattr(config, "norm_topk_prob", True):
        # llama.cpp always renormalises the chosen experts' weights for this architecture.
        raise _refuse(config, "norm_topk_prob", False, "llama.cpp renormalises the top-k routing weights")
    sparse_step = getattr(config, "decoder_sparse_step", 1)
    if sparse_step != 1 or getattr(config, "mlp_only_layers", None):
        raise _refuse(config, "decoder_sparse_step/mlp_only_layers", sparse_step, "dense layers between MoE ones")
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)


def _deepseek2(writer: gguf.GGUFWriter, config: Any) -> None:
    topk = getattr(config, "topk_method", "greedy")
    if topk != "greedy":
        raise _refuse(config, "topk_method", topk, "group-limited routing")
    scoring = getattr(config, "scoring_func", None) or "softmax"
    if scoring != "softmax":
        raise _refuse(config, "scoring_func", scoring, "only softmax routing is written")
    writer.add_key_length(config.qk_nope_head_dim + config.qk_rope_head_dim)
    writer.add_value_length(config.v_head_dim)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_q_lora_rank(config.q_lora_rank or 0)
    writer.add_kv_lora_rank(config.kv_lora_rank)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_weights_scale(float(config.routed_scaling_factor))
    writer.add_expert_weights_norm(bool(getattr(config, "norm_topk_prob", False)))
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)


def _rope(writer: gguf.GGUFWriter, config: Any, found: ArchitectureFacts) -> None:
    rope = rope_settings(config)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    kind = rope["rope_type"]
    if kind == "default":
        return
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        return
    if kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        original = rope.get("original_max_position_embeddings") or config.max_position_embeddings
        writer.add_rope_scaling_orig_ctx_len(int(original))
        if found.arch == "deepseek2":
            # llama.cpp reads DeepSeek's attention scale as 0.1 * mscale_all_dim (and divides the 0.1 back out).
            writer.add_rope_scaling_yarn_log_mul(0.1 * float(rope.get("mscale_all_dim", 0.0)))
        return
    if kind == "llama3" and found.arch == "llama":
        return  # written as the rope_freqs tensor (`llama3_rope_factors`)
    raise _refuse(config, "rope_parameters.rope_type", kind, "no matching llama.cpp rope scaling is written")


def llama3_rope_factors(config: Any, rope_dim: int) -> torch.Tensor | None:
    """Llama 3.1's frequency-dependent rotary scaling as the per-frequency divisors llama.cpp reads from
    `rope_freqs.weight`: high frequencies kept, low ones divided by `factor`, the band between interpolated."""
    rope = rope_settings(config)
    if rope["rope_type"] != "llama3":
        return None
    base, factor = float(rope["rope_theta"]), float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    original = float(rope["original_max_position_embeddings"])
    low_wavelength, high_wavelength = original / low, original / high
    divisors = []
    for index in range(0, rope_dim, 2):
        frequency = 1.0 / base ** (index / rope_dim)
        wavelength = 2 * math.pi / frequency
        if wavelength < high_wavelength:
            divisors.append(1.0)
        elif wavelength > low_wavelength:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1.0 / ((1 - smooth) / factor + smooth))
    return torch.tensor(divisors, dtype=torch.float32)
