"""A worker ends when its launcher dies.

The elastic launcher starts each worker in a session of its own, so a kill of the launcher's process group (the
OOM killer, a scheduler's hard kill, `kill -9 -- -PGID`) or a launcher that returns early (a second Ctrl-C) never
reaches the workers: they would train on, holding GPUs, the work dir's lock and the right to write checkpoints.
A worker therefore watches its parent and exits at once when it is gone. What was committed stays as it was
(checkpoints are renamed into place whole), so `--resume auto` right after continues from the newest one.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

POLL_S = 0.5
ORPHANED_EXIT = 129
"""128 + SIGHUP: the controlling process is gone."""


def follow_launcher() -> None:
    """Under torchrun (ours or the user's): exit this process within `POLL_S` of the launcher's death. A thread
    of its own, independent of the watchdog (which a config may turn off), and of the main thread (which may be
    blocked in a collective)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    launcher = os.getppid()
    if launcher == 1:  # already adopted by init: the launcher died before this process got here
        _watch(launcher, gone=True)
    threading.Thread(target=_watch, args=(launcher,), name="tuneforge-launcher-watch", daemon=True).start()


def _watch(launcher: int, gone: bool = False) -> None:
    while not gone and os.getppid() == launcher:
        time.sleep(POLL_S)
    rank = os.environ.get("RANK", "?")
    with contextlib.suppress(OSError):  # the launcher's terminal or pipe may be gone with it
        print(
            f"tuneforge: rank {rank}: its launcher (process {launcher}) is gone; stopping now without a checkpoint "
            "(--resume auto continues from the newest complete one)",
            file=sys.stderr,
            flush=True,
        )
    os._exit(ORPHANED_EXIT)
