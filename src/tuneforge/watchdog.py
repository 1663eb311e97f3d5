"""Stall watchdog (single process): no progress beat for too long -> stacks dumped, exit non-zero.

The training loop beats at every phase change. A monitor thread checks the age of the last beat;
it keeps running while the main thread is stuck in C code (a collective, a kernel) because such
calls release the GIL. `faulthandler` is armed as a backstop for a main thread that holds the
GIL forever. Per-rank diagnosis across processes builds on this in the distributed watchdog.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
from pathlib import Path

STALL_EXIT_CODE = 3


class StallWatchdog:
    def __init__(self, diagnostics_dir: Path, startup_timeout_s: float, stall_timeout_s: float, enabled: bool = True):
        self.diagnostics_dir = diagnostics_dir
        self.startup_timeout_s = startup_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.enabled = enabled
        self.phase = "startup"
        self.last_beat = time.monotonic()
        self.started_training = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._backstop_file = None

    @property
    def limit_s(self) -> float:
        return self.stall_timeout_s if self.started_training else self.startup_timeout_s

    def start(self) -> None:
        if not self.enabled:
            return
        self.diagnostics_dir.mkdir(parents=True, exist_ok=True)
        self._backstop_file = (self.diagnostics_dir / "backstop-stacks.txt").open("w")
        self._arm_backstop()
        self._thread = threading.Thread(target=self._watch, name="tuneforge-watchdog", daemon=True)
        self._thread.start()

    def beat(self, phase: str, training: bool = True) -> None:
        """Record progress. `training=True` marks that the first micro-step is done (the short limit applies)."""
        self.phase = phase
        self.last_beat = time.monotonic()
        if training and not self.started_training:
            self.started_training = True
            if self.enabled:
                self._arm_backstop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            faulthandler.cancel_dump_traceback_later()
            self._backstop_file.close()
            (self.diagnostics_dir / "backstop-stacks.txt").unlink(missing_ok=True)

    def _arm_backstop(self) -> None:
        # Re-armed rarely (not per beat): it fires only if the monitor thread itself cannot run.
        faulthandler.dump_traceback_later(self.limit_s * 2 + 60, repeat=False, file=self._backstop_file, exit=True)

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.limit_s / 4)):
            idle = time.monotonic() - self.last_beat
            if idle > self.limit_s:
                self._report(idle)
                os._exit(STALL_EXIT_CODE)

    def _report(self, idle: float) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        frames = sys._current_frames()
        dump = []
        for ident, frame in frames.items():
            if ident == threading.get_ident():
                continue
            dump.append(f"--- thread {names.get(ident, ident)} ---\n{''.join(traceback.format_stack(frame))}")
        path = self.diagnostics_dir / "stall-rank0.txt"
        path.write_text(f"no progress for {idle:.0f}s in phase {self.phase}\n\n" + "\n".join(dump))
        main = frames.get(threading.main_thread().ident)
        where = ""
        if main is not None:
            last = traceback.extract_stack(main)[-1]
            where = f"; main thread at {last.filename}:{last.lineno} in {last.name}"
        print(
            f"tuneforge watchdog: no progress for {idle:.0f}s (limit {self.limit_s:.0f}s) in phase "
            f"'{self.phase}'{where}. Stacks of every thread: {path}. Exiting with status {STALL_EXIT_CODE}.",
            file=sys.stderr,
            flush=True,
        )
