"""The files a rank's diagnostics live in (`diagnostics/` of the work dir) and how they are written and read:
shared by the watchdog that writes them, the report that reads them, and `tuneforge diagnose`."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from pathlib import Path

REPORT = "report.txt"
"""In `diagnostics/`: the diagnosis of a stall or a failure, written by one rank (or the launcher)."""
STOPPED = "stopped.txt"
"""In `diagnostics/`: written by rank 0 when the ranks stopped together on a signal (not a failure to report)."""
TRAINING_PHASES = ("data", "forward/backward", "optimizer")
GENERATION = "generation"
"""The phase of writing replies (sample chats; RL rollouts), with its own limit (`watchdog.generation_timeout_s`)."""
SLOW_PHASES = ("save", "model", "startup")
"""Phases that may legitimately take long (writing a large checkpoint, loading weights): the start-up limit."""
HEARTBEAT_EVERY_S = 1.0


def fatal_stacks_file(diagnostics_dir: Path, rank: int) -> Path:
    """Where faulthandler writes a rank's stacks when it dies of SIGABRT, SIGSEGV, SIGBUS, SIGFPE or SIGILL."""
    return diagnostics_dir / f"fatal-rank-{rank}.txt"


def black_box_file(diagnostics_dir: Path, rank: int) -> Path:
    """The recorder's crash-safe copy of a rank's collective in flight."""
    return diagnostics_dir / "live" / f"collective-rank-{rank}.bin"


def process_start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (Linux): with the pid, it names one process, where
    a pid alone may have been reused since it was written down."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_state(pid: int) -> str | None:
    """The state letter Linux reports for process `pid` (`R` running, `S` sleeping, `T` stopped, `Z` exited but
    not reaped, ...); None if it cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def same_process_alive(heartbeat: dict) -> bool | None:
    """Whether the process a heartbeat names (its pid, and its start time where recorded, since a pid may be
    reused) still runs; None when it ran on another host, where only the heartbeat's age can tell."""
    if heartbeat.get("host") != socket.gethostname():
        return None
    pid, started = int(heartbeat["pid"]), heartbeat.get("pid_started")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return started is None or process_start_ticks(pid) == started


def write_json(path: Path, data: dict) -> None:
    """Atomic, so a reader on another process (or node) never sees half a file."""
    # Per thread too: a rank's main thread and its watchdog's monitor thread both write its heartbeat.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, default=str))
    os.replace(tmp, path)


MAX_JSON_BYTES = 16 << 20
"""A heartbeat or dump is a few kB (its recent collectives): a larger file is none of ours."""


def read_json(path: Path) -> dict | None:
    """A rank's JSON file, or None where there is none (or it is being replaced). Only a regular file is read,
    and only so much of it: a FIFO or a device planted in a shared work dir would block the reader (the
    watchdog's monitor thread among them)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read(MAX_JSON_BYTES + 1)
        value = json.loads(data) if len(data) <= MAX_JSON_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    return value if isinstance(value, dict) else None
