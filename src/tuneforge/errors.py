"""The one exception type for mistakes a user can fix.

A ``UserError`` is printed as its message alone (no traceback) and exits with status 2.
Internal invariants use ``assert`` instead: those are our bugs, and the traceback helps.
"""


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
