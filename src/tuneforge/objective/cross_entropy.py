"""Supervised fine-tuning: the mean cross-entropy over every target token of the step."""

from __future__ import annotations

import torch

from tuneforge.data.batching import MicroBatch
from tuneforge.objective.base import Metrics, Objective


class CrossEntropy(Objective):
    def count(self, batch: MicroBatch) -> int:
        return batch.num_targets

    def global_count(self, batch: MicroBatch) -> int:
        return batch.global_targets

    def evaluate(self, batch: MicroBatch, prepared: object) -> tuple[torch.Tensor, Metrics]:
        return self.forward.cross_entropy_sum(batch), {}
