"""The one exception type for mistakes a user can fix.

A ``UserError`` is printed as its message alone (no traceback) and exits with status 2.
Internal invariants use ``assert`` instead: those are our bugs, and the traceback helps.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from tuneforge.terminal import safe_text

ERRORS_DIR_ENV = "TUNEFORGE_ERRORS_DIR"
"""Set by `tuneforge train --nproc-per-node N` for its workers: a directory of the launcher's where each worker
that stops on a UserError leaves it (`error-rank-N.json`), for the launcher to print each distinct one once."""


class UserError(Exception):
    """A located, actionable problem with the user's config, data or command line."""


class SharedUserError(UserError):
    """A problem every rank met together (they agreed on it in a collective, or found it in what they all hold
    alike: the config, the world size): printed once, by rank 0, and not again when `said` (rank 0 printed it
    before the ranks stopped together)."""

    def __init__(self, message: str, said: bool = False):
        super().__init__(message)
        self.said = said


class StoppedBySignal(Exception):
    """Training stopped on request (SIGTERM from a scheduler, SIGINT from a terminal) at a step boundary that
    every rank agreed on. Not an error: the run exits with 128 + the signal number, as shells expect."""

    def __init__(self, signal_name: str, signal_number: int, step: int, total_steps: int, checkpoint: str | None):
        self.signal_name = signal_name
        self.exit_code = 128 + signal_number
        self.step = step
        self.total_steps = total_steps
        self.checkpoint = checkpoint
        saved = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint written for it"
        super().__init__(f"stopped by {signal_name} after step {step} of {total_steps}; {saved}")


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an error's message (its type's name when it has none), cut to `limit` characters: how
    a library's multi-line error is quoted inside one of ours."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:limit]


def say_user_error(exc: UserError) -> None:
    """Print a UserError as `error: MESSAGE`, once per launch. Alone, or under a launcher other than ours
    (torchrun, srun), every rank prints its own, except a SharedUserError: rank 0 prints that, unless it `said` it
    already. Under `tuneforge train --nproc-per-node N` every rank also leaves it for the launcher, and only rank 0
    prints: once the workers have ended the launcher prints what the other ranks met and rank 0 did not say, with
    their ranks (`error: rank 3: ...`). A rank that cannot leave it there prints it itself."""
    rank = int(os.environ.get("RANK", "0"))
    shared = isinstance(exc, SharedUserError)
    prints = not shared or (not exc.said and rank == 0)
    directory = os.environ.get(ERRORS_DIR_ENV)
    if directory and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        left = leave_user_error(Path(directory), rank, str(exc), shared, shared and exc.said)
        prints = prints and (rank == 0 or not left)
    if prints:
        print(f"error: {safe_text(exc)}", file=sys.stderr, flush=True)  # it may quote a received file


def leave_user_error(directory: Path, rank: int, message: str, shared: bool, said: bool) -> bool:
    """Write one rank's UserError for the launcher (whole, by a rename); returns whether it was written. `shared`:
    a SharedUserError (rank 0 says it), `said`: one rank 0 said before the ranks stopped."""
    path = directory / f"error-rank-{rank}.json"
    tmp = directory / f".{path.name}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps({"rank": rank, "message": message, "shared": shared, "said": said}), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return False
    return True
