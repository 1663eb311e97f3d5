"""Preference objectives over pairs of a chosen and a rejected answer: DPO and its loss family, and ORPO.

A micro-batch's rows hold whole pairs, each answer a sample of its own (isolated by the attention), chosen
before rejected, so answer k of the batch (row-major) is pair k // 2's chosen (k even) or rejected (k odd). Each
answer's log-probability is the sum of its target tokens' log-probs, read through the chunked output layer
(never the batch's full logits). The step's mean is over pairs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce

from tuneforge.data.batching import MicroBatch
from tuneforge.data.templates import IGNORE_INDEX
from tuneforge.model import sequence_parallel
from tuneforge.model.router_balance import RouterBalance
from tuneforge.model.transfer import to_device
from tuneforge.objective.base import Metrics, Objective, SumAcrossRanks
from tuneforge.objective.forward import TokenForward

REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")
"""TRL's names, so dashboards built for it read ours."""

ReferenceLogProbs = Callable[["MicroBatch", "AnswerLayout"], torch.Tensor]
"""The reference model's log-probability of each answer of a micro-batch (row by row, on the model's device, no
gradient), given the batch's answer layout (built once per micro-batch, shared with the policy's sums)."""


@dataclass(frozen=True)
class AnswerLayout:
    """Where each labelled position's answer is: the answer index of every target this rank holds (on the
    device), and the number of answers and of target tokens per answer (of the whole rows).

    Under sequence parallelism an answer's tokens are spread over the shards of a group: `sums` adds the
    group's parts (a differentiable all-reduce), so every shard computes the same per-pair losses, and only the
    first shard reports them (`owner`); the others contribute the gradients of their tokens through the sum."""

    answer_of_target: torch.Tensor
    answers: int
    tokens: torch.Tensor
    owner: bool = True
    """This rank reports the pairs' losses and metrics (always, without sequence parallelism)."""
    group: Any = None
    """The sequence-parallel group whose shards' sums are added; None without sequence parallelism."""

    @staticmethod
    def of(batch: MicroBatch, device: torch.device) -> AnswerLayout:
        answer, tokens = answer_of_targets(batch)
        shard, shards = batch.sequence_shard
        group = sequence_parallel.group() if shards > 1 else None
        return AnswerLayout(
            to_device(answer, device), len(tokens), to_device(tokens.float(), device), shard == 0, group
        )

    def sums(self, log_probs: torch.Tensor) -> torch.Tensor:
        """Per answer: the sum of its targets' log-probs (over the whole rows)."""
        local = torch.zeros(self.answers, dtype=log_probs.dtype, device=log_probs.device).index_add_(
            0, self.answer_of_target, log_probs
        )
        return add_shards(local, self.group)

    def real_pairs(self) -> torch.Tensor:
        """1.0 for the pairs this rank reports whose chosen answer has targets (rows repeated to fill a
        validation batch have none); 0.0 for every pair on shards other than the first."""
        return (self.tokens[0::2] > 0).float() * float(self.owner)


def add_shards(values: torch.Tensor, group: Any) -> torch.Tensor:
    """`values` summed over the sequence-parallel `group` (None: as they are); backward sums the gradients the
    same way, so each shard receives the gradient of the whole sum."""
    if group is None:
        return values
    return differentiable_all_reduce(values, group=group)


def answer_of_targets(batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(the answer index of every labelled position this batch holds, target tokens per answer of the whole
    rows), from the CPU copy of the batch: nothing here waits on the device."""
    rows = batch.whole_rows if batch.whole_rows is not None else batch
    per_row = (rows.sequence_ids.max(dim=1).values + 1).clamp(min=0)
    first = torch.cumsum(per_row, 0) - per_row

    def answers_of(part: MicroBatch) -> torch.Tensor:
        return (first[:, None] + part.sequence_ids).reshape(-1)[part.targets.reshape(-1) != IGNORE_INDEX]

    answers = int(per_row.sum())
    assert answers % 2 == 0 and answers == batch.num_samples, "rows hold whole pairs"
    return answers_of(batch), torch.bincount(answers_of(rows), minlength=answers)


def answer_log_probs(forward: TokenForward, batch: MicroBatch, layout: AnswerLayout | None = None) -> torch.Tensor:
    """Each answer's log-probability under `forward`'s model as it is: the sum over its target tokens."""
    layout = layout if layout is not None else AnswerLayout.of(batch, forward.device)
    return layout.sums(forward.target_log_probs(batch))


def disabled_adapters_reference(forward: TokenForward, peft_model: torch.nn.Module) -> ReferenceLogProbs:
    """The reference of LoRA and QLoRA training: the same model with its adapters disabled (no copy)."""

    def reference(batch: MicroBatch, layout: AnswerLayout) -> torch.Tensor:
        with torch.no_grad(), peft_model.disable_adapter():
            return answer_log_probs(forward, batch, layout)

    return reference


def frozen_model_reference(forward: TokenForward, release: Callable[[], None]) -> ReferenceLogProbs:
    """The reference kept as a frozen model beside the policy (`preference.reference: model`): its forward
    with no gradient, then `release` to free what that forward left gathered."""

    def reference(batch: MicroBatch, layout: AnswerLayout) -> torch.Tensor:
        with torch.no_grad():
            try:
                return answer_log_probs(forward, batch, layout)
            finally:
                release()

    return reference


def precomputed_reference(table: torch.Tensor, device: torch.device) -> ReferenceLogProbs:
    """The reference of full fine-tuning: each answer's log-probability under the model before training,
    computed once (`train.reference`) and looked up by the answer's index in the data."""
    table = table.to(device)

    def reference(batch: MicroBatch, layout: AnswerLayout) -> torch.Tensor:
        return table.index_select(0, to_device(torch.tensor(batch.sample_indices), device))

    return reference


class PairObjective(Objective):
    metric_names = REWARD_METRICS

    def count(self, batch: MicroBatch) -> int:
        """Pairs whose chosen answer has targets (rows repeated to fill a validation batch have none), counted
        by the first shard of a sequence-parallel group only."""
        if batch.sequence_shard[0] != 0:
            return 0
        _, tokens = answer_of_targets(batch)
        return int((tokens[0::2] > 0).sum())

    def global_count(self, batch: MicroBatch) -> int:
        return batch.global_samples // 2

    @staticmethod
    def _rewards(chosen: torch.Tensor, rejected: torch.Tensor, real: torch.Tensor) -> Metrics:
        chosen, rejected = chosen.detach(), rejected.detach()
        return {
            "rewards/chosen": (chosen * real).sum(),
            "rewards/rejected": (rejected * real).sum(),
            "rewards/margin": ((chosen - rejected) * real).sum(),
            "rewards/accuracy": ((chosen > rejected).float() * real).sum(),
        }


class DirectPreference(PairObjective):
    """DPO: -log sigmoid(beta * margin of the policy's log-ratio over the reference's), and its variants."""

    def __init__(
        self,
        forward: TokenForward,
        reference: ReferenceLogProbs,
        beta: float,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        sft_weight: float = 0.0,
        balance: RouterBalance | None = None,
        sum_across_ranks: SumAcrossRanks | None = None,
    ):
        super().__init__(forward, balance, sum_across_ranks)
        self.reference = reference
        self.beta = beta
        self.loss_type = loss_type
        self.label_smoothing = label_smoothing
        self.sft_weight = sft_weight

    def prepare(self, batch: MicroBatch) -> tuple[AnswerLayout, torch.Tensor]:
        # The answer layout (CPU index work and its copies to the device) once per micro-batch, for both passes.
        layout = AnswerLayout.of(batch, self.forward.device)
        return layout, self.reference(batch, layout)

    def evaluate(self, batch: MicroBatch, prepared: object) -> tuple[torch.Tensor, Metrics]:
        layout, reference = prepared  # type: ignore[misc]
        policy = layout.sums(self.forward.target_log_probs(batch))
        if self.loss_type == "ipo":  # IPO compares mean token log-probs, so long answers do not dominate
            lengths = layout.tokens.clamp(min=1)
            policy, reference = policy / lengths, reference / lengths
        chosen, rejected = policy[0::2] - reference[0::2], policy[1::2] - reference[1::2]
        losses = dpo_losses(chosen, rejected, self.beta, self.loss_type, self.label_smoothing)
        if self.sft_weight:
            nll = -policy[0::2] if self.loss_type == "ipo" else -policy[0::2] / layout.tokens[0::2].clamp(min=1)
            losses = losses + self.sft_weight * nll
        real = layout.real_pairs()
        return (losses * real).sum(), self._rewards(self.beta * chosen, self.beta * rejected, real)


def dpo_losses(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, loss_type: str, smoothing: float):
    """Per pair, from the log-ratios policy/reference of the chosen and the rejected answer."""
    margin = chosen - rejected
    if loss_type == "sigmoid":
        return -(1 - smoothing) * F.logsigmoid(beta * margin) - smoothing * F.logsigmoid(-beta * margin)
    if loss_type == "robust":
        return (-(1 - smoothing) * F.logsigmoid(beta * margin) + smoothing * F.logsigmoid(-beta * margin)) / (
            1 - 2 * smoothing
        )
    if loss_type == "hinge":
        return torch.relu(1 - beta * margin)
    if loss_type == "ipo":
        return (margin - 1 / (2 * beta)) ** 2
    if loss_type == "sppo_hard":
        return (chosen - 1 / (2 * beta)) ** 2 + (rejected + 1 / (2 * beta)) ** 2
    if loss_type == "nca_pair":
        return -F.logsigmoid(beta * chosen) - 0.5 * F.logsigmoid(-beta * chosen) - 0.5 * F.logsigmoid(-beta * rejected)
    raise ValueError(f"unknown DPO loss type {loss_type!r}")


class OddsRatioPreference(PairObjective):
    """ORPO: the chosen answer's mean token cross-entropy minus lambda * log sigmoid(log odds ratio of chosen
    over rejected), no reference model."""

    def __init__(
        self,
        forward: TokenForward,
        weight: float,
        balance: RouterBalance | None = None,
        sum_across_ranks: SumAcrossRanks | None = None,
    ):
        super().__init__(forward, balance, sum_across_ranks)
        self.weight = weight

    def evaluate(self, batch: MicroBatch, prepared: object) -> tuple[torch.Tensor, Metrics]:
        layout = AnswerLayout.of(batch, self.forward.device)
        mean = layout.sums(self.forward.target_log_probs(batch)) / layout.tokens.clamp(min=1)
        chosen, rejected = mean[0::2], mean[1::2]
        losses = -chosen - self.weight * F.logsigmoid(log_odds_ratio(chosen, rejected))
        real = layout.real_pairs()
        return (losses * real).sum(), self._rewards(self.weight * chosen, self.weight * rejected, real)


def log_odds_ratio(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """log(odds(chosen) / odds(rejected)) from mean token log-probs, odds(p) = p / (1 - p); log(1 - p) as
    log(-expm1(log p)), with log p kept below 0 so a certain answer stays finite."""
    chosen, rejected = chosen.clamp(max=-1e-6), rejected.clamp(max=-1e-6)
    return (chosen - rejected) - (torch.log(-torch.expm1(chosen)) - torch.log(-torch.expm1(rejected)))
