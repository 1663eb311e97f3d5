"""`metrics.jsonl`: one JSON object per optimizer step, flushed as written so a crash keeps it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tuneforge.train.sinks import MetricSink, close_all, scalars_of, write_all


class MetricsLog:
    """`sinks` (TensorBoard, W&B; see `sinks.open_sinks`) receive each record's numbers after the file has it."""

    def __init__(self, path: Path, append: bool = False, sinks: list[MetricSink] | None = None):
        self.handle = path.open("a" if append else "w", encoding="utf-8")
        self.sinks = list(sinks or [])

    def write(self, record: dict[str, Any]) -> None:
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()
        if self.sinks:
            self.sinks = write_all(self.sinks, record["step"], scalars_of(record))

    def close(self) -> None:
        self.handle.close()
        close_all(self.sinks)
        self.sinks = []
