"""`metrics.jsonl`: one JSON object per optimizer step, flushed as written so a crash keeps it."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from tuneforge.train.sinks import MetricSink, close_all, scalars_of, write_all


class MetricsLog:
    """`sinks` (TensorBoard, W&B; see `sinks.open_sinks`) receive each record's numbers after the file has it."""

    def __init__(self, path: Path, append: bool = False, sinks: list[MetricSink] | None = None):
        self.path = path
        self.handle = path.open("a" if append else "w", encoding="utf-8")
        self.write_failed = False
        self.sinks = list(sinks or [])

    def write(self, record: dict[str, Any]) -> None:
        try:
            self.handle.write(json.dumps(record) + "\n")
            self.handle.flush()
        except OSError as exc:
            # A full disk must not end training here: the next checkpoint stops the run cleanly if it persists.
            if not self.write_failed:
                print(
                    f"warning: {self.path}: step {record['step']} not written ({exc.strerror}); training goes on, "
                    "and a checkpoint that cannot be written will stop it",
                    file=sys.stderr,
                    flush=True,
                )
            self.write_failed = True
        if self.sinks:
            self.sinks = write_all(self.sinks, record["step"], scalars_of(record))

    def close(self) -> None:
        with contextlib.suppress(OSError):  # said at the write that failed
            self.handle.close()
        close_all(self.sinks)
        self.sinks = []
