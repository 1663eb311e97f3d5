"""Tiny models of every architecture `export --format gguf` converts, saved as tuneforge checkpoints, and the
byte-level BPE tokenizers with merges (Llama 3's, Qwen2's and GPT-2's pre-tokenizers) trained here, offline."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from conftest import TINY_DEEPSEEK_V2, TINY_DENSE

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2026 and we'll train 1234 tokens!",
    "def add(a, b):\n    return a + b  # the sum\n\nprint(add(2, 3))",
    "Ünïcödé café naïve façade — “quoted” text… 中文分词 日本語 한국어",
    "#ff8800 is 255,136,0 and #0066ee is 0,102,238; colours in hex and decimal.",
] * 8


def bpe_tokenizer(split: str | None, vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE with merges learned from `CORPUS`; `split` the Split regex before it (None: GPT-2's
    own regex inside the ByteLevel pre-tokenizer)."""
    tokenizer = Tokenizer(models.BPE())
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|begin|>", "<|end|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|begin|>", eos_token="<|end|>", pad_token="<|pad|>"
    )


def _ids(tokenizer) -> dict:
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


SHAPES = {
    "llama": TINY_DENSE,
    "mistral": TINY_DENSE,
    "qwen2": TINY_DENSE,
    "qwen3": {**TINY_DENSE, "head_dim": 16},
    "qwen3_moe": {
        **TINY_DENSE,
        "head_dim": 8,
        "moe_intermediate_size": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    "deepseek_v2": {**TINY_DEEPSEEK_V2, "max_position_embeddings": 256},
}


def tiny_model(model_type: str, tokenizer, seed: int = 0, **changes):
    """A random tiny model whose weights are large enough that a misplaced row changes its top tokens."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**SHAPES[model_type], **_ids(tokenizer), **changes})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1 or "bias" in name:
                parameter.normal_(0.0, 0.2)
            else:
                parameter.uniform_(0.5, 1.5)  # norms
    return model.eval()


def save_checkpoint(model, tokenizer, directory: Path, template: str | dict = "deepseek_coder") -> Path:
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "tuneforge.json").write_text(json.dumps({"template": template, "system": None}))
    return directory
