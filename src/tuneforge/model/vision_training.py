"""What trains of a vision-language model (`model.vision`): its tower, projector and language model each frozen,
trained in full or through LoRA adapters, and the learning rate of each part.

With adapters (`model.lora` on the language model, `tower: lora`), one PEFT adapter holds them all: the
tower's rank and alpha differ through PEFT's per-module patterns, and the parts trained in full (a projector,
a tower) train and save whole beside the adapters (`modules_to_save`), so the saved adapter loads with
`PeftModel.from_pretrained` alone. Without adapters, each part's parameters are frozen or not.
"""

from __future__ import annotations

import re

from torch import nn

from tuneforge.config.schema import LoraSettings, ModelConfig, VisionSettings
from tuneforge.errors import UserError
from tuneforge.model.adapters import MoreAdapters, apply_lora, freeze_parameters, resolve_lora_targets
from tuneforge.model.moe import MoEMap
from tuneforge.model.vision import LANGUAGE, PROJECTOR, TOWER, VisionParts


def settings_of(cfg: ModelConfig) -> VisionSettings:
    return cfg.vision if cfg.vision is not None else VisionSettings()


def make_vision_trainable(model: nn.Module, cfg: ModelConfig, moe: MoEMap, parts: VisionParts) -> tuple[nn.Module, str]:
    """`model` with what `model.vision` and `model.lora` train, and a line saying it."""
    vision = settings_of(cfg)
    if vision.tower == "lora" and cfg.lora is None:
        raise UserError(
            "model.vision.tower: lora puts adapters on the tower beside the language model's (`model.lora`); add "
            "a model.lora section, or train the tower in full (tower: full)"
        )
    if cfg.lora is None:
        return model, _freeze_parts(model, cfg, vision, parts)
    return _with_adapters(model, cfg.lora, vision, moe, parts)


def _freeze_parts(model: nn.Module, cfg: ModelConfig, vision: VisionSettings, parts: VisionParts) -> str:
    trains = {
        TOWER: vision.tower == "full",
        PROJECTOR: vision.projector == "full",
        LANGUAGE: vision.language == "train",
    }
    for name, param in model.named_parameters():
        param.requires_grad_(trains.get(parts.part_of(name) or LANGUAGE, False))
    note = freeze_parameters(model, cfg.freeze) if cfg.freeze else ""
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError("model.vision and model.freeze leave nothing to train")
    return f"vision: {_describe(vision)}" + (f"; {note}" if note else "")


def _with_adapters(
    model: nn.Module, lora: LoraSettings, vision: VisionSettings, moe: MoEMap, parts: VisionParts
) -> tuple[nn.Module, str]:
    def in_part(part: str):
        return lambda name: parts.part_of(name) == part

    more = MoreAdapters(in_part(LANGUAGE), " (its language model)")
    if vision.tower == "lora":
        tower_lora = vision.tower_lora or lora
        tower = resolve_lora_targets(model, tower_lora, MoEMap(), in_part(TOWER), " (its vision tower)")
        more.modules.extend(tower.modules)
        for name in tower.modules:  # PEFT's per-module patterns: matched at the end of a module's path
            more.ranks[re.escape(name)] = tower_lora.r
            more.alphas[re.escape(name)] = tower_lora.alpha
    if vision.projector == "full":
        more.saved.append(parts.projector)
    if vision.tower == "full":
        more.saved.append(parts.tower)
    peft_model, note = apply_lora(model, lora, moe, more)
    tower_note = (
        f"; tower adapters r={(vision.tower_lora or lora).r} on {len(more.modules)} modules" if more.modules else ""
    )
    return peft_model, f"vision: {_describe(vision)}; language model {note}{tower_note}"


def _describe(vision: VisionSettings) -> str:
    language = "trained" if vision.language == "train" else "frozen"
    return f"tower {vision.tower}, projector {vision.projector}, language model {language}"


def part_learning_rates(model: nn.Module, vision: VisionSettings, lr: float) -> dict[int, float]:
    """Each trainable parameter (by id) whose part has its own learning rate, with that rate's multiple of
    `lr`."""
    parts = VisionParts.of(model)
    if parts is None:
        return {}
    own = {TOWER: vision.tower_lr, PROJECTOR: vision.projector_lr}
    scales = {}
    for name, param in model.named_parameters():
        rate = own.get(parts.part_of(name) or LANGUAGE)
        if param.requires_grad and rate is not None:
            scales[id(param)] = rate / lr
    return scales
