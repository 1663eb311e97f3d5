"""What trains: LoRA adapters through PEFT (targets resolved here, by structure), or all weights minus
`model.freeze` patterns.

Targets are resolved to exact module paths before PEFT sees them, so the run can say precisely which
module kinds got adapters, and MoE routers, the output head and (by default) routed experts are left
out whatever naming a model uses.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from torch import nn

from tuneforge.config.schema import LoraSettings
from tuneforge.errors import UserError
from tuneforge.model.expert_lora import grouped_layers
from tuneforge.model.moe import MoEMap
from tuneforge.model.quantize import matches_module_name
from tuneforge.model.quantized_experts import plain_for_peft, quantized_experts_count


@dataclass(frozen=True)
class LoraTargets:
    modules: list[str]
    """Full paths of linear layers that get an adapter."""
    parameters: list[str]
    """Full paths of stacked expert parameters (3-D) that get an adapter."""
    skipped_experts: int
    """Expert linear layers and stacked expert tensors left out because `experts` is off."""

    def describe(self) -> str:
        kinds = Counter(name.rsplit(".", 1)[-1] for name in self.modules)
        kinds.update(".".join(name.rsplit(".", 2)[-2:]) for name in self.parameters)  # e.g. experts.down_proj
        listed = ", ".join(f"{kind} x{count}" for kind, count in sorted(kinds.items()))
        text = f"{len(self.modules) + len(self.parameters)} adapters ({listed})"
        if self.skipped_experts:
            text += f"; {self.skipped_experts} routed-expert weights left out (model.lora.experts=false)"
        return text


def _matches(name: str, targets: str | list[str]) -> bool:
    if targets == "all-linear":
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return matches_module_name(name, targets)


def resolve_lora_targets(
    model: nn.Module, settings: LoraSettings, moe: MoEMap, within: Callable[[str], bool] | None = None, where: str = ""
) -> LoraTargets:
    """Targets on the base model `model`, whose MoE map is `moe` (the run's, found before anything wrapped it);
    `within`: only modules whose path it accepts (a part of a vision-language model, named by `where`)."""
    routers = {id(router) for router in moe.routers()}
    # The output head: the LM head, or a reward model's score head (trained whole, not through adapters).
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = getattr(model, "score", None) if has_score_head(model) else head

    modules, parameters, skipped = [], [], 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is head or id(module) in routers:
            continue
        if not _matches(name, settings.targets) or (within is not None and not within(name)):
            continue
        if moe.in_experts(name) and not settings.experts:
            skipped += 1
            continue
        modules.append(name)
    for block in moe:
        if block.layout != "stacked":
            continue
        for param_name, shape in block.expert_shapes:
            full = f"{block.experts_path}.{param_name}"
            if len(shape) != 3 or "." in param_name or not _matches(full, settings.targets):
                continue
            if within is not None and not within(full):
                continue
            if settings.experts:
                parameters.append(full)
            else:
                skipped += 1
    if not modules and not parameters:
        raise UserError(
            f"model.lora.targets: {settings.targets!r} matches no linear layer of this model{where} "
            "(the output head and MoE routers are never targets); try `all-linear`"
        )
    return LoraTargets(modules, parameters, skipped)


@contextlib.contextmanager
def exact_targets(model: nn.Module) -> Iterator[None]:
    """Keep PEFT to the targets given. For models whose MoE layout changed in transformers 5 (DeepseekV2,
    Mixtral, Qwen3-MoE...), PEFT rewrites targets written for transformers 4: any module path ending in
    `down_proj`, `gate_proj` or `up_proj` (the dense MLP, the shared experts) then also puts adapters on every
    routed expert's fused weights, which is what `model.lora.experts: false` must prevent. That rewrite is keyed
    on the config's model type, so the type is shown under another name while adapters are attached or loaded;
    no code is replaced, and the config is restored at once."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        yield
        return
    shadowed = "model_type" in vars(config)
    original = config.model_type
    config.model_type = f"{original}+tuneforge"
    try:
        yield
    finally:
        if shadowed:
            config.model_type = original
        else:
            del config.model_type


def _expert_forms(
    model: nn.Module, settings: LoraSettings, targets: LoraTargets
) -> tuple[dict[type, type], dict[str, str]]:
    """The PEFT custom-layer mapping for the targeted stacked experts that run as grouped low-rank products,
    and the experts modules (by path) that keep PEFT's form, with why."""
    if not settings.grouped_experts:
        paths = sorted({name.rsplit(".", 1)[0] for name in targets.parameters})
        return {}, {path: "model.lora.grouped_experts is false" for path in paths}
    return grouped_layers(model, targets.parameters)


def stacked_experts_in_peft_form(model: nn.Module, settings: LoraSettings, targets: LoraTargets) -> dict[str, str]:
    """Experts modules (by path) whose targeted stacked weights keep PEFT's full-size W + B·A form, and why;
    the others run their adapters as grouped low-rank products."""
    return _expert_forms(model, settings, targets)[1]


def grouped_expert_layers(
    model: nn.Module, settings: LoraSettings, targets: LoraTargets
) -> tuple[dict[type, type], str]:
    """The PEFT custom-layer mapping that computes stacked-expert adapters as grouped low-rank products, and a
    note on where it does not apply. Refuses dropout where PEFT's own wrapper would have to take it."""
    if not targets.parameters:
        return {}, ""
    layers, peft_form = _expert_forms(model, settings, targets)
    quantized = [path for path in peft_form if quantized_experts_count(model.get_submodule(path))]
    if quantized:
        raise UserError(
            f"model.lora: the stacked experts of {quantized[0]} are stored in 4 bits, where PEFT's W + B·A form "
            f"({peft_form[quantized[0]]}) cannot run: it leaves its delta attached to the weight after every "
            "forward. Set model.lora.grouped_experts: true, or keep those experts in full precision with "
            f"model.quantization.skip_modules: [{quantized[0].rsplit('.', 1)[-1]}]"
        )
    if peft_form and settings.dropout:
        path, reason = next(iter(peft_form.items()))
        raise UserError(
            f"model.lora.dropout: {settings.dropout:g} cannot apply to the adapters on the stacked experts of "
            f"{path} ({reason}): PEFT's W + B·A form has no input to drop. Set model.lora.dropout: 0, or "
            "model.lora.experts: false to keep dropout on the other layers"
        )
    if peft_form:
        path, reason = next(iter(peft_form.items()))
        note = f"; stacked experts of {len(peft_form)} MoE block(s) in PEFT's full-size W + B·A form ({path}: {reason})"
    else:
        note = "; stacked experts as grouped low-rank products"
    return layers, note


@dataclass(frozen=True)
class MoreAdapters:
    """What a vision-language model adds to its language model's adapters: where those may go (`within`, named
    by `where`), adapters on more modules with their own rank and alpha (PEFT's per-module patterns), and
    modules trained whole beside them."""

    within: Callable[[str], bool]
    where: str
    modules: list[str] = field(default_factory=list)
    ranks: dict[str, int] = field(default_factory=dict)
    alphas: dict[str, float] = field(default_factory=dict)
    saved: list[str] = field(default_factory=list)


def apply_lora(
    model: nn.Module, settings: LoraSettings, moe: MoEMap, more: MoreAdapters | None = None
) -> tuple[nn.Module, str]:
    """The PEFT model with adapters on the resolved targets, and a line saying where they went."""
    from peft import LoraConfig, get_peft_model

    targets = resolve_lora_targets(model, settings, moe, more.within if more else None, more.where if more else "")
    custom_layers, grouped_note = grouped_expert_layers(model, settings, targets)
    # A reward model's new score head trains whole beside the adapters, and PEFT saves it with them.
    scored = has_score_head(model)
    modules_to_save = [*settings.modules_to_save, *(["score"] if scored else []), *(more.saved if more else [])]
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=[*targets.modules, *(more.modules if more else [])],
        target_parameters=targets.parameters or None,
        modules_to_save=modules_to_save or None,
        rank_pattern=more.ranks if more else {},
        alpha_pattern=more.alphas if more else {},
        use_dora=settings.use_dora,
        use_rslora=settings.use_rslora,
        task_type="SEQ_CLS" if scored else "CAUSAL_LM",
    )
    if custom_layers:
        config._register_custom_module(custom_layers)
    with exact_targets(model), plain_for_peft(model):
        peft_model = get_peft_model(model, config)
    return (
        peft_model,
        f"lora: r={settings.r} alpha={settings.alpha:g} dropout={settings.dropout:g}, {targets.describe()}"
        + grouped_note,
    )


def has_score_head(model: nn.Module) -> bool:
    """A reward model: transformers' sequence classification form of the network, its `score` head in place of
    the LM head."""
    return type(model).__name__.endswith("ForSequenceClassification")


def freeze_parameters(model: nn.Module, patterns: list[str]) -> str:
    """Full fine-tuning with some parameters frozen; a line saying how many matched."""
    if not patterns:
        return ""
    compiled = [re.compile(p) for p in patterns]
    frozen = 0
    for name, param in model.named_parameters():
        if any(p.search(name) for p in compiled):
            param.requires_grad_(False)
            frozen += 1
    if frozen == 0:
        raise UserError(
            f"model.freeze: {patterns} matches no parameter name; `tuneforge` names are like "
            f"{next(iter(dict(model.named_parameters())))!r}"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError(f"model.freeze: {patterns} freezes every parameter; nothing would train")
    return f"freeze: {frozen} parameter tensors frozen by model.freeze"
