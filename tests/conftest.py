"""Shared fixtures: tiny real models and the local byte tokenizer; nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tuneforge.data.byte_tokenizer import build_byte_tokenizer

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tokenizer():
    return build_byte_tokenizer()


def tiny_llama(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def chat(user: str, assistant: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant, **extra}]}
