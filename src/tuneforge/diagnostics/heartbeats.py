"""The ranks' heartbeat files (`diagnostics/live/rank-N.json`): each rank writes its own, whole, every second and
at each rare phase; every rank reads its peers' to tell a slow peer from a stalled or gone one."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from tuneforge.diagnostics.files import read_json, write_json


class Heartbeats:
    def __init__(self, live_dir: Path, rank: int, world_size: int):
        self.live_dir = live_dir
        self.rank = rank
        self.world_size = world_size

    def path(self, rank: int) -> Path:
        return self.live_dir / f"rank-{rank}.json"

    def write(self, state: dict[str, Any]) -> None:
        """This rank's heartbeat, replaced whole. A full or vanished disk must not end training: the stall path
        reports what it can."""
        with contextlib.suppress(OSError):
            write_json(self.path(self.rank), state)

    def peers(self) -> dict[int, dict[str, Any]]:
        """The other ranks' last heartbeats that can be read now, by rank."""
        found = {}
        for rank in range(self.world_size):
            if rank != self.rank and (data := read_json(self.path(rank))) is not None:
                found[rank] = data
        return found
