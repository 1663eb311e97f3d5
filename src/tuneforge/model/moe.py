"""The run's MoE map: every mixture-of-experts block of the base model, found once by structure.

An MoE block is a module with a router (a child scoring tokens with one weight row per expert, reading the
same hidden width as the experts) and experts, held either as a list of identical expert modules (DeepSeek's
remote code, older Mixtral) or as stacked expert parameters (one tensor with a leading expert dimension,
`transformers` 5).

The map is built on the base model before adapters or engines wrap it, because PEFT replaces an adapted
`experts` module with a wrapper whose parameters no longer look stacked. What the map keeps stays valid when
the model is wrapped: block and router modules keep their identity under PEFT, DDP, FSDP2 and DeepSpeed, and
parameters are kept as names and shapes (sharding replaces the tensors).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from tuneforge.model.quantize import stored_numel


@dataclass(frozen=True)
class MoEBlock:
    name: str
    """Module path in the base model."""
    module: nn.Module
    num_experts: int
    layout: str
    """`list`: one module per expert; `stacked`: expert weights stacked in 3-D parameters."""
    router_name: str
    router: nn.Module
    """The child that scores experts (its weight has one row per expert)."""
    experts_name: str
    """Name of the child holding the routed experts (shared experts, if any, are not in it)."""
    expert_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    """(name under the experts child, shape) of every routed-expert parameter."""
    expert_numel: int
    """Stored values of all routed experts (k-bit weights counted by their logical size)."""
    top_k: int | None
    routing: str
    """How the router picks experts, as its attributes and the model config say."""

    @property
    def experts_path(self) -> str:
        return f"{self.name}.{self.experts_name}" if self.name else self.experts_name

    def summary(self) -> tuple:
        """Everything but the modules: equal for two maps of the same architecture, wherever they were built."""
        return (
            self.name,
            type(self.module).__name__,
            self.num_experts,
            self.layout,
            self.router_name,
            self.experts_name,
            self.expert_shapes,
            self.top_k,
            self.routing,
        )


@dataclass(frozen=True)
class MoEMap:
    blocks: tuple[MoEBlock, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[MoEBlock]:
        return iter(self.blocks)

    @property
    def block_classes(self) -> list[type]:
        return sorted({type(b.module) for b in self.blocks}, key=lambda cls: cls.__qualname__)

    @property
    def top_k(self) -> int | None:
        return self.blocks[0].top_k if self.blocks else None

    def routers(self) -> list[nn.Module]:
        return [b.router for b in self.blocks]

    def in_experts(self, module_path: str) -> bool:
        return any(module_path == b.experts_path or module_path.startswith(b.experts_path + ".") for b in self.blocks)

    def summary(self) -> tuple:
        return tuple(b.summary() for b in self.blocks)

    def describe(self) -> str:
        if not self.blocks:
            return "moe: none"
        classes = ", ".join(cls.__name__ for cls in self.block_classes)
        experts = "/".join(str(n) for n in sorted({b.num_experts for b in self.blocks}))
        layouts = " and ".join(sorted({b.layout for b in self.blocks}))
        routings = "; ".join(sorted({b.routing for b in self.blocks}))
        return f"moe: {len(self.blocks)} blocks ({classes}), {experts} routed experts each ({layouts}), {routings}"


_PARAMETRIZED = re.compile(r"parametrizations\.([^.]+)\.original$")


def code_name(name: str) -> str:
    """A parameter's name as modeling code reads it: a parametrized weight (4-bit stacked experts) is stored as
    `parametrizations.<name>.original` but read as `<name>`."""
    return _PARAMETRIZED.sub(r"\1", name)


def _own_weights(module: nn.Module) -> list[nn.Parameter]:
    """A module's own parameters, parametrized ones included."""
    params = list(module.parameters(recurse=False))
    if hasattr(module, "parametrizations"):
        params += [plist.original for plist in module.parametrizations.values()]
    return params


def _expert_count(child: nn.Module) -> tuple[int, str] | None:
    if isinstance(child, nn.ModuleList) and len(child) >= 2:
        shapes = {tuple((n, tuple(p.shape)) for n, p in expert.named_parameters()) for expert in child}
        if len({type(expert) for expert in child}) == 1 and len(shapes) == 1 and shapes != {()}:
            return len(child), "list"
        return None
    shapes = [logical_shape(p) for p in _own_weights(child)]
    stacked = {shape[0] for shape in shapes if len(shape) == 3}
    if len(stacked) == 1 and (count := stacked.pop()) >= 2:
        return count, "stacked"
    return None


def _router_width(child: nn.Module, rows: int) -> int | None:
    """The input width of a router with `rows` experts, or None when `child` is not one. Embeddings have a row
    per token id, not a scorer: a vocabulary, or a table beside a list of layers, is never a router."""
    if isinstance(child, nn.Embedding):
        return None
    weight = getattr(child, "weight", None)
    if isinstance(weight, nn.Parameter) and weight.ndim == 2 and weight.shape[0] == rows:
        return weight.shape[1]
    return None


def logical_shape(param: nn.Parameter) -> tuple[int, ...]:
    """A parameter's shape; for packed k-bit weights, the shape their quantization state records."""
    state = getattr(param, "quant_state", None)
    return tuple(state.shape) if state is not None else tuple(param.shape)


def _expert_dims(experts: nn.Module) -> set[int]:
    """The widths the experts read and write: every linear layer's features, every weight's last two sizes."""
    dims = {size for p in experts.parameters() for size in logical_shape(p)[-2:]}
    dims |= {m.in_features for m in experts.modules() if isinstance(m, nn.Linear)}
    return dims


def _routing(router: nn.Module, config: object, top_k: int | None) -> str:
    method = getattr(router, "topk_method", None) or getattr(config, "topk_method", None) or "greedy"
    picked = f"top-{top_k}" if top_k else "top-k"
    if method == "group_limited_greedy":
        groups = getattr(router, "num_group", None) or getattr(config, "n_group", None)
        kept = getattr(router, "topk_group", None) or getattr(config, "topk_group", None)
        return f"group-limited greedy {picked} ({kept} of {groups} expert groups)"
    if method == "greedy":
        return f"softmax {picked}"
    return f"{method} {picked}"


def find_moe(model: nn.Module) -> MoEMap:
    """The MoE map of a base model (plain Hugging Face model, loaded or on the meta device). Call it before
    adapters wrap the experts."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()  # a vision-language model's experts are its language model's
    top_k = getattr(config, "num_experts_per_tok", None)
    blocks = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        found = [(child, *count) for child, m in children.items() if (count := _expert_count(m)) is not None]
        if len(found) != 1:
            continue
        experts_name, count, layout = found[0]
        experts = children[experts_name]
        dims = _expert_dims(experts)
        routers = [
            child
            for child, m in children.items()
            if child != experts_name and (width := _router_width(m, count)) is not None and width in dims
        ]
        if len(routers) != 1:
            continue
        router = children[routers[0]]
        blocks.append(
            MoEBlock(
                name=name,
                module=module,
                num_experts=count,
                layout=layout,
                router_name=routers[0],
                router=router,
                experts_name=experts_name,
                expert_shapes=tuple((code_name(n), logical_shape(p)) for n, p in experts.named_parameters()),
                expert_numel=sum(stored_numel(p) for p in experts.parameters()),
                top_k=int(top_k) if top_k else None,
                routing=_routing(router, config, int(top_k) if top_k else None),
            )
        )
    return MoEMap(tuple(blocks))
