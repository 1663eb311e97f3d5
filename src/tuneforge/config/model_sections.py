"""`model:`: what to fine-tune, its quantization and its adapters."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tuneforge.config.section import Section


class LoraSettings(Section):
    """LoRA adapters through PEFT; the base weights stay frozen."""

    r: int = Field(16, ge=1)
    """Rank of each adapter."""

    alpha: float = Field(32.0, gt=0)
    """Scale numerator: updates are scaled by alpha / r (alpha / sqrt(r) with `use_rslora`)."""

    dropout: float = Field(0.05, ge=0, lt=1)
    """Dropout on the adapter input."""

    targets: str | list[str] = "all-linear"
    """Where adapters go: `all-linear` (every linear layer except the output head and MoE routers), a list of
    module names (`q_proj` matches every module whose path ends with it), or a regex matched against whole
    module paths."""

    experts: bool = False
    """Also put adapters on the routed experts of MoE models (module lists and stacked expert parameters).
    Off by default: thousands of expert adapters are slow and rarely needed."""

    grouped_experts: bool = True
    """Compute adapters on stacked routed experts as grouped low-rank products, (x·A_e)·B_e, which never builds
    a full-size W + B·A per expert and also applies `dropout`. False: PEFT's own W + B·A on every pass (no
    dropout there). The saved adapter is the same either way."""

    modules_to_save: list[str] = Field(default_factory=list)
    """Modules trained in full and saved with the adapter (for example `lm_head` after adding tokens)."""

    use_dora: bool = False
    """Weight-decomposed LoRA (DoRA)."""

    use_rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r)."""


class QuantizationConfig(Section):
    """Frozen base weights stored in k-bit through bitsandbytes (QLoRA); needs `model.lora`."""

    bits: Literal[4, 8] = 4
    """4-bit (QLoRA) or 8-bit (LLM.int8) base weights."""

    quant_type: Literal["nf4", "fp4"] = "nf4"
    """4-bit data type."""

    double_quant: bool = True
    """Quantize the quantization constants too (about 0.4 bits per parameter saved)."""

    compute_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype the 4-bit weights are dequantized to for each matmul."""

    storage_dtype: Literal["auto", "uint8", "bfloat16", "float16", "float32"] = "auto"
    """Dtype the packed 4-bit data is stored in. `auto`: the compute dtype under DeepSpeed ZeRO-3 and FSDP
    (they can only shard floating-point parameters), else uint8."""

    stage_experts: Literal["auto", "device", "host"] = "auto"
    """Where a 4-bit model with stacked routed experts loads before tuneforge quantizes them (GPU runs):
    `device` loads it onto the GPU, which holds the experts in the load dtype for a moment; `host` loads it
    into host RAM (a copy per rank) and quantizes one expert stack at a time on the GPU; `auto` takes `device`
    where that fits 90% of the GPU's free memory, else `host`."""

    skip_modules: list[str] = Field(default_factory=list)
    """Modules kept in full precision besides the output head, matched as `transformers` matches them: a name
    suffix (`experts`), a path prefix up to a module boundary (`model.layers.1`) or a regular expression
    (`model.layers.*.mlp.experts`). With 4 bits, the stacked routed experts are quantized too unless their
    module is named here."""

    @field_validator("skip_modules")
    @classmethod
    def _skip_patterns(cls, value: list[str]) -> list[str]:
        for pattern in value:
            try:
                re.compile(f"(?:{pattern})")  # transformers embeds each pattern in a group
            except re.error as exc:
                raise ValueError(
                    f"{pattern!r} is not a valid regular expression ({exc}); escape special characters with \\"
                ) from None
        return value


class ModelConfig(Section):
    path: str | None = None
    """A local Hugging Face model directory (or hub id) to fine-tune. Exclusive with `architecture`."""

    architecture: str | None = None
    """Build a fresh, randomly initialised model of this `transformers` model type
    (for example `llama`, `qwen2`, `mixtral`, `deepseek_v2`) instead of loading weights."""

    size: dict[str, Any] = Field(default_factory=dict)
    """Config fields of the fresh model (for example `hidden_size`, `num_hidden_layers`);
    only with `architecture`. `vocab_size` is taken from the tokenizer."""

    tokenizer: str | None = None
    """Tokenizer directory, or `bytes` for the built-in byte-level tokenizer (no download).
    Defaults to `path`."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the weights are held in. Mixed precision compute is `train.precision`."""

    trust_remote_code: bool = False
    """Allow model code from the checkpoint directory (only for architectures `transformers` lacks)."""

    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel passed to `transformers`."""

    lora: LoraSettings | None = None
    """Train LoRA adapters instead of all weights (None: full fine-tuning)."""

    quantization: QuantizationConfig | None = None
    """Load the frozen base weights quantized (QLoRA with 4 bits); needs `lora`."""

    freeze: list[str] = Field(default_factory=list)
    """Full fine-tuning only: parameters whose name matches any of these regexes (searched anywhere in the
    name, for example `embed_tokens` or `layers\\.[0-7]\\.`) are not trained."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None) == (self.architecture is None):
            raise ValueError("set exactly one of `model.path` (load weights) or `model.architecture` (fresh model)")
        if self.size and self.architecture is None:
            raise ValueError("`model.size` only applies with `model.architecture`")
        if self.architecture is not None and self.tokenizer is None:
            raise ValueError("a fresh model needs `model.tokenizer` (a directory, or `bytes`)")
        if self.quantization is not None and self.lora is None:
            raise ValueError("quantized weights cannot be trained: add a `model.lora` section (QLoRA)")
        if self.freeze and self.lora is not None:
            raise ValueError("`model.freeze` is for full fine-tuning; with `model.lora` only adapters train")
        for pattern in self.freeze:
            try:
                re.compile(f"(?:{pattern})")  # transformers embeds each pattern in a group
            except re.error as exc:
                raise ValueError(f"`model.freeze`: {pattern!r} is not a regex ({exc})") from None
        return self
