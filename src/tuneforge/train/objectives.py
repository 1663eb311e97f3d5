"""The run's training objective, built once from its engine (the seam `accumulate_gradients` calls)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from tuneforge.config.schema import PreferenceConfig, RLConfig
from tuneforge.data.conversation import Conversation
from tuneforge.data.templates import ChatTemplate
from tuneforge.distributed import gather_objects
from tuneforge.engines import Engine
from tuneforge.engines.base import FrozenModel
from tuneforge.generate import stop_token_ids
from tuneforge.model.router_balance import RouterBalance
from tuneforge.objective import CrossEntropy, Objective, TokenForward
from tuneforge.objective.group_relative import GroupRelativePolicy
from tuneforge.objective.preference import (
    DirectPreference,
    OddsRatioPreference,
    disabled_adapters_reference,
    frozen_model_reference,
    precomputed_reference,
)
from tuneforge.objective.reward import RewardRanking
from tuneforge.objective.rewards import Reward
from tuneforge.rollout_samplers import build_sampler


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
    prompts: PromptContext | None = None


@dataclass(frozen=True)
class PromptContext:
    """What online RL's rollouts need besides the model: its settings and rewards, each prompt's answer (by data
    index), and how replies end and read."""

    settings: RLConfig
    rewards: list[Reward]
    answers: list[str]
    tokenizer: PreTrainedTokenizerBase
    template: ChatTemplate
    seed: int
    """The run's seed: with the step, a prompt's index and a completion's number, what its sampling draws."""
    prompts: Callable[[int], Conversation] | None = None
    """Each prompt's conversation by data index, for rewards that read it (a reward model)."""
    max_prompt_tokens: int = 1024
    """The longest prompt (`data.max_length`): with `rl.max_completion_tokens`, the longest sequence sampled."""


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


def _group_relative(given: ObjectiveInputs) -> Objective:
    context = given.prompts
    if context is None:
        raise ValueError("grpo needs its prompts' context")
    engine, forward = given.engine, given.forward
    stops = context.template.stop_strings(context.tokenizer)
    reference = None
    if context.settings.kl_coef:
        reference = _adapters_off_log_probs(forward, engine.unwrapped, context.settings.temperature)
    return GroupRelativePolicy(
        forward,
        context.settings,
        context.rewards,
        context.answers,
        context.tokenizer,
        stops,
        build_sampler(
            context.settings,
            engine.unwrapped,
            forward.plain,
            stop_token_ids(context.tokenizer, stops),
            context.tokenizer.pad_token_id,
            forward.precision,
            engine.generates_in_lockstep,
            engine.info.world_size,
            engine.info.device,
            context.seed,
            context.max_prompt_tokens,
            engine.whole if engine.sharded else None,
        ),
        lambda value: gather_objects(value, engine.info),
        reference,
        given.balance,
        engine.sum_tensor_across_ranks,
        context.seed,
        context.prompts,
    )


def _adapters_off_log_probs(forward: TokenForward, peft_model: torch.nn.Module, temperature: float):
    """The KL reference of online RL: the policy with its adapters disabled, token by token, at the sampling
    temperature (as the policy's own log-probabilities are taken)."""

    def reference(batch):
        with torch.no_grad(), peft_model.disable_adapter():
            return forward.target_log_probs(batch, temperature)

    return reference


BUILDERS: dict[str, Callable[[ObjectiveInputs], Objective]] = {
    "sft": _cross_entropy,
    "orpo": _odds_ratio,
    "dpo": _direct_preference,
    "reward": _reward_ranking,
    "grpo": _group_relative,
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
    prompts: PromptContext | None = None,
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
        prompts,
    )
    return BUILDERS[objective](given)
