"""Stop signals as the training loop honours them: the state a graceful stop shares between the signal handler
and the watchdog's monitor thread (which receive signals) and the loop (which asks at each step end).

The loop runs its steps inside `graceful()`: a SIGTERM or SIGINT there asks for a stop at the step's end
(`request`), the ranks' per-step vote makes every rank agree on the step (`agree`), and only a rank that cannot
get there within `grace_s` is stopped at once by the watchdog. A signal outside that section, or a second one,
stops the rank at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator

SAME_STOP_S = 2.0
"""A stop signal within this time of the first is the same request delivered twice (a terminal's Ctrl-C reaches
every process, and torchrun forwards it to its workers again); a later one stops at once."""


class StopRequests:
    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        """How long a rank may take to reach the step's end after a stop signal."""
        self.inside = False
        """The loop is where it can stop at a step end (`graceful`)."""
        self.signal: signal.Signals | None = None
        """The signal the pending stop was asked by (the first one)."""
        self.requested_at = 0.0
        self.agreed = False
        """Every rank voted to stop after this step: the save that follows is bounded by the usual limits."""
        self._lock = threading.RLock()  # the signal handler may run again inside itself

    @contextlib.contextmanager
    def graceful(self) -> Iterator[None]:
        """The steps of a run: a stop signal inside asks for a stop at a step end, with a checkpoint."""
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def request(self, number: signal.Signals) -> bool:
        """Ask the loop to stop at the end of the step; False when this is a new request after one already made
        (the caller then stops at once)."""
        with self._lock:
            now = time.monotonic()
            if self.signal is not None:
                return now - self.requested_at < SAME_STOP_S
            self.signal, self.requested_at = number, now
        return True

    def clear(self) -> None:
        """The run reached its last step as the signal came: it completes; a further signal stops it at once."""
        with self._lock:
            self.signal = None

    def agree(self) -> None:
        self.agreed = True

    def repeated(self) -> bool:
        """A signal now is the pending request delivered again (within SAME_STOP_S of it)."""
        return time.monotonic() - self.requested_at < SAME_STOP_S

    def waited_s(self) -> float:
        """Since the pending stop was asked for (0 with none)."""
        return time.monotonic() - self.requested_at if self.signal is not None else 0.0

    def grace_left_s(self) -> float:
        return self.grace_s - self.waited_s()
