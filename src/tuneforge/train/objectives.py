"""The run's training objective, built once from its engine (the seam `accumulate_gradients` calls)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tuneforge.config.schema import PreferenceConfig
from tuneforge.engines import Engine
from tuneforge.engines.base import FrozenModel
from tuneforge.model.router_balance import RouterBalance
from tuneforge.objective import CrossEntropy, Objective, TokenForward
from tuneforge.objective.preference import (
    DirectPreference,
    OddsRatioPreference,
    disabled_adapters_reference,
    frozen_model_reference,
    precomputed_reference,
)
from tuneforge.objective.reward import RewardRanking


def build_objective(
    engine: Engine,
    precision: str,
    balance: RouterBalance | None = None,
    objective: str = "sft",
    preference: PreferenceConfig | None = None,
    precompute: Callable[[TokenForward], torch.Tensor] | None = None,
    reference_model: FrozenModel | None = None,
) -> Objective:
    """`objective` (`train.objective`) over `engine`'s model: its forward (output layer fused with the loss where
    the engine leaves it whole), and the router balance loss of MoE models when `balance` is given, applied to
    the policy's forward only. DPO's reference: the base with the adapters disabled; with `precompute` the
    table of every answer's log-probability it computes with the model before training; with `reference_model`
    a frozen copy of the model before training (`Engine.frozen`)."""
    device = engine.info.device
    forward = TokenForward(engine.model, engine.unwrapped, precision, engine.traits.fuses_output_layer, device)
    settings = preference or PreferenceConfig()
    if objective == "sft":
        return CrossEntropy(forward, balance, engine.sum_tensor_across_ranks)
    if objective == "orpo":
        return OddsRatioPreference(forward, settings.orpo_lambda, balance, engine.sum_tensor_across_ranks)
    if objective == "dpo":
        if precompute is not None:
            reference = precomputed_reference(precompute(forward), forward.device)
        elif reference_model is not None:
            frozen = TokenForward(
                reference_model.module, reference_model.plain, precision, reference_model.fuses_output_layer, device
            )
            reference = frozen_model_reference(frozen, reference_model.release)
        elif hasattr(engine.unwrapped, "disable_adapter"):
            reference = disabled_adapters_reference(forward, engine.unwrapped)
        else:
            raise ValueError("DPO needs a reference: LoRA adapters to disable, a precomputed table or a frozen model")
        return DirectPreference(
            forward,
            reference,
            settings.beta,
            settings.loss_type,
            settings.label_smoothing,
            settings.sft_weight,
            balance,
            engine.sum_tensor_across_ranks,
        )
    if objective == "reward":
        return RewardRanking(
            forward,
            engine.unwrapped.config.pad_token_id,
            settings.reward_loss,
            settings.penalty,
            settings.penalty_weight,
            balance,
            engine.sum_tensor_across_ranks,
        )
    raise ValueError(f"unknown objective {objective!r}")
