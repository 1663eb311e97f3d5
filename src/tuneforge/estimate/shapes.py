"""What the estimate needs from a model's shapes: parameters by kind (k-bit, frozen, trainable, routed),
what a token multiplies with, and the activations it leaves per layer."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from tuneforge.config.schema import Config
from tuneforge.model.adapters import resolve_lora_targets, stacked_experts_in_peft_form
from tuneforge.model.flops import matmul_shares
from tuneforge.model.moe import MoEBlock, MoEMap
from tuneforge.model.quantize import matches_module_name, quantized_linears
from tuneforge.model.quantized_experts import quantizable_weights
from tuneforge.model.structure import decoder_layers


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
    """Parameters a token multiplies with (routed experts by their top-k share, no input embedding)."""
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
    """Parameters outside the decoder layers (embeddings, head, final norm)."""
    act_total: float
    """Activation bytes per token per compute byte, summed over layers (no checkpointing)."""
    act_max_layer: float
    routed_trainable: int = 0
    """Trainable values of the routed experts (full fine-tuning): what expert parallelism shards."""
    moe_layers: int = 0
    top_k: int = 0
    """Experts each token is sent to, per MoE layer (the all-to-all's copies of it)."""


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


def model_shapes(cfg: Config, model: nn.Module, moe: MoEMap, compute_bytes: int) -> ModelShapes:
    share = matmul_shares(model, moe)
    quantization = cfg.model.quantization
    quantized_ids, stacked_quantized_ids = set(), set()
    if quantization is not None:
        quantized_ids = {id(module.weight) for _, module in quantized_linears(model, quantization)}
        stacked_quantized_ids = {id(p) for p in quantizable_weights(model, quantization)}
    linear_quantized_ids = set(quantized_ids)
    quantized_ids |= stacked_quantized_ids
    params = list(model.parameters())
    active = {id(p): share.get(id(p), 1.0) * p.numel() for p in params}
    routed_ids = {id(p) for _, p in _routed_parameters(model, moe)}

    lora = cfg.model.lora
    trainable_ids: set[int] = set()
    adapters: dict[str, float] = {}  # module name -> adapter parameters
    stacked: list[nn.Parameter] = []
    extra = 0
    grouped_active = 0.0
    lora_saved: dict[str, float] = {}  # module name -> saved bytes per token and compute byte
    if lora is not None:
        targets = resolve_lora_targets(model, lora, moe)
        for name in targets.modules:
            module = model.get_submodule(name)
            adapters[name] = lora.r * (module.in_features + module.out_features) + (
                module.out_features if lora.use_dora else 0
            )
        peft_form = stacked_experts_in_peft_form(model, lora, targets)
        for name in targets.parameters:
            param = model.get_parameter(name)
            low_rank = param.shape[0] * lora.r * (param.shape[1] + param.shape[2])
            extra += low_rank
            experts = name.rsplit(".", 1)[0]
            if experts not in peft_form:  # (x·A_e)·B_e: a token multiplies with its top-k experts' factors
                grouped_active += share.get(id(param), 1.0) * low_rank
                dropout = param.shape[-1] * (1 + 1 / compute_bytes) if lora.dropout > 0 else 0.0
                lora_saved[experts] = lora_saved.get(experts, 0.0) + share.get(id(param), 1.0) * param.shape[0] * (
                    dropout + lora.r
                )
            else:
                stacked.append(param)
        for name, module in model.named_modules():
            if lora.modules_to_save and matches_module_name(name, lora.modules_to_save):
                extra += sum(p.numel() for p in module.parameters())
    else:
        patterns = [re.compile(p) for p in cfg.model.freeze]
        trainable_ids = {id(p) for n, p in model.named_parameters() if not any(r.search(n) for r in patterns)}
    trainable = sum(p.numel() for p in params if id(p) in trainable_ids) + int(sum(adapters.values())) + extra
    quantized = sum(p.numel() for p in params if id(p) in quantized_ids)
    frozen = sum(p.numel() for p in params if id(p) not in quantized_ids and id(p) not in trainable_ids)

    names = {id(module): name for name, module in model.named_modules()}
    if lora is not None:  # bytes per token and compute byte: the dropped-out input and its mask, A's output
        for name in adapters:
            module = model.get_submodule(name)
            dropout = module.in_features * (1 + 1 / compute_bytes) if lora.dropout > 0 else 0.0
            lora_saved[name] = share.get(id(module.weight), 1.0) * (dropout + lora.r)
    layers = decoder_layers(model)
    per_layer = []
    layer_quantized, layer_other, in_layers = 0, 0, 0
    for layer in layers:
        values = sum(_saved_values(p, share.get(id(p), 1.0)) for p in layer.parameters())
        values += sum(lora_saved.get(names[id(m)], 0.0) for m in layer.modules())
        per_layer.append(values)
        q = sum(p.numel() for p in layer.parameters() if id(p) in quantized_ids)
        n = sum(p.numel() for p in layer.parameters())
        in_layers += n
        if n > layer_quantized + layer_other:
            layer_quantized, layer_other = q, n - q
    stacked_ids = {id(p) for p in stacked}
    return ModelShapes(
        quantized=quantized,
        frozen=frozen,
        trainable=trainable,
        adapter_active=grouped_active
        + sum(share.get(id(model.get_submodule(n).weight), 1.0) * count for n, count in adapters.items()),
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
        layers=len(layers),
        hidden=model.config.hidden_size,
        vocab=model.get_output_embeddings().weight.shape[0],
        layer_quantized=layer_quantized,
        layer_other=layer_other,
        outside_layers=sum(p.numel() for p in params) - in_layers,
        act_total=sum(per_layer),
        act_max_layer=max(per_layer),
        routed_trainable=sum(p.numel() for p in params if id(p) in routed_ids and id(p) in trainable_ids),
        moe_layers=len(list(moe)),
        top_k=int(moe.top_k or 0),
    )


def count_label(values: float) -> str:
    """A parameter count as the estimate prints it: billions from 0.1B up, else millions."""
    return f"{values / 1e9:.2f}B" if values >= 1e8 else f"{values / 1e6:.1f}M"
