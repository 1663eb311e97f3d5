"""The run's training objective, built once from its engine (the seam `accumulate_gradients` calls)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class ObjectiveInputs:
    """What an objective is built from: the policy's forward and the run's settings and reference."""

    engine: Engine
    forward: TokenForward
    precision: str
    balance: RouterBalance | None
    preference: PreferenceConfig
    reference_table: torch.Tensor | None
    reference_model: FrozenModel | None


def _cross_entropy(given: ObjectiveInputs) -> Objective:
    return CrossEntropy(given.forward, given.balance, given.engine.sum_tensor_across_ranks)


def _odds_ratio(given: ObjectiveInputs) -> Objective:
    return OddsRatioPreference(
        given.forward, given.preference.orpo_lambda, given.balance, given.engine.sum_tensor_across_ranks
    )


def _direct_preference(given: ObjectiveInputs) -> Objective:
    forward, settings = given.forward, given.preference
    if given.reference_table is not None:
        reference = precomputed_reference(given.reference_table, forward.device)
    elif (frozen := given.reference_model) is not None:
        frozen_forward = TokenForward(
            frozen.module, frozen.plain, given.precision, frozen.fuses_output_layer, forward.device
        )
        reference = frozen_model_reference(frozen_forward, frozen.release)
    elif hasattr(given.engine.unwrapped, "disable_adapter"):
        reference = disabled_adapters_reference(forward, given.engine.unwrapped)
    else:
        raise ValueError("DPO needs a reference: LoRA adapters to disable, a precomputed table or a frozen model")
    return DirectPreference(
        forward,
        reference,
        settings.beta,
        settings.loss_type,
        settings.label_smoothing,
        settings.sft_weight,
        given.balance,
        given.engine.sum_tensor_across_ranks,
    )


def _reward_ranking(given: ObjectiveInputs) -> Objective:
    settings = given.preference
    return RewardRanking(
        given.forward,
        given.engine.unwrapped.config.pad_token_id,
        settings.reward_loss,
        settings.penalty,
        settings.penalty_weight,
        given.balance,
        given.engine.sum_tensor_across_ranks,
    )


BUILDERS: dict[str, Callable[[ObjectiveInputs], Objective]] = {
    "sft": _cross_entropy,
    "orpo": _odds_ratio,
    "dpo": _direct_preference,
    "reward": _reward_ranking,
}
"""Each objective of `tuneforge.config.objectives`, by name: what builds its loss."""


def policy_forward(engine: Engine, precision: str) -> TokenForward:
    """The policy's per-token forward: its output layer fused with the loss where the engine leaves it whole."""
    return TokenForward(engine.model, engine.unwrapped, precision, engine.traits.fuses_output_layer, engine.info.device)


def build_objective(
    engine: Engine,
    precision: str,
    balance: RouterBalance | None = None,
    objective: str = "sft",
    preference: PreferenceConfig | None = None,
    reference_table: torch.Tensor | None = None,
    reference_model: FrozenModel | None = None,
) -> Objective:
    """`objective` (`train.objective`) over `engine`'s model (`policy_forward`), with the router balance loss of
    MoE models when `balance` is given, applied to the policy's forward only. DPO's reference: the base with the
    adapters disabled; with `reference_table` every answer's log-probability under the model before training
    (`train.reference.reference_pass`); with `reference_model` a frozen copy of the model before training
    (`Engine.frozen`). Building does no work on the data."""
    given = ObjectiveInputs(
        engine,
        policy_forward(engine, precision),
        precision,
        balance,
        preference or PreferenceConfig(),
        reference_table,
        reference_model,
    )
    return BUILDERS[objective](given)
