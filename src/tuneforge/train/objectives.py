"""The run's training objective, built once from its engine (the seam `accumulate_gradients` calls)."""

from __future__ import annotations

from tuneforge.engines import Engine
from tuneforge.model.router_balance import RouterBalance
from tuneforge.objective import CrossEntropy, Objective, TokenForward


def build_objective(engine: Engine, precision: str, balance: RouterBalance | None = None) -> Objective:
    """The objective over `engine`'s model: its forward (output layer fused with the loss where the engine leaves
    it whole), and the router balance loss of MoE models when `balance` is given."""
    forward = TokenForward(engine.model, engine.unwrapped, precision, engine.traits.fuses_output_layer)
    return CrossEntropy(forward, balance, engine.sum_tensor_across_ranks)
