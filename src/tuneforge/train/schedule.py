"""Learning rate by optimizer step: linear warmup, then cosine, linear or constant decay to `min_lr`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


def resolve_warmup(total_steps: int, ratio: float, steps: int | None) -> int:
    """Explicit `warmup_steps` win over `warmup_ratio`; never longer than the run."""
    warmup = steps if steps is not None else math.ceil(ratio * total_steps)
    return min(warmup, total_steps)


@dataclass(frozen=True)
class LRSchedule:
    peak: float
    min_lr: float
    total_steps: int
    warmup_steps: int
    kind: Literal["cosine", "linear", "constant"]

    def __call__(self, step: int) -> float:
        """LR of optimizer step `step` (1-based). Warmup reaches `peak` at its last step; the last step of the
        run uses `min_lr` (a constant schedule stays at `peak`)."""
        assert 1 <= step <= self.total_steps, f"step {step} outside 1..{self.total_steps}"
        if step <= self.warmup_steps:
            return self.peak * step / self.warmup_steps
        if self.kind == "constant":
            return self.peak
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        if self.kind == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.peak - self.min_lr) * shape
