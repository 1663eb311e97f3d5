"""`data:`: what to train on, and the chat template that renders it."""

from __future__ import annotations

import string
from typing import Literal

from pydantic import Field, field_validator, model_validator

from tuneforge.config.section import Section


class TemplateConfig(Section):
    """A custom prompt template, with the same meaning as xtuner's PROMPT_TEMPLATE entries."""

    system: str = "{system}\n"
    """Text placed before the first user turn when there is a system prompt; `{system}` is replaced."""

    instruction: str = "{input}"
    """Text of each user turn; `{input}` is the user message, `{round}` the 1-based turn number."""

    suffix: str = ""
    """Appended to each assistant reply (trained with it)."""

    suffix_as_eos: bool = False
    """The suffix ends the reply instead of the tokenizer's EOS token."""

    sep: str = ""
    """Untrained text after each turn."""

    stop_words: list[str] = Field(default_factory=list)
    """Extra strings that end generation (the EOS token always does)."""

    @field_validator("system")
    @classmethod
    def _system_placeholders(cls, value: str) -> str:
        _check_placeholders(value, {"system"})
        return value

    @field_validator("instruction")
    @classmethod
    def _instruction_placeholders(cls, value: str) -> str:
        if "input" not in _check_placeholders(value, {"input", "round"}):
            raise ValueError(
                "has no `{input}`: every user message would be left out of the prompts; put {input} where the "
                "user's text goes"
            )
        return value


def _check_placeholders(text: str, allowed: set[str]) -> set[str]:
    """The `{name}` placeholders of a template string, refused when one is not in `allowed`."""
    names = ", ".join(f"{{{name}}}" for name in sorted(allowed))
    try:
        used = {field for _, field, _, _ in string.Formatter().parse(text) if field is not None}
    except ValueError as exc:
        raise ValueError(f"{exc}; the placeholders are {names}, and {{{{ }}}} write literal braces") from None
    unknown = sorted(used - allowed)
    if unknown:
        raise ValueError(
            f"unknown placeholder {{{unknown[0]}}}; the placeholders are {names} (write {{{{ and }}}} for literal "
            "braces)"
        )
    return used


class DataConfig(Section):
    train_files: list[str] = Field(min_length=1)
    """Training data: JSONL, JSON (an array), parquet files, or directories saved with `datasets`
    (`save_to_disk`). Relative paths are resolved against the config file's directory."""

    format: Literal["auto", "openai", "sharegpt", "alpaca"] = "auto"
    """Record format; `auto` detects it per file from the first record's keys."""

    split: str = "train"
    """Split to read from a saved `DatasetDict` directory."""

    validation_files: list[str] = Field(default_factory=list)
    """Optional validation data, in the same forms as `train_files`."""

    validation_fraction: float = Field(0.0, ge=0, lt=1)
    """Hold out this fraction of the training samples for validation instead (chosen with `split_seed`)."""

    split_seed: int = Field(0, ge=0)
    """Seed of the held-out selection; independent of `train.seed` so the split stays put across runs."""

    template: str | TemplateConfig | None = None
    """Chat template: a built-in name (deepseek_coder, deepseek_v2, llama3_chat, qwen_chat, internlm2_chat,
    mistral, mixtral, zephyr), `tokenizer` for the tokenizer's own chat_template (a vision-language model's:
    its processor's), or an inline template. None: deepseek_coder (xtuner's default) for a text model, the
    processor's chat template for a vision-language model."""

    image_root: str | None = None
    """Folder that relative image paths in the data resolve against (None: each data file's own folder).
    URLs are refused: nothing downloads during training."""

    image_max_pixels: int | None = Field(None, gt=0)
    """Largest image area (width x height) given to a vision-language model's processor; bigger images are
    scaled down (processors with a dynamic resolution, such as Qwen-VL's). None: a budget that keeps one image
    within a quarter of `max_length` tokens, or the processor's own maximum when that is smaller."""

    image_min_pixels: int | None = Field(None, gt=0)
    """Smallest image area; smaller images are scaled up (None: the processor's own minimum)."""

    image_pixel_limit: int = Field(100_000_000, gt=0)
    """An image whose header declares more pixels than this is dropped unread (a decompression bomb)."""

    system: str | None = None
    """System prompt given to conversations that have none (None: leave them without)."""

    max_length: int = Field(2048, gt=0)
    """Longest tokenized sample, and the row length when packing."""

    allow_beyond_context: bool = False
    """Allow `max_length` beyond the model's `max_position_embeddings` (extending the context on purpose,
    with RoPE scaling); otherwise such a setting is refused before the model loads."""

    truncation: Literal["drop", "truncate"] = "drop"
    """Over-length samples: `drop` them, or `truncate` to the whole leading turns that fit. Both are counted."""

    packing: bool = False
    """Pack samples into rows of `max_length` (best-fit decreasing); attention stays within each sample."""

    group_by_length: bool = True
    """Without packing, batch samples of similar length together to limit padding."""

    on_error: Literal["raise", "skip"] = "raise"
    """A malformed JSON line: stop with its location (`raise`), or drop and count it (`skip`)."""

    cache_dir: str | None = "~/.cache/tuneforge/data"
    """Tokenized data is cached here under a fingerprint of the files' content and every setting that
    affects tokenization, so a second run starts at once. None disables the cache."""

    preprocess_timeout_s: float = Field(3600.0, gt=0)
    """In a multi-process run, how long other ranks wait for rank 0 to preprocess the data."""

    @model_validator(mode="after")
    def _one_validation_source(self) -> DataConfig:
        if self.validation_files and self.validation_fraction:
            raise ValueError("set `data.validation_files` or `data.validation_fraction`, not both")
        if self.image_min_pixels and self.image_max_pixels and self.image_min_pixels > self.image_max_pixels:
            raise ValueError("`data.image_min_pixels` is above `data.image_max_pixels`")
        return self
