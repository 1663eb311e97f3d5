"""`metrics.jsonl`: one JSON object per optimizer step, flushed as written so a crash keeps it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, path: Path, append: bool = False):
        self.handle = path.open("a" if append else "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()
