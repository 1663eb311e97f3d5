"""The seam every training objective plugs into: a loss over the step's micro-batches, built once per run.

An objective says what one unit of its mean is (a target token for SFT, a pair for preference objectives), how
many units a global micro-batch holds (known from the batching plan, so no collective finds the divisor) and
the loss summed over a micro-batch's units. The step divides by the step's units over all ranks, so the
gradient is that of the mean however the units are split into micro-batches and ranks. The router balance
loss of MoE models is added here, once, for every objective.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tuneforge.data.batching import MicroBatch
from tuneforge.model.router_balance import RouterBalance
from tuneforge.objective.forward import TokenForward

SumAcrossRanks = Callable[[torch.Tensor], torch.Tensor]


Metrics = dict[str, torch.Tensor]
"""Figures an objective reports beside its loss (e.g. `rewards/accuracy`), each summed over the units of a
micro-batch (detached); the step reports their mean over its units."""


@dataclass(frozen=True)
class LossTerms:
    total: torch.Tensor
    """What backward runs on: this rank's share of the step's mean, router balance term included."""
    loss: torch.Tensor
    """The objective's own share of the step's mean (detached), for reporting."""
    router_aux: torch.Tensor | None
    """The router balance loss's share (detached, before its coefficient); None without one."""
    metrics: Metrics
    """The objective's figures, summed over the micro-batch's units."""


@dataclass
class StepData:
    """What a step trains on: the planned micro-batches, or those an objective made from them (online RL's
    rollouts), with the figures and samples the making reports."""

    micro_batches: list[MicroBatch]
    figures: dict[str, float] = field(default_factory=dict)
    """Reported in the step's record beside its loss, the same on every rank."""
    samples: list[dict] = field(default_factory=list)
    """A few generated completions (`prompt`, `reply`, `reward`), for `samples.jsonl`."""


class Objective(abc.ABC):
    """One objective's loss (what it is, its data and its unit: `tuneforge.config.objectives`)."""

    def __init__(
        self,
        forward: TokenForward,
        balance: RouterBalance | None = None,
        sum_across_ranks: SumAcrossRanks | None = None,
    ):
        self.forward = forward
        self.balance = balance
        self.sum_across_ranks = sum_across_ranks if sum_across_ranks is not None else _local

    @abc.abstractmethod
    def count(self, batch: MicroBatch) -> int:
        """Units in this rank's micro-batch."""

    @abc.abstractmethod
    def global_count(self, batch: MicroBatch) -> int:
        """Units in the whole global micro-batch `batch` is this rank's share of (from the plan)."""

    metric_names: tuple[str, ...] = ()
    """The keys of the metrics `evaluate` returns, in the order they are reported."""

    generates: bool = False
    """Whether `prepare_step` generates the step's data (a phase the watchdog watches as generation)."""

    updates_per_step: int = 1
    """Optimizer updates each step makes on its data (online RL's updates per rollout; one elsewhere)."""

    def prepare_step(self, micro_batches: list[MicroBatch], step: int) -> StepData:
        """The step's training data from its planned micro-batches (every rank calls it at every step, alike):
        these as they are by default. `step`: the optimizer step they train (what keys online RL's sampling)."""
        return StepData(micro_batches)

    def prepare(self, batch: MicroBatch) -> object:
        """What the loss needs besides the policy's forward, computed before it and outside the router balance's
        recording (a preference objective's reference log-probs). None by default."""
        return None

    @abc.abstractmethod
    def evaluate(self, batch: MicroBatch, prepared: object) -> tuple[torch.Tensor, Metrics]:
        """The loss summed over the micro-batch's units (a scalar on the model's device, fp32), and the metrics
        summed likewise."""

    def loss_sum(self, batch: MicroBatch) -> torch.Tensor:
        return self.evaluate(batch, self.prepare(batch))[0]

    def terms(self, batch: MicroBatch, step_units: int) -> LossTerms:
        """One micro-batch's forward: its loss over `step_units`, the step's units over all ranks."""
        prepared = self.prepare(batch)
        with self.balance.capture() if self.balance is not None else contextlib.nullcontext():
            loss, metrics = self.evaluate(batch, prepared)
            loss = loss / step_units
        if self.balance is None:
            return LossTerms(loss, loss.detach(), None, metrics)
        aux = self.balance.loss(batch.attention_mask, self.count(batch), step_units, self.sum_across_ranks)
        return LossTerms(loss + self.balance.coef * aux, loss.detach(), aux.detach(), metrics)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
