"""Vision-language models: telling one from a text model, its processor, and its three parts (the vision tower,
the projector into the language model, the language model with its output head), found by structure.

`transformers` builds every supported family as `<Family>ForConditionalGeneration` around a `<Family>Model`
holding `language_model` beside `vision_tower` and `multi_modal_projector` (LLaVA, LLaVA-NeXT, Gemma 3,
InternVL) or `visual` with the projector inside it as `merger` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL). The parts are
read from those modules, whatever the parameters inside are called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from tuneforge.config.schema import ModelConfig
from tuneforge.errors import UserError

TOWER, PROJECTOR, LANGUAGE = "tower", "projector", "language"
PARTS = (TOWER, PROJECTOR, LANGUAGE)


def is_vision_config(config: PretrainedConfig) -> bool:
    return getattr(config, "vision_config", None) is not None


def is_vision_model(cfg: ModelConfig) -> bool:
    """Whether `model` names a vision-language model, from its config alone (nothing loads)."""
    if cfg.vision is not None and cfg.vision.tower_path is not None:
        return True
    if cfg.architecture is not None:
        if cfg.architecture not in CONFIG_MAPPING:
            return False
        # Indexed: the lazy mapping's `get` does not find types it has not imported yet.
        return "vision_config" in getattr(CONFIG_MAPPING[cfg.architecture], "sub_configs", {})
    try:
        return is_vision_config(AutoConfig.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code))
    except (OSError, ValueError):
        return False  # the model's own loading says what is wrong with the path


def _first(owner: Any, *names: str) -> nn.Module | None:
    """The first of `owner`'s submodules named `names` (explicitly: a module list is false when empty)."""
    for name in names:
        module = getattr(owner, name, None)
        if isinstance(module, nn.Module):
            return module
    return None


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@dataclass(frozen=True)
class VisionParts:
    """Module paths (in `named_modules` of the model given) of each part."""

    tower: str
    projector: str
    language: list[str]
    """The language model and its output head."""

    @staticmethod
    def of(model: nn.Module) -> VisionParts | None:
        """The parts of a vision-language model (PEFT-wrapped or not); None for a text model."""
        base = _base(model)
        if not is_vision_config(getattr(base, "config", None) or PretrainedConfig()):
            return None
        inner = getattr(base, "model", None)
        tower = _first(inner, "vision_tower", "visual")
        projector = _first(inner, "multi_modal_projector") or _first(tower, "merger")
        language = base.get_decoder() if hasattr(base, "get_decoder") else None
        head = base.get_output_embeddings()
        if tower is None or projector is None or language is None:
            raise UserError(
                f"{type(base).__name__}: tuneforge cannot find its vision tower, projector and language model "
                "(expected `model.vision_tower` or `model.visual`, a projector, and a decoder)"
            )
        paths = {id(module): name for name, module in model.named_modules()}
        language_paths = [paths[id(language)]] + ([paths[id(head)]] if head is not None and id(head) in paths else [])
        return VisionParts(paths[id(tower)], paths[id(projector)], language_paths)

    def part_of(self, name: str) -> str | None:
        """The part a parameter or module path belongs to (the projector before the tower: Qwen's merger sits
        inside its tower)."""

        def inside(prefix: str) -> bool:
            return name == prefix or name.startswith(prefix + ".")

        if inside(self.projector):
            return PROJECTOR
        if inside(self.tower):
            return TOWER
        if any(inside(prefix) for prefix in self.language):
            return LANGUAGE
        return None


def build_processor(cfg: ModelConfig, tokenizer: Any, model_config: PretrainedConfig) -> Any:
    """The model's processor: the checkpoint's own (`AutoProcessor`), or for a fresh model one built for its
    family around `tokenizer`."""
    if cfg.architecture is not None:
        from tuneforge.model.fresh_vision import fresh_processor

        return fresh_processor(cfg.architecture, model_config, tokenizer)
    if cfg.vision is not None and cfg.vision.tower_path is not None:
        from tuneforge.model.compose import composed_processor

        return composed_processor(cfg.vision.tower_path, tokenizer, model_config)
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, ImportError, AttributeError) as exc:
        hint = (
            "; its processor needs torchvision: pip install torchvision (the build matching your torch)"
            if "torchvision" in str(exc).lower() or "video" in str(exc).lower()
            else "; a vision-language checkpoint needs its preprocessor_config.json and processor files"
        )
        raise UserError(f"model.path: {cfg.path} has no usable processor for its images ({exc}){hint}") from None
    if not hasattr(processor, "image_processor"):
        raise UserError(f"model.path: the processor of {cfg.path} has no image processor")
    return processor
