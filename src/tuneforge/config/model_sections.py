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


class VisionSettings(Section):
    """Vision-language models: which of their three parts train (the vision tower, the projector that maps its
    features into the language model, the language model), and how. Applies to any model
    `AutoModelForImageTextToText` loads; the defaults hold when the section is absent."""

    tower: Literal["frozen", "full", "lora"] = "frozen"
    """The vision tower (image encoder): frozen, trained in full, or LoRA adapters (`tower_lora`)."""

    projector: Literal["frozen", "full"] = "full"
    """The projector between the tower and the language model."""

    language: Literal["train", "frozen"] = "train"
    """The language model: `train` trains it as a text model would be (in full, or through `model.lora`);
    `frozen` leaves it as it is (projector pretraining, xtuner's stage 1)."""

    tower_lora: LoraSettings | None = None
    """Adapters of the tower when `tower: lora`; by default `model.lora`'s settings, or LoRA's defaults."""

    tower_lr: float | None = Field(None, gt=0)
    """Learning rate of the tower's trained weights (None: `train.lr`)."""

    projector_lr: float | None = Field(None, gt=0)
    """Learning rate of the projector (None: `train.lr`)."""

    tower_path: str | None = None
    """Build a LLaVA-architecture model from two checkpoints, xtuner's way of starting projector pretraining:
    `model.path` is then a causal language model and this a CLIP or SigLIP vision model; the projector starts
    fresh (or from `projector_weights`). None: `model.path` is a whole vision-language model."""

    projector_weights: str | None = None
    """A pretrained projector to start from: a `.safetensors` file, or an xtuner stage-1 `.pth` (read as tensors
    only, never run). Relative paths resolve against the config file's directory."""

    @model_validator(mode="after")
    def _consistent(self) -> VisionSettings:
        if self.tower_lora is not None and self.tower != "lora":
            raise ValueError("`model.vision.tower_lora` applies only with `model.vision.tower: lora`")
        if self.tower_lr is not None and self.tower == "frozen":
            raise ValueError("`model.vision.tower_lr` is set but the tower is frozen (`model.vision.tower`)")
        if self.projector_lr is not None and self.projector == "frozen":
            raise ValueError("`model.vision.projector_lr` is set but the projector is frozen")
        if self.tower == "frozen" and self.projector == "frozen" and self.language == "frozen":
            raise ValueError("`model.vision`: the tower, the projector and the language model are all frozen")
        return self


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

    vision: VisionSettings | None = None
    """Vision-language models only: what trains of the tower, the projector and the language model (None: the
    defaults, a frozen tower and a trained projector and language model)."""

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
        if self.vision is not None and self.vision.language == "frozen" and self.lora is not None:
            raise ValueError(
                "`model.lora` trains the language model, which `model.vision.language: frozen` keeps frozen; "
                "remove one of them"
            )
        if self.freeze and self.lora is not None:
            raise ValueError("`model.freeze` is for full fine-tuning; with `model.lora` only adapters train")
        for pattern in self.freeze:
            try:
                re.compile(f"(?:{pattern})")  # transformers embeds each pattern in a group
            except re.error as exc:
                raise ValueError(f"`model.freeze`: {pattern!r} is not a regex ({exc})") from None
        return self
