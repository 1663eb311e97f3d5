"""Tiny real vision-language models for tests, written to a directory as a checkpoint (model, processor, tokenizer)
through `tuneforge.model.fresh_vision`, the code path of fresh VLMs in production; nothing is downloaded.

Each `tiny_<family>(directory, seed=0)` writes one and returns `directory`; `AutoModelForImageTextToText` and
`AutoProcessor` load it back. Qwen-VL and InternVL processors need torchvision (see `fresh_vision`): without it
their functions raise the UserError `processor_problem` describes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tuneforge.data.byte_tokenizer import build_byte_tokenizer
from tuneforge.model.fresh_vision import fresh_vlm

_TEXT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
"""The language model of every tiny VLM (head_dim 8)."""

_CLIP = {
    "model_type": "clip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 28,
    "patch_size": 14,
}
"""LLaVA's tower: 28 px images, 2x2 patches (+ CLS, dropped by the `default` feature strategy): 4 tokens."""

_QWEN_VISION = {"hidden_size": 32, "intermediate_size": 64, "depth": 2, "num_heads": 2, "spatial_merge_size": 2}

TINY_SIZES: dict[str, dict[str, Any]] = {
    "llava": {"text_config": {"model_type": "llama", **_TEXT}, "vision_config": _CLIP},
    "llava_next": {"text_config": {"model_type": "llama", **_TEXT}, "vision_config": _CLIP},
    "qwen2_5_vl": {
        "text_config": _TEXT,
        # 14 px patches merged 2x2: one token per 28x28 pixels; windows of 56 px, the last layer attends fully
        "vision_config": {**_QWEN_VISION, "patch_size": 14, "window_size": 56, "fullatt_block_indexes": [1]},
    },
    "qwen3_vl": {
        "text_config": {**_TEXT, "head_dim": 8},
        # 16 px patches merged 2x2: one token per 32x32 pixels; a 4x4 grid of learned positions, interpolated
        "vision_config": {**_QWEN_VISION, "patch_size": 16, "num_position_embeddings": 16},
    },
    "qwen3_vl_moe": {
        "text_config": {
            **_TEXT,
            "head_dim": 8,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
        },
        "vision_config": {**_QWEN_VISION, "patch_size": 16, "num_position_embeddings": 16},
    },
    "internvl": {
        "text_config": {"model_type": "qwen2", **_TEXT},
        # 28 px tiles of 2x2 patches, pixel-shuffled (downsample 0.5) into 1 token per tile
        "vision_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": 28,
            "patch_size": 14,
        },
    },
    "gemma3": {
        "text_config": {**_TEXT, "head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 64},
        # 56 px images, 4x4 patches average-pooled into 2x2 = 4 tokens
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": 56,
            "patch_size": 14,
        },
        "mm_tokens_per_image": 4,
    },
}
"""`model.size` of each tiny VLM (`model.architecture` is the key)."""


def tiny_vlm(model_type: str, directory: Path, seed: int = 0) -> Path:
    """The tiny `model_type` VLM with the byte tokenizer, saved to `directory`."""
    model, processor = fresh_vlm(model_type, TINY_SIZES[model_type], build_byte_tokenizer(), seed=seed)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def tiny_llava(directory: Path, seed: int = 0) -> Path:
    return tiny_vlm("llava", directory, seed)


def tiny_llava_next(directory: Path, seed: int = 0) -> Path:
    return tiny_vlm("llava_next", directory, seed)


def tiny_qwen2_5_vl(directory: Path, seed: int = 0) -> Path:
    return tiny_vlm("qwen2_5_vl", directory, seed)


def tiny_qwen3_vl(directory: Path, seed: int = 0) -> Path:
    return tiny_vlm("qwen3_vl", directory, seed)


def tiny_qwen3_vl_moe(directory: Path, seed: int = 0) -> Path:
    return tiny_vlm("qwen3_vl_moe", directory, seed)


def tiny_internvl(directory: Path, seed: int = 0) -> Path:
    return tiny_vlm("internvl", directory, seed)


def tiny_gemma3(directory: Path, seed: int = 0) -> Path:
    return tiny_vlm("gemma3", directory, seed)


TINY_VLMS = {
    "llava": tiny_llava,
    "llava_next": tiny_llava_next,
    "qwen2_5_vl": tiny_qwen2_5_vl,
    "qwen3_vl": tiny_qwen3_vl,
    "qwen3_vl_moe": tiny_qwen3_vl_moe,
    "internvl": tiny_internvl,
    "gemma3": tiny_gemma3,
}
"""Family -> the function that writes its tiny model."""
