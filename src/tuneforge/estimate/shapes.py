"""What the estimate needs from a model's shapes: parameters by kind (k-bit, frozen, trainable, routed),
what a token multiplies with, and the activations it leaves per layer. A vision-language model's language model
is read as a text model would be; its tower and projector, which multiply with image patches and tokens rather
than with each token of the row, are read apart (`VisionShapes`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from torch import nn

from tuneforge.config.schema import Config, LoraSettings, VisionSettings
from tuneforge.errors import UserError
from tuneforge.estimate.vision import VisionShapes, image_shape, images_per_row
from tuneforge.model.adapters import resolve_lora_targets, stacked_experts_in_peft_form
from tuneforge.model.flops import matmul_shares
from tuneforge.model.moe import MoEBlock, MoEMap
from tuneforge.model.quantize import matches_module_name, quantized_linears
from tuneforge.model.quantized_experts import quantizable_weights
from tuneforge.model.structure import decoder_layers
from tuneforge.model.vision import LANGUAGE, PROJECTOR, TOWER, VisionParts


@dataclass(frozen=True)
class ModelShapes:
    quantized: int
    """Weights stored in k bits."""
    frozen: int
    """Other parameters that do not train (the whole base under LoRA)."""
    trainable: int
    adapter_active: float
    """Adapter parameters a token multiplies with (module adapters, and expert adapters in grouped form)."""
    stacked_adapted: int
    """Values of stacked expert weights whose adapters run in PEFT's form: W + B@A formed in full every pass
    (0 where they run as grouped low-rank products)."""
    stacked_layers: int
    active: float
    """Parameters a token multiplies with (routed experts by their top-k share, no input embedding; a
    vision-language model's tower and projector are in `vision`)."""
    active_quantized: float
    active_routed: float
    stacked_quantized: int
    """Values of 4-bit stacked expert weights: each pass dequantizes all of them, whatever the tokens."""
    stacked_quantized_largest: int
    """Values of the largest of them: dequantized one at a time, so this much is held in full for a moment."""
    active_trainable: float
    layers: int
    hidden: int
    vocab: int
    layer_quantized: int
    """Quantized values of the largest decoder layer (what is gathered at once)."""
    layer_other: int
    outside_layers: int
    """Parameters outside the decoder layers (embeddings, head, final norm; a vision tower and projector)."""
    act_total: float
    """Activation bytes per token per compute byte, summed over layers (no checkpointing)."""
    act_max_layer: float
    routed_trainable: int = 0
    """Trainable values of the routed experts (full fine-tuning): what expert parallelism shards."""
    moe_layers: int = 0
    top_k: int = 0
    kv_per_token: int = 0
    """Values a generated token's keys and values take in the KV cache, all layers (online RL's rollouts)."""
    """Experts each token is sent to, per MoE layer (the all-to-all's copies of it)."""
    vision: VisionShapes | None = None
    """A vision-language model's tower, projector and images; None for a text model."""


def _routed_parameters(model: nn.Module, moe: MoEMap) -> Iterator[tuple[MoEBlock, nn.Parameter]]:
    for block in moe:
        for name, _ in block.expert_shapes:
            yield block, model.get_parameter(f"{block.experts_path}.{name}")


def _saved_values(param: nn.Parameter, activity: float) -> float:
    """Activation values a token leaves for backward around one weight: a matmul's input and output (the
    output feeds the next op, which keeps it); a norm's input. For a GPT layer this gives the 34 x hidden
    bytes per token of Korthikanti et al. (2022) without attention's s x s term (SDPA/flash keep none)."""
    if param.ndim == 3:  # stacked experts x d1 x d2: each routed copy of the token
        return activity * param.shape[0] * (param.shape[1] + param.shape[2])
    if param.ndim == 2:
        return activity * (param.shape[0] + param.shape[1])
    return param.numel()


@dataclass
class AdapterShapes:
    """What LoRA adds: adapter parameters per targeted module, the rest of the trained values (stacked experts'
    factors, `modules_to_save`), what a token multiplies with in grouped form, and the activation values each
    adapted module saves per token and compute byte."""

    per_module: dict[str, float]
    extra: int = 0
    grouped_active: float = 0.0
    saved: dict[str, float] = field(default_factory=dict)
    peft_form: list[nn.Parameter] = field(default_factory=list)
    """Stacked expert weights whose adapters run in PEFT's W + B@A form."""


def adapter_shapes(
    model: nn.Module,
    lora: LoraSettings | None,
    moe: MoEMap,
    share: dict[int, float],
    compute_bytes: int,
    within: Callable[[str], bool] | None = None,
    where: str = "",
    saved_whole: bool = True,
) -> AdapterShapes:
    """`within`: only modules whose path it accepts (a vision-language model's part, named by `where`), as
    training resolves the targets. `saved_whole`: count `lora.modules_to_save` (trained whole beside the
    adapters) here; a tower's adapters leave them to the language model's."""
    if lora is None:
        return AdapterShapes({})
    targets = resolve_lora_targets(model, lora, moe, within, where)
    per_module: dict[str, float] = {}
    saved: dict[str, float] = {}
    for name in targets.modules:
        module = model.get_submodule(name)
        per_module[name] = lora.r * (module.in_features + module.out_features) + (
            module.out_features if lora.use_dora else 0
        )
        dropout = module.in_features * (1 + 1 / compute_bytes) if lora.dropout > 0 else 0.0
        saved[name] = share.get(id(module.weight), 1.0) * (dropout + lora.r)  # the dropped input, its mask, A's out
    shapes = AdapterShapes(per_module, saved=saved)
    peft_form = stacked_experts_in_peft_form(model, lora, targets)
    for name in targets.parameters:
        param = model.get_parameter(name)
        low_rank = param.shape[0] * lora.r * (param.shape[1] + param.shape[2])
        shapes.extra += low_rank
        experts = name.rsplit(".", 1)[0]
        if experts in peft_form:
            shapes.peft_form.append(param)
            continue
        # (x·A_e)·B_e: a token multiplies with its top-k experts' factors.
        shapes.grouped_active += share.get(id(param), 1.0) * low_rank
        dropout = param.shape[-1] * (1 + 1 / compute_bytes) if lora.dropout > 0 else 0.0
        saved[experts] = saved.get(experts, 0.0) + share.get(id(param), 1.0) * param.shape[0] * (dropout + lora.r)
    for name, module in model.named_modules():
        if saved_whole and lora.modules_to_save and matches_module_name(name, lora.modules_to_save):
            shapes.extra += sum(p.numel() for p in module.parameters())
    return shapes


@dataclass(frozen=True)
class LayerProfile:
    layers: int
    saved_per_layer: list[float]
    """Activation values per token and compute byte each decoder layer leaves for backward."""
    largest_quantized: int
    largest_other: int
    """The largest layer's quantized and other values (what a sharding engine gathers at once)."""
    in_layers: int
    """Parameters inside the decoder layers."""


def layer_profile(
    layers: list[nn.Module],
    share: dict[int, float],
    quantized_ids: set[int],
    saved: dict[str, float],
    names: dict[int, str],
) -> LayerProfile:
    per_layer = []
    largest_quantized, largest_other, in_layers = 0, 0, 0
    for layer in layers:
        values = sum(_saved_values(p, share.get(id(p), 1.0)) for p in layer.parameters())
        values += sum(saved.get(names[id(m)], 0.0) for m in layer.modules())
        per_layer.append(values)
        quantized = sum(p.numel() for p in layer.parameters() if id(p) in quantized_ids)
        total = sum(p.numel() for p in layer.parameters())
        in_layers += total
        if total > largest_quantized + largest_other:
            largest_quantized, largest_other = quantized, total - quantized
    return LayerProfile(len(layers), per_layer, largest_quantized, largest_other, in_layers)


def _trained_ids(cfg: Config, model: nn.Module, parts: VisionParts | None) -> set[int]:
    """Without adapters: the parameters that train, as training sets them (each vision-language part per
    `model.vision`, then `model.freeze`)."""
    trains = {LANGUAGE: True}
    if parts is not None:
        vision = cfg.model.vision or VisionSettings()
        trains = {
            TOWER: vision.tower == "full",
            PROJECTOR: vision.projector == "full",
            LANGUAGE: vision.language == "train",
        }
    patterns = [re.compile(p) for p in cfg.model.freeze]
    return {
        id(p)
        for n, p in model.named_parameters()
        if trains.get((parts.part_of(n) if parts is not None else None) or LANGUAGE, False)
        and not any(r.search(n) for r in patterns)
    }


def model_shapes(cfg: Config, model: nn.Module, moe: MoEMap, compute_bytes: int) -> ModelShapes:
    share = matmul_shares(model, moe)
    parts = VisionParts.of(model)
    vision_ids = set()  # the tower and projector: they multiply with patches and image tokens, counted apart
    if parts is not None:
        vision_ids = {id(p) for path in (parts.tower, parts.projector) for p in model.get_submodule(path).parameters()}
    quantization = cfg.model.quantization
    linear_quantized_ids, stacked_quantized_ids = set(), set()
    if quantization is not None:  # the language model's: QLoRA keeps the tower and projector in 16 bits
        linear_quantized_ids = {id(module.weight) for _, module in quantized_linears(model, quantization)}
        linear_quantized_ids -= vision_ids
        stacked_quantized_ids = {id(p) for p in quantizable_weights(model, quantization)} - vision_ids
    quantized_ids = linear_quantized_ids | stacked_quantized_ids
    params = list(model.parameters())
    active = {id(p): share.get(id(p), 1.0) * p.numel() for p in params if id(p) not in vision_ids}
    routed_ids = {id(p) for _, p in _routed_parameters(model, moe)}

    language, where = None, ""
    if parts is not None:
        language, where = (lambda name: parts.part_of(name) == LANGUAGE), " (its language model)"
    adapters = adapter_shapes(model, cfg.model.lora, moe, share, compute_bytes, language, where)
    trainable_ids = _trained_ids(cfg, model, parts) if cfg.model.lora is None else set()
    trainable = sum(p.numel() for p in params if id(p) in trainable_ids)
    trainable += int(sum(adapters.per_module.values())) + adapters.extra
    quantized = sum(p.numel() for p in params if id(p) in quantized_ids)
    frozen = sum(p.numel() for p in params if id(p) not in quantized_ids and id(p) not in trainable_ids)
    vision = None
    if parts is not None:
        vision = vision_shapes(cfg, model, parts, trainable_ids, compute_bytes)
        if cfg.model.lora is not None:  # what trains of the tower and projector, beside the adapters
            trainable += vision.tower_trainable + vision.projector_trainable

    names = {id(module): name for name, module in model.named_modules()}
    layers = decoder_layers(model)
    profile = layer_profile(layers, share, quantized_ids, adapters.saved, names)
    stacked = adapters.peft_form
    stacked_ids = {id(p) for p in stacked}
    module_active = sum(share.get(id(model.get_submodule(n).weight), 1.0) * c for n, c in adapters.per_module.items())
    return ModelShapes(
        quantized=quantized,
        frozen=frozen,
        trainable=trainable,
        adapter_active=adapters.grouped_active + module_active,
        stacked_adapted=sum(p.numel() for p in stacked),
        stacked_layers=sum(1 for layer in layers if any(id(p) in stacked_ids for p in layer.parameters())),
        active=sum(active.values()),
        # 4-bit stacked experts still multiply as routed experts; their dequantization is counted apart.
        active_quantized=sum(v for k, v in active.items() if k in linear_quantized_ids),
        active_routed=sum(v for k, v in active.items() if k in routed_ids and k not in linear_quantized_ids),
        stacked_quantized=sum(p.numel() for p in params if id(p) in stacked_quantized_ids),
        stacked_quantized_largest=max((p.numel() for p in params if id(p) in stacked_quantized_ids), default=0),
        active_trainable=sum(v for k, v in active.items() if k in trainable_ids)
        + sum(share.get(id(p), 1.0) * p.numel() for p in stacked),
        layers=profile.layers,
        hidden=model.config.get_text_config().hidden_size,  # a vision-language model's: its language model's
        vocab=model.get_output_embeddings().weight.shape[0],
        layer_quantized=profile.largest_quantized,
        layer_other=profile.largest_other,
        outside_layers=sum(p.numel() for p in params) - profile.in_layers,
        act_total=sum(profile.saved_per_layer),
        act_max_layer=max(profile.saved_per_layer),
        routed_trainable=sum(p.numel() for p in params if id(p) in routed_ids and id(p) in trainable_ids),
        moe_layers=len(list(moe)),
        top_k=int(moe.top_k or 0),
        vision=vision,
        kv_per_token=kv_cache_values(model.config.get_text_config()),
    )


def kv_cache_values(config) -> int:
    """Keys and values cached per token over all layers (DeepSeek's MLA as transformers caches it: each head's
    decompressed key and value)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if getattr(config, "qk_nope_head_dim", None) is not None:
        width = kv_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        width = 2 * kv_heads * head_dim
    return config.num_hidden_layers * width


def vision_shapes(
    cfg: Config, model: nn.Module, parts: VisionParts, trainable_ids: set[int], compute_bytes: int
) -> VisionShapes:
    """The tower and projector of a vision-language model, what trains of them (without adapters: the ids
    `trainable_ids` holds; with them: the parts trained whole beside the adapters, and the tower's adapters),
    and the activations a patch and an image token leave for backward."""
    settings = cfg.model.vision or VisionSettings()
    lora = cfg.model.lora
    tower_module, projector_module = model.get_submodule(parts.tower), model.get_submodule(parts.projector)
    projector = list(projector_module.parameters())
    projector_ids = {id(p) for p in projector}
    tower = [p for p in tower_module.parameters() if id(p) not in projector_ids]  # Qwen's merger sits inside
    if lora is None:
        if settings.tower == "lora":
            raise UserError(
                "model.vision.tower: lora puts adapters on the tower beside the language model's (`model.lora`); "
                "add a model.lora section, or train the tower in full (tower: full)"
            )
        tower_trainable = sum(p.numel() for p in tower if id(p) in trainable_ids)
        projector_trainable = sum(p.numel() for p in projector if id(p) in trainable_ids)
        language_ids = {id(p) for n, p in model.named_parameters() if parts.part_of(n) in (LANGUAGE, None)}
        trained = len(language_ids & trainable_ids)
        language = "frozen" if not trained else "full" if trained == len(language_ids) else "partly (model.freeze)"
    else:  # modules_to_save: a trained copy of each part beside the frozen original; Qwen's with its merger
        whole = {id(p) for p in tower_module.parameters()} if settings.tower == "full" else set()
        whole |= projector_ids if settings.projector == "full" else set()
        tower_trainable = sum(p.numel() for p in tower if id(p) in whole)
        projector_trainable = sum(p.numel() for p in projector if id(p) in whole)
        language = "lora"
    adapters = AdapterShapes({})
    if settings.tower == "lora":
        adapters = adapter_shapes(
            model,
            settings.tower_lora or lora,
            MoEMap(),
            {},
            compute_bytes,
            lambda name: parts.part_of(name) == TOWER,
            " (its vision tower)",
            saved_whole=False,
        )
        tower_trainable += int(sum(adapters.per_module.values()))
    names = {id(module): name for name, module in model.named_modules()}
    try:
        layers = decoder_layers(tower_module)
    except AssertionError:
        raise UserError(f"{type(tower_module).__name__}: the vision tower has no stack of layers to size") from None
    profile = layer_profile(list(layers), {}, set(), adapters.saved, names)
    image = image_shape(model.config, cfg.data)
    return VisionShapes(
        tower=sum(p.numel() for p in tower),
        projector=sum(p.numel() for p in projector),
        tower_mode=settings.tower,
        projector_trains=projector_trainable > 0,
        language=language,
        tower_trainable=tower_trainable,
        projector_trainable=projector_trainable,
        image=image,
        images_per_row=images_per_row(cfg.data, image),
        tower_patch_params=profile.in_layers,
        tower_token_params=sum(p.numel() for p in tower) - profile.in_layers,
        tower_adapter_active=sum(adapters.per_module.values()),
        tower_layers=profile.layers,
        tower_hidden=model.config.vision_config.hidden_size,
        tower_act_total=sum(profile.saved_per_layer),
        tower_act_max_layer=max(profile.saved_per_layer),
        projector_act=sum(_saved_values(p, 1.0) for p in projector),
    )


def frozen_copy(cfg: Config, s: ModelShapes) -> tuple[int, int]:
    """(k-bit values, other values) of DPO's frozen reference (`preference.reference: model`): the model before
    training, without adapters; (0, 0) without one."""
    if not cfg.objective.frozen_copy(cfg):
        return 0, 0
    return s.quantized, s.frozen + (s.trainable if cfg.model.lora is None else 0)


def row_tokens(cfg: Config) -> int:
    """Tokens a micro-batch's sample takes at most: a sample, a pair's two answers (which share a row), or an
    online-RL prompt's group (`rl.generations` rows of the prompt and a completion)."""
    if cfg.objective.prompted:
        return (cfg.data.max_length + cfg.rl.max_completion_tokens) * cfg.rl.generations
    return cfg.data.max_length * (2 if cfg.paired else 1)


def row_label(cfg: Config) -> str:
    if cfg.objective.prompted:
        length = cfg.data.max_length + cfg.rl.max_completion_tokens
        return f"{cfg.rl.generations} x {length} (a prompt's completions)"
    return f"{row_tokens(cfg)}" + (" (a pair's two answers)" if cfg.paired else "")


def count_label(values: float) -> str:
    """A parameter count as the estimate prints it: billions from 0.1B up, else millions."""
    return f"{values / 1e9:.2f}B" if values >= 1e8 else f"{values / 1e6:.1f}M"
