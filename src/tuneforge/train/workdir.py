"""A work dir belongs to one run: a lock while it trains, and a record of which run its checkpoints are from.

Two jobs writing into one directory interleave their metrics and rotate each other's checkpoints away; a fresh
run into an old run's directory would do the same, and `--resume auto` would then continue the old run. So the
first rank takes a lock (process, host, start time) before anything is written, a fresh run refuses a directory
that holds another run's outputs unless told to archive them, and every step checkpoint records its run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from tuneforge.errors import UserError

LOCK_FILE = ".tuneforge.lock"
RUN_FILE = "run.json"
PREVIOUS_RUNS = "previous-runs"
REFERENCE = "reference"
"""DPO's precomputed reference (`tuneforge.train.reference`): keyed by the model and the data and checked when
read, so a fresh run may reuse it; archived with the run that computed it."""
RUN_OUTPUTS = (
    "checkpoints",
    "metrics.jsonl",
    "samples.jsonl",
    "eval.json",
    "plot.png",
    "diagnostics",
    REFERENCE,
    RUN_FILE,
)
"""What a run writes into its work dir (and what `--archive-previous` moves away)."""


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    started: float

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"process {self.pid} on {self.host}, started {when}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _read_holder(path: Path) -> Holder | None:
    try:
        holder = Holder(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):  # vanished meanwhile, or half written by a process that died
        return None
    valid = isinstance(holder.pid, int) and not isinstance(holder.pid, bool) and holder.pid > 0
    valid = valid and isinstance(holder.host, str) and isinstance(holder.started, int | float)
    return holder if valid else None  # edited by hand or by something else: a lock nobody holds


def take_lock(work_dir: Path) -> str:
    """Take the work dir's lock for this process; a note when a dead run's lock was taken over. Refuses, naming the
    holder, while another live process holds it."""
    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / LOCK_FILE
    me = Holder(os.getpid(), socket.gethostname(), time.time())
    note = ""
    for _ in range(2):
        try:
            with path.open("x", encoding="utf-8") as handle:  # atomic: exactly one process creates it
                json.dump(asdict(me), handle)
            return note
        except FileExistsError:
            holder = _read_holder(path)
            if holder is not None and holder.host != me.host:
                raise UserError(
                    f"work dir {work_dir} is in use by {holder.describe()}; wait for that run, use another "
                    f"--work-dir, or, if it is gone, delete {path}"
                ) from None
            if holder is not None and _alive(holder.pid):
                raise UserError(
                    f"work dir {work_dir} is in use by {holder.describe()}; wait for it to finish or use another "
                    "--work-dir"
                ) from None
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            gone = holder.describe() if holder is not None else "a process that died while taking it"
            note = f"work dir: took over the lock left by {gone}, which is no longer running"
    raise UserError(f"work dir {work_dir}: another run took the lock at the same moment; start again")


def lock_holder(work_dir: Path) -> tuple[bool | None, float | None]:
    """Whether a live process holds the work dir's lock (None: no lock, so no run yet or one that ended
    cleanly; False: its holder died, e.g. killed), and when it took the lock. A holder on another host is
    taken to be alive: its process cannot be asked from here."""
    holder = _read_holder(work_dir / LOCK_FILE)
    if holder is None:
        return None, None
    return holder.host != socket.gethostname() or _alive(holder.pid), holder.started


def release_lock(work_dir: Path) -> None:
    path = work_dir / LOCK_FILE
    holder = _read_holder(path)
    if holder is not None and holder.pid == os.getpid() and holder.host == socket.gethostname():
        path.unlink(missing_ok=True)


def previous_outputs(work_dir: Path) -> list[str]:
    found = [name for name in RUN_OUTPUTS if (work_dir / name).exists()]
    checkpoints = work_dir / "checkpoints"
    if "checkpoints" in found and not any(checkpoints.iterdir()):
        found.remove("checkpoints")
    return [name for name in found if name not in ("diagnostics", REFERENCE, RUN_FILE)]


def start_run(work_dir: Path, resume: str | None, archive: bool) -> tuple[str, str]:
    """This run's id, and a note. A fresh run into another run's outputs is refused (or archives them with
    `archive`); a resumed run keeps the id recorded in the work dir."""
    record = work_dir / RUN_FILE
    if resume is not None and record.exists():
        return json.loads(record.read_text(encoding="utf-8"))["run_id"], ""
    note = ""
    found = previous_outputs(work_dir)
    if found and resume is None:
        if not archive:
            raise UserError(
                f"work dir {work_dir} holds another run's {', '.join(found)}; continue it with --resume auto, "
                "train into another --work-dir, or pass --archive-previous to move the old run to "
                f"{work_dir / PREVIOUS_RUNS}/ and start afresh"
            )
        destination = work_dir / PREVIOUS_RUNS / time.strftime("%Y%m%d-%H%M%S")
        destination.mkdir(parents=True)
        moved = [name for name in RUN_OUTPUTS if (work_dir / name).exists()]
        for name in moved:
            shutil.move(str(work_dir / name), str(destination / name))
        named = found + ([f"{REFERENCE}/"] if REFERENCE in moved else [])
        note = f"work dir: the previous run's {', '.join(named)} moved to {destination}"
    run_id = uuid.uuid4().hex[:12]
    written = record.with_name(record.name + ".tmp")
    written.write_text(json.dumps({"run_id": run_id, "started": time.time()}), encoding="utf-8")
    written.replace(record)  # atomic: a reader sees the old record or the new one, never a part
    return run_id, note


def recorded_run(work_dir: Path) -> str | None:
    record = work_dir / RUN_FILE
    return json.loads(record.read_text(encoding="utf-8"))["run_id"] if record.exists() else None
