"""Adapter configs that PEFT's own loader turns back into the adapters that were trained.

When `PeftModel.from_pretrained` loads an adapter onto a model whose MoE layout changed in `transformers` 5
(DeepseekV2, Qwen2/3-MoE, Mixtral...), PEFT first rewrites the adapter's config as if it had been written for
`transformers` 4: every `target_modules` entry ending in `gate_proj`, `up_proj` or `down_proj` is taken for a
routed expert of the old layout. On models that also have dense MLPs or shared experts with those names
(DeepseekV2's first layers and shared experts), that drops their adapters from the load, adds adapters on every
routed expert with a doubled rank, and either fails on shapes or loads an adapter that computes something else.

Training never meets this (tuneforge attaches adapters by exact path, with PEFT's rewrite kept out), but users
load the saved adapter with PEFT. So the saved config names those linear layers by their weight under
`target_parameters` instead: PEFT then adapts the same weights with the same `lora_A`/`lora_B` shapes and keys,
computes the same W + s·B·A, and its rewrite finds nothing to change. The weights file is untouched.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ADAPTER_CONFIG = "adapter_config.json"


Skeleton = Callable[[], Any]
"""Builds the plain base model's structure (its modules on the meta device, no weights): what PEFT's loader
looks at when it rewrites a config (from PEFT 0.22 it reads the modules, not only the model type)."""


def plain_skeleton(model_class: Any, config: Any) -> Skeleton:
    """A `Skeleton` of `model_class` (a transformers class or auto class) built from `config`."""

    def build() -> Any:
        with torch.device("meta"):
            if hasattr(model_class, "from_config"):
                return model_class.from_config(config)
            return model_class(config)

    return build


def _as_peft_loads_it(config: dict, skeleton: Skeleton) -> object | None:
    """What PEFT's loader makes of `config` on the base `skeleton` builds; None where this PEFT has no such
    rewrite."""
    try:
        from peft import LoraConfig
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:
        return None
    known = {k: v for k, v in copy.deepcopy(config).items() if k in LoraConfig.__dataclass_fields__}
    loaded = LoraConfig(**known)
    convert_peft_config_for_transformers(loaded, skeleton(), None)
    return loaded


def rewritten_targets(config: dict, skeleton: Skeleton) -> list[str]:
    """The `target_modules` entries PEFT's loader would drop or reinterpret for this base model."""
    loaded = _as_peft_loads_it(config, skeleton)
    if loaded is None:
        return []
    kept = set(loaded.target_modules or [])
    # PEFT saves target_modules from a set: sort for a stable message and file.
    return sorted(name for name in config.get("target_modules") or [] if name not in kept)


def make_portable(directory: Path, model_type: str, skeleton: Skeleton) -> str:
    """Rewrite `directory/adapter_config.json` so that PEFT loads it as trained onto the base `skeleton` builds
    (of `model_type`); returns a line saying what was changed ('' when nothing needed to be)."""
    path = directory / ADAPTER_CONFIG
    config = json.loads(path.read_text(encoding="utf-8"))
    moved = rewritten_targets(config, skeleton)
    if moved and config.get("use_dora"):
        # PEFT has no DoRA for adapters named by weight: say so (never fail a save in the middle of training).
        return (
            f"warning: PEFT's own loader misreads the DoRA adapters on {moved[0]} and {len(moved) - 1} more layers "
            f"of this {model_type} model (it takes them for routed experts); load this adapter with tuneforge "
            "chat/export, or export --merge for a model that loads anywhere"
        )
    lines = []
    if moved:
        config["target_modules"] = [name for name in config["target_modules"] if name not in moved]
        config["target_parameters"] = [*(config.get("target_parameters") or []), *(f"{n}.weight" for n in moved)]
        lines.append(
            f"adapter_config.json: {len(moved)} linear layers named gate/up/down_proj listed by weight under "
            f"target_parameters (same weights and keys), because PEFT's loader reads such names on {model_type} "
            "models as routed experts of the transformers 4 layout"
        )
    if config.get("target_parameters") and config.get("lora_dropout"):
        # PEFT refuses input dropout on adapters named by weight; dropout only mattered in training.
        config["lora_dropout"] = 0.0
        if not moved:
            lines.append("adapter_config.json: lora_dropout 0, which PEFT's loader needs for adapters named by weight")
    if not lines:
        return ""
    assert not rewritten_targets(config, skeleton), "the portable config is still rewritten"
    path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    return "; ".join(lines)
