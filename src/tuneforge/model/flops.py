"""The model FLOPs a token needs, for the step line's model FLOP/s and, on GPUs whose peak `estimate.hardware`
knows, the model FLOPs utilisation; the estimate uses the same shares."""

from __future__ import annotations

from torch import nn

from tuneforge.model.moe import MoEMap
from tuneforge.model.quantize import stored_numel


def matmul_shares(model: nn.Module, moe: MoEMap) -> dict[int, float]:
    """Share of tokens that multiply with a parameter, where it is not 1: a routed expert's parameters (and
    the adapters on them) by top_k of num_experts; the input embedding not at all (a lookup)."""
    shares: dict[int, float] = {}
    for block in moe:
        if block.top_k:
            experts = block.module.get_submodule(block.experts_name)  # adapters wrap it in place
            for param in experts.parameters():
                shares[id(param)] = min(1.0, block.top_k / block.num_experts)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embedding is not None and (head is None or head.weight is not embedding.weight):
        shares[id(embedding.weight)] = 0.0
    return shares


def active_matmul_parameters(model: nn.Module, moe: MoEMap) -> float:
    """Parameters a token multiplies with: all but the input embedding, and for MoE only the routed experts
    a token is sent to (top_k of num_experts, from the run's MoE map). Call it before an engine shards the
    model."""
    shares = matmul_shares(model, moe)
    return sum(shares.get(id(p), 1.0) * stored_numel(p) for p in model.parameters())


def forward_flops_per_token(model: nn.Module, moe: MoEMap) -> float:
    """The matmul FLOPs of a forward alone per token (2 per active parameter): what a reference model's forward
    adds to a step (the base with adapters disabled, or a frozen copy of the same shape)."""
    return 2 * active_matmul_parameters(model, moe)


def model_flops_per_token(model: nn.Module, moe: MoEMap) -> float:
    """The matmul FLOPs a training step needs per token, attention scores left out: 2 per active parameter
    forward, 2 more for the gradient of its input, and 2 more for its own gradient only where it trains. Full
    fine-tuning gives the usual 6 x N; LoRA about 4 x N, since frozen weights get no gradient. Recomputation
    under activation checkpointing is not counted (model FLOPs, not hardware FLOPs). Frozen layers below every
    trainable one need no input gradient either; they are counted with one (an upper bound, for `model.freeze`
    of the bottom layers). Call it on the trainable model, before an engine shards it."""
    shares = matmul_shares(model, moe)
    return sum(shares.get(id(p), 1.0) * stored_numel(p) * (6 if p.requires_grad else 4) for p in model.parameters())
