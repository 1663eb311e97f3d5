"""Tokenizer and model from the `model` config section: loaded from a directory, or built fresh."""

from __future__ import annotations

import difflib

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from tuneforge.config.schema import ModelConfig
from tuneforge.data.byte_tokenizer import build_byte_tokenizer
from tuneforge.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    source = cfg.tokenizer or cfg.path
    if source == "bytes":
        tokenizer = build_byte_tokenizer()
    else:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    if tokenizer.eos_token is None:
        raise UserError(f"model.tokenizer: the tokenizer at {source} has no EOS token; set one in its config")
    if tokenizer.pad_token is None:
        # Padding positions are masked out of attention and loss, so reusing EOS is safe.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _fresh_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase):
    if cfg.architecture not in CONFIG_MAPPING:
        close = difflib.get_close_matches(cfg.architecture, list(CONFIG_MAPPING.keys()), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UserError(f"model.architecture: {cfg.architecture!r} is not a transformers model type{hint}")
    defaults = AutoConfig.for_model(cfg.architecture)
    for key in cfg.size:
        if not hasattr(defaults, key):
            close = difflib.get_close_matches(key, list(defaults.to_dict()), n=1)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            raise UserError(f"model.size.{key}: not a field of the {cfg.architecture} config{hint}")
    return AutoConfig.for_model(
        cfg.architecture,
        **{
            **cfg.size,
            "vocab_size": len(tokenizer),
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
    )


def _native_architecture(path: str) -> bool:
    """Whether `transformers` itself implements the checkpoint's architecture. Its implementation is preferred
    over the checkpoint's remote code: it is tested, and MoE blocks there run every rank's collectives alike."""
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, OSError):
        return False
    print(
        f"model: trust_remote_code was set, but transformers implements {config.model_type} natively; "
        "using the native implementation"
    )
    return True


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    """A fresh model is initialised under `seed`, so the same config gives the same weights."""
    dtype = DTYPES[cfg.dtype]
    if cfg.architecture is not None:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            _fresh_config(cfg, tokenizer), dtype=dtype, attn_implementation=cfg.attn_implementation
        )
    else:
        remote = cfg.trust_remote_code and not _native_architecture(cfg.path)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                cfg.path,
                dtype=dtype,
                attn_implementation=cfg.attn_implementation,
                trust_remote_code=remote,
            )
        except OSError as exc:
            raise UserError(f"model.path: cannot load a model from {cfg.path!r} ({exc})") from None
        except ValueError as exc:
            if "attention implementation" not in str(exc):
                raise
            raise UserError(
                f"model.attn_implementation: {cfg.attn_implementation} is not supported by this model; "
                "set model.attn_implementation=eager"
            ) from None
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        raise UserError(
            f"model.tokenizer: the tokenizer has {len(tokenizer)} tokens but the model embeds only "
            f"{model.get_input_embeddings().num_embeddings}; use the model's own tokenizer"
        )
    return model


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total
