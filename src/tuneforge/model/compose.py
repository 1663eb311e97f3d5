"""A LLaVA-architecture model put together from a causal language model and a vision model (CLIP, SigLIP), xtuner's
way of starting projector pretraining (`model.vision.tower_path`), and a pretrained projector's weights
(`model.vision.projector_weights`).

The two checkpoints load as themselves (their own classes, their own weights); the LLaVA model is built on the
meta device and given the loaded language model, output head and vision model as its submodules, so no weight
is copied, and only the projector between them is new. Its first checkpoint is a whole `transformers` LLaVA
model that stage 2 (or any tool) loads directly.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PretrainedConfig,
)

from tuneforge.errors import UserError

IMAGE_TOKEN = "<image>"


def tower_config(tower_path: str) -> PretrainedConfig:
    """The vision model's config (a CLIP or SigLIP checkpoint holding both towers gives its vision one)."""
    config = AutoConfig.from_pretrained(tower_path)
    config = getattr(config, "vision_config", None) or config
    if "vision" not in config.model_type:
        raise UserError(
            f"model.vision.tower_path: {tower_path} is a {config.model_type} model, not a vision model (CLIP, SigLIP)"
        )
    return config


def with_image_token(tokenizer):
    """The language model's tokenizer with LLaVA's image placeholder added (a new token the model's embeddings
    grow by)."""
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    return tokenizer


def composed_config(language_path: str, tower_path: str, tokenizer, trust_remote_code: bool) -> LlavaConfig:
    text = AutoConfig.from_pretrained(language_path, trust_remote_code=trust_remote_code)
    vision = tower_config(tower_path)
    # LLaVA-1.5's choices, which xtuner's configs use: the second-to-last layer's patch features, the class
    # token left out, a two-layer GELU projector.
    return LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        image_seq_length=(vision.image_size // vision.patch_size) ** 2,
    )


def compose_llava(
    language_path: str,
    tower_path: str,
    tokenizer,
    dtype: torch.dtype,
    attn_implementation: str,
    trust_remote_code: bool,
) -> LlavaForConditionalGeneration:
    config = composed_config(language_path, tower_path, tokenizer, trust_remote_code)
    options = {"dtype": dtype, "attn_implementation": attn_implementation}
    language = AutoModelForCausalLM.from_pretrained(language_path, trust_remote_code=trust_remote_code, **options)
    tower = AutoModel.from_config(config.vision_config)  # the vision model alone, then its weights
    tower = type(tower).from_pretrained(tower_path, **options)
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    model.model.language_model = language.get_decoder()
    model.lm_head = language.get_output_embeddings()
    model.model.vision_tower = tower
    projector = type(model.model.multi_modal_projector)(config).to(options["dtype"])  # the one new part, initialised
    model.model.multi_modal_projector = projector
    model.generation_config = language.generation_config
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        model.resize_token_embeddings(len(tokenizer))
    model.config._attn_implementation = language.config._attn_implementation
    return model


def composed_processor(tower_path: str, tokenizer, config: LlavaConfig) -> LlavaProcessor:
    """LLaVA's processor around the tower's image processor and the language model's tokenizer; no chat template
    (the language model's is text-only): `data.template` names one."""
    return LlavaProcessor(
        image_processor=AutoImageProcessor.from_pretrained(tower_path),
        tokenizer=tokenizer,
        patch_size=config.vision_config.patch_size,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=1 if config.vision_config.model_type == "clip_vision_model" else 0,
    )


def load_projector(projector: nn.Module, path: str) -> str:
    """The projector's weights from `path`: a `.safetensors` file, or a PyTorch file read as tensors only (an
    xtuner stage-1 `.pth` is a pickle, never run). Matched to the projector's parameters in order, shape by
    shape, whatever the keys are called (xtuner's `model.0` / `model.2` are LLaVA's `linear_1` / `linear_2`)."""
    tensors = _read_tensors(Path(path))
    theirs = [(key, value) for key, value in tensors.items() if key.endswith((".weight", ".bias"))]
    ours = list(projector.named_parameters())
    if [tuple(v.shape) for _, v in theirs] != [tuple(p.shape) for _, p in ours]:
        raise UserError(
            f"model.vision.projector_weights: {path} holds {[(k, tuple(v.shape)) for k, v in theirs]}, the model's "
            f"projector needs {[(k, tuple(p.shape)) for k, p in ours]}"
        )
    with torch.no_grad():
        for (_, value), (_, param) in zip(theirs, ours, strict=True):
            param.copy_(value.to(param.dtype))
    return f"projector: {len(ours)} tensors from {path}"


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if path.is_dir():
        found = sorted(path.rglob("*.safetensors")) or sorted(path.rglob("*.pth")) + sorted(path.rglob("*.bin"))
        if len(found) != 1:
            raise UserError(f"model.vision.projector_weights: {path} is a directory; name the projector's file")
        path = found[0]
    try:
        if path.suffix == ".safetensors":
            tensors = load_file(str(path))
        else:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            tensors = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else None
    except Exception as exc:  # a pickle that wants to run code is refused by weights_only
        raise UserError(
            f"model.vision.projector_weights: {path} cannot be read as tensors only ({type(exc).__name__}); give "
            "a .safetensors file"
        ) from None
    if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise UserError(f"model.vision.projector_weights: {path} holds no plain table of tensors")
    # A whole-model file keeps only the projector's tensors (xtuner names them `projector.`).
    projector = {k: v for k, v in tensors.items() if "projector" in k}
    return dict(sorted((projector or tensors).items(), key=lambda item: _layer_order(item[0])))


def _layer_order(key: str) -> tuple:
    """Sort keys by their numeric parts (`model.0` before `model.2`, `linear_1` before `linear_2`), weight before
    bias."""
    parts = key.replace("_", ".").split(".")
    return (*(int(p) if p.isdigit() else 0 for p in parts[:-1]), parts[-1] != "weight")
