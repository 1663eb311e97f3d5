"""Where a process is: every thread's stack, and the innermost frame of interest of the main thread or of an
exception (frames of the collective recorder and the watchdog's own are skipped)."""

from __future__ import annotations

import sys
import threading
import traceback


def exception_site(exc: BaseException) -> str:
    """`file:line in function` of the innermost frame of an exception outside the collective recorder."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "diagnostics/recorder.py" not in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""


def thread_stacks(skip_current: bool = True) -> tuple[str, str]:
    """(text of every thread's stack, `file:line in function` of the main thread's innermost frame outside
    the collective recorder)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    dump = []
    for ident, frame in frames.items():
        if skip_current and ident == threading.get_ident():
            continue
        dump.append(f"--- thread {names.get(ident, ident)} ---\n{''.join(traceback.format_stack(frame))}")
    where = ""
    main = frames.get(threading.main_thread().ident)
    if main is not None:
        stack = [f for f in traceback.extract_stack(main) if "tuneforge/diagnostics/recorder.py" not in f.filename]
        # A main thread inside our SIGTERM handler: where it was is the frame below the handler.
        while stack and (stack[-1].filename.endswith(("/threading.py", "tuneforge/watchdog.py"))):
            stack.pop()
        if stack:
            last = stack[-1]
            where = f"{last.filename}:{last.lineno} in {last.name}"
    return "\n".join(dump), where
