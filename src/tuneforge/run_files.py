"""A run's work dir, known in one place: every path the run writes (`RunFiles`), and the one rule by which every
reader of its logs (the loop's resume, `plot`, `watch`) tells a record from a damaged or foreign line.

The writer (the training loop, the watchdog) and the readers (resume, plot, watch, diagnose) all go through it,
so a file's name or a reader's rule changes in one place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuneforge.diagnostics.files import REPORT, STOPPED

CONFIG = "config.yaml"
RUN_FILE = "run.json"
LOCK_FILE = ".tuneforge.lock"
METRICS = "metrics.jsonl"
SAMPLES = "samples.jsonl"
EVAL = "eval.json"
PLOT = "plot.png"
CHECKPOINTS = "checkpoints"
DIAGNOSTICS = "diagnostics"
LIVE = "live"
REFERENCE = "reference"
"""DPO's precomputed reference (`tuneforge.train.reference`): keyed by the model and the data and checked when
read, so a fresh run may reuse it; archived with the run that computed it."""
BASE = "base"
PREVIOUS_RUNS = "previous-runs"

MAX_STEP = 1 << 53
"""Steps up to here are exact as floats (a plot's axis); a larger one is no step a run logged."""


def step_record(line: str | bytes) -> dict[str, Any] | None:
    """A line of `metrics.jsonl` or `samples.jsonl` as its record: a JSON object whose `step` is an integer a run
    could have logged. None for anything else (a line cut off by a crash or a full disk, bytes that are not
    UTF-8, JSON nested past the parser, a line of another kind), which each reader leaves out and counts."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    step = record.get("step") if isinstance(record, dict) else None
    if isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= MAX_STEP:
        return record
    return None


@dataclass
class StepLog:
    """The records of a JSON-lines log, and the numbers of its lines that are none (blank lines are neither)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    unreadable: list[int] = field(default_factory=list)


def read_step_log(path: Path, keep: tuple[str, ...] | None = None) -> StepLog:
    """Every record of `path` by `step_record`'s rule, read a line at a time (OSError when the file cannot be
    read). `keep`: the fields a reader needs (with `step`), so a long run's log costs it no more memory than
    that."""
    log = StepLog()
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            record = step_record(line)
            if record is None:
                log.unreadable.append(number)
            elif keep is None:
                log.records.append(record)
            else:
                log.records.append({key: record[key] for key in ("step", *keep) if key in record})
    return log


@dataclass(frozen=True)
class RunFiles:
    """The paths of the run whose work dir is `work_dir`."""

    work_dir: Path

    @property
    def config(self) -> Path:
        """The resolved config the run trains with."""
        return self.work_dir / CONFIG

    @property
    def record(self) -> Path:
        """`run.json`: the run's id and start (what `--resume auto` continues)."""
        return self.work_dir / RUN_FILE

    @property
    def lock(self) -> Path:
        return self.work_dir / LOCK_FILE

    @property
    def metrics(self) -> Path:
        return self.work_dir / METRICS

    @property
    def samples(self) -> Path:
        return self.work_dir / SAMPLES

    @property
    def eval_result(self) -> Path:
        return self.work_dir / EVAL

    @property
    def plot(self) -> Path:
        return self.work_dir / PLOT

    @property
    def checkpoints(self) -> Path:
        return self.work_dir / CHECKPOINTS

    @property
    def reference(self) -> Path:
        return self.work_dir / REFERENCE

    @property
    def base(self) -> Path:
        """Where a run keeps a base model it prepared (a k-bit base's, a reward model's config)."""
        return self.work_dir / BASE

    @property
    def diagnostics(self) -> Path:
        return self.work_dir / DIAGNOSTICS

    @property
    def live(self) -> Path:
        """The ranks' heartbeats, black boxes and `diagnose --live`'s requests."""
        return self.diagnostics / LIVE

    @property
    def report(self) -> Path:
        return self.diagnostics / REPORT

    @property
    def stopped(self) -> Path:
        """Written by rank 0 when the ranks stopped together on a signal."""
        return self.diagnostics / STOPPED
