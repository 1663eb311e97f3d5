"""Expert parallelism through DeepSpeed's AutoEP: each MoE layer's routed experts sharded over groups of
`parallel.expert_parallel` ranks, tokens sent to their experts' ranks by all-to-all. What qualifies is decided
from the model's config before it loads; checkpoints are written back in the Hugging Face layout (the experts
gathered from the group, AutoEP's names mapped to the model's own), so `from_pretrained` reads them."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from tuneforge.config.schema import Config

PRESETS = {
    "deepseek_v2": "n_routed_experts",
    "deepseek_v3": "n_routed_experts",
    "qwen3_moe": "num_experts",
    "qwen2_moe": "num_experts",
    "mixtral": "num_local_experts",
}
"""Model types AutoEP has a preset for that run with this transformers, and the config field of their
routed-expert count. Each is tested to convert to a model computing the original's logits and to write back its
exact weights; DeepSeek-V2 and Qwen3-MoE also train on 2 ranks as in one process."""

UNTESTED_PRESETS = {
    "qwen3_5_moe": "num_experts",
    "qwen3_5_moe_text": "num_experts",
    "minimax_m3_vl": "num_local_experts",
    "minimax_m3_vl_text": "num_local_experts",
}
"""Model types of the vision-language models AutoEP has presets for (their composite configs and their text
parts), which tuneforge does not train under expert parallelism."""

LAYER_CLASS = "AutoEPMoELayer"


def expert_parallel_problems(cfg: Config, model_config: Any, world_size: int) -> tuple[list[str], str]:
    """What refuses `parallel.expert_parallel` for this model and launch, one line each with the fix, and the
    layout line the run prints when nothing does."""
    size = cfg.parallel.expert_parallel
    if size == 1:
        return [], ""
    model_type = getattr(model_config, "model_type", "?")
    problems = []
    if model_type in UNTESTED_PRESETS:
        problems.append(
            f"parallel.expert_parallel: DeepSpeed's AutoEP preset for {model_type} is for its vision-language "
            "form, which tuneforge does not train with it; set parallel.expert_parallel=1"
        )
    elif model_type not in PRESETS:
        problems.append(
            f"parallel.expert_parallel: DeepSpeed's AutoEP has no preset for {model_type} models (it has "
            f"{', '.join(sorted(PRESETS))}); set parallel.expert_parallel=1"
        )
    experts = getattr(model_config, {**PRESETS, **UNTESTED_PRESETS}.get(model_type, "n_routed_experts"), None)
    if isinstance(experts, int) and experts % size:
        problems.append(f"parallel.expert_parallel={size} does not divide the model's {experts} routed experts")
    if world_size % size:
        problems.append(f"parallel.expert_parallel={size} does not divide the {world_size} processes launched")
    if cfg.model.lora is not None:
        problems.append(
            "parallel.expert_parallel: LoRA under expert parallelism is not supported (AutoEP rebuilds the expert "
            "weights, which would drop adapters on them, and DeepSpeed cannot checkpoint frozen expert partitions); "
            "train all weights, or keep LoRA without it: parallel.engine=ddp with a 4-bit base, or ZeRO-3"
        )
    if problems or not isinstance(experts, int):
        return problems, ""
    return [], f"experts: {experts} per layer over {size} ranks, {experts // size} each (DeepSpeed AutoEP)"


def autoep_section(size: int, model_type: str) -> dict[str, Any]:
    """DeepSpeed's `expert_parallel` config section."""
    # Qwen2-MoE runs on the Qwen3-MoE preset, which lists both model types.
    preset = "qwen3_moe" if model_type == "qwen2_moe" else model_type
    return {"enabled": True, "autoep_size": size, "preset_model": preset}


def without_router_logit_recorders(model: nn.Module) -> bool:
    """Leaves transformers' recording of router logits out of what AutoEP converts; True when the model's
    `output_router_logits` had to be turned off for it.

    Mixtral's and the Qwen MoE models' classes declare a `router_logits` output recorder. DeepSpeed 0.19's AutoEP
    retargets it to its own router through transformers' recorder registry, calling `registry.get(key, default)`,
    and transformers 5.2x's registry `get` takes one argument: `deepspeed.initialize` fails with a TypeError.
    tuneforge never reads those logits (its router balance loss hooks AutoEP's routers), so each instance's
    `_can_record_outputs` is given without `router_logits` (transformers itself reads the registry it built when
    the model was made, not the instance attribute): AutoEP then finds nothing to retarget. With nothing
    recording them, a forward asking for router logits would have none: `output_router_logits` is turned off."""
    for module in model.modules():
        recorded = getattr(module, "_can_record_outputs", None)
        if isinstance(recorded, dict) and "router_logits" in recorded:
            module._can_record_outputs = {key: value for key, value in recorded.items() if key != "router_logits"}
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        config.output_router_logits = False
        return True
    return False


def hugging_face_state_dict(
    model: nn.Module, group: Any, is_main: bool, names: Collection[str]
) -> dict[str, torch.Tensor] | None:
    """The model's weights under its own (Hugging Face) `names`, taken before AutoEP replaced its layers: each
    AutoEP layer's local experts gathered from the expert-parallel `group` to rank 0 one layer at a time, moved
    to host memory and stacked as the model stores them (`gate_up_proj` = gate then up projections,
    `down_proj`), the router's tensors under the gate's names. A collective of rank 0's group only (the other
    groups hold copies of the same experts and return at once); rank 0 gets the weights, the others None."""
    if 0 not in torch.distributed.get_process_group_ranks(group):
        return None
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    layers = [(name, module) for name, module in model.named_modules() if type(module).__name__ == LAYER_CLASS]
    for prefix, layer in layers:
        gathered = {part: _gather_to_main(state.pop(f"{prefix}.experts.{part}"), group, is_main) for part in WEIGHTS}
        for alias in [name for name, child in layer._modules.items() if child is layer.router and name != "router"]:
            # AutoEP also registers its router under the gate's name: the same tensors a second time.
            for name in [key for key in state if key.startswith(f"{prefix}.{alias}.")]:
                del state[name]
        for name in [key for key in state if key.startswith(f"{prefix}.router.")]:
            tensor = state.pop(name)
            state[_router_name(prefix, name.removeprefix(f"{prefix}.router."), names)] = tensor
        for name in [key for key in state if key.startswith(f"{prefix}.shared_experts") and key not in names]:
            # AutoEP's shared experts (and their gate) are Qwen2-MoE's `shared_expert` (and `shared_expert_gate`).
            state[name.replace(f"{prefix}.shared_experts", f"{prefix}.shared_expert", 1)] = state.pop(name)
        if is_main:
            state[f"{prefix}.experts.gate_up_proj"] = torch.cat([gathered["w1"], gathered["w3"]], dim=1)
            state[f"{prefix}.experts.down_proj"] = gathered["w2"]
    if not is_main:
        return None
    if state.keys() != set(names):
        raise RuntimeError(
            "expert parallelism: the gathered checkpoint's names differ from the model's: extra "
            f"{sorted(state.keys() - set(names))[:4]}, missing {sorted(set(names) - state.keys())[:4]}"
        )
    return state


WEIGHTS = ("w1", "w2", "w3")
"""AutoEP's per-expert weights: the gate, down and up projections."""


def _gather_to_main(local: torch.Tensor, group: Any, is_main: bool) -> torch.Tensor | None:
    # `gather`, not `all_gather`: only the writing rank holds the whole layer, and only for a moment.
    local = local.contiguous()
    pieces = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))] if is_main else None
    torch.distributed.gather(local, pieces, dst=0, group=group)
    return torch.cat(pieces).cpu() if pieces is not None else None


def _router_name(prefix: str, name: str, names: Collection[str]) -> str:
    # AutoEP keeps the router's linear layer as `router.gate` and the score correction bias (DeepSeek-V3) on
    # the router itself; the model keeps both on its gate module.
    for candidate in (f"{prefix}.{name}", f"{prefix}.gate.{name}"):
        if candidate in names:
            return candidate
    raise RuntimeError(f"expert parallelism: AutoEP's {prefix}.router.{name} has no counterpart in the model")


def expert_parallel_routers(model: nn.Module) -> list[nn.Module]:
    """The router gates (the linear layers giving the routing logits) of AutoEP's layers, in model order."""
    return [module.router.gate for module in model.modules() if type(module).__name__ == LAYER_CLASS]
