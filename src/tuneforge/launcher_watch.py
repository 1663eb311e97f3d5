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
from pathlib import Path

POLL_S = 0.5
ORPHANED_EXIT = 129
"""128 + SIGHUP: the controlling process is gone."""


LAUNCHER_PID = "TUNEFORGE_LAUNCHER_PID"
"""Set by `tuneforge train --nproc-per-node N` for its workers: the launcher's process id."""


def launcher_is_process_one() -> bool:
    """Whether process 1 is the launcher itself, as in a container whose command is `tuneforge train` or
    torchrun, rather than init (which adopts the workers of a launcher that died)."""
    if os.environ.get(LAUNCHER_PID) == "1":
        return True
    try:
        command = Path("/proc/1/cmdline").read_bytes()
    except OSError:
        return False
    return any(word in command for word in (b"tuneforge", b"torchrun", b"torch.distributed.run"))


def follow_launcher() -> None:
    """Under torchrun (ours or the user's): exit this process within `POLL_S` of the launcher's death. A thread
    of its own, independent of the watchdog (which a config may turn off), and of the main thread (which may be
    blocked in a collective)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    launcher = os.getppid()
    if launcher == 1 and not launcher_is_process_one():  # adopted by init: the launcher died before this got here
        _watch(launcher, gone=True)
    threading.Thread(target=_watch, args=(launcher,), name="tuneforge-launcher-watch", daemon=True).start()


FOLLOW_PARENT = "TUNEFORGE_FOLLOW_PARENT"
"""Set to 1 for a helper process a training run starts (a checkpoint's scoring): it ends with the run."""


def follow_parent_if_asked() -> None:
    """A helper of a training run (`FOLLOW_PARENT` set) exits within `POLL_S` of the run's death (a SIGKILL, the
    OOM killer), so no scoring is left behind holding a GPU."""
    if os.environ.get(FOLLOW_PARENT) != "1":
        return
    parent = os.getppid()
    message = f"tuneforge: the training run (process {parent}) that started this is gone; stopping"
    threading.Thread(target=_watch, args=(parent, False, message), name="tuneforge-parent-watch", daemon=True).start()


def _watch(launcher: int, gone: bool = False, message: str | None = None) -> None:
    while not gone and os.getppid() == launcher:
        time.sleep(POLL_S)
    rank = os.environ.get("RANK", "?")
    with contextlib.suppress(OSError):  # the launcher's terminal or pipe may be gone with it
        print(
            message
            or f"tuneforge: rank {rank}: its launcher (process {launcher}) is gone; stopping now without a checkpoint "
            "(--resume auto continues from the newest complete one)",
            file=sys.stderr,
            flush=True,
        )
    os._exit(ORPHANED_EXIT)
