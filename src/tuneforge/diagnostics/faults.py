"""Fault injection for the hang tests: `TUNEFORGE_INJECT_FAULT=kind:rank:step[:seconds]`.

Testing only. It makes one rank misbehave at one optimizer step in a way real jobs do, so the watchdog's
diagnosis can be checked end to end through the real launcher:

- `skip_all_reduce`: the rank skips the step's token-count all-reduce (a branch that differs between ranks);
- `rank_only_collective`: the rank runs an "evaluation" with an all-reduce that only it issues;
- `extra_batch`: the rank gets one micro-batch more than the others in that step (uneven data);
- `sleep_data`: the rank sleeps `seconds` while loading that step's data (a straggler);
- `kill`: the rank kills itself with SIGKILL (a crash, or the OOM killer);
- `kill_in_save`: the same, in the middle of writing that step's checkpoint;
- `nan_loss`: the rank's loss of that step is NaN (a bad sample, an overflow).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV = "TUNEFORGE_INJECT_FAULT"
KINDS = ("skip_all_reduce", "rank_only_collective", "extra_batch", "sleep_data", "kill", "kill_in_save", "nan_loss")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    seconds: float = 0.0

    def due(self, kind: str, rank: int, step: int) -> bool:
        return self.kind == kind and self.rank == rank and self.step == step


def injected_fault() -> Fault | None:
    spec = os.environ.get(ENV)
    if not spec:
        return None
    kind, rank, step, *rest = spec.split(":")
    if kind not in KINDS:
        raise ValueError(f"{ENV}: unknown fault {kind!r}; one of {', '.join(KINDS)}")
    return Fault(kind, int(rank), int(step), float(rest[0]) if rest else 0.0)
