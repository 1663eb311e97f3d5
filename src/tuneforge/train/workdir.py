"""A work dir belongs to one run: a lock while it trains, and a record of which run its checkpoints are from.

Two jobs writing into one directory interleave their metrics and rotate each other's checkpoints away; a fresh
run into an old run's directory would do the same, and `--resume auto` would then continue the old run. So the
first rank takes a lock (process, host, start time) before anything is written, a fresh run refuses a directory
that holds another run's outputs unless told to archive them, and every step checkpoint records its run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from tuneforge.diagnostics.files import process_start_ticks
from tuneforge.errors import UserError, first_line
from tuneforge.run_files import (
    CHECKPOINTS,
    CONFIG,
    DIAGNOSTICS,
    EVAL,
    LOCK_FILE,
    METRICS,
    PLOT,
    PREVIOUS_RUNS,
    REFERENCE,
    RUN_FILE,
    SAMPLES,
)

RUN_OUTPUTS = (CHECKPOINTS, METRICS, SAMPLES, EVAL, PLOT, DIAGNOSTICS, REFERENCE, RUN_FILE)
"""What a run writes into its work dir (and what `--archive-previous` moves away)."""


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    started: float

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"process {self.pid} on {self.host}, started {when}"


START_SLACK_S = 60.0
"""How much later than the lock's `started` its holder's process may seem to have started (the boot time Linux
reports is whole seconds, and the wall clock may have been adjusted since): a process started later than that is
another one that reuses the holder's pid."""


def _process_start(pid: int) -> float | None:
    """When process `pid` started, as a wall-clock time (Linux: its start in clock ticks since boot, plus the boot
    time); None where it cannot be read."""
    ticks = process_start_ticks(pid)
    if ticks is None:
        return None
    try:
        boot = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _alive(holder: Holder) -> bool:
    """Whether the process that took the lock still runs: its pid exists (an impossible pid, edited into the lock,
    is no process), and it started before the lock was taken (a later one reuses the pid)."""
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    except (OverflowError, ValueError, OSError):  # not a pid this system can have
        return False
    started = _process_start(holder.pid)
    return started is None or started <= holder.started + START_SLACK_S


def _read_holder(path: Path) -> Holder | None:
    try:
        holder = Holder(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):  # vanished meanwhile, or half written by a process that died
        return None
    valid = isinstance(holder.pid, int) and not isinstance(holder.pid, bool) and 0 < holder.pid < 2**31
    valid = valid and isinstance(holder.host, str) and isinstance(holder.started, int | float)
    valid = valid and not isinstance(holder.started, bool) and math.isfinite(holder.started)
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
            if holder is not None and _alive(holder):
                raise UserError(
                    f"work dir {work_dir} is in use by {holder.describe()}; wait for it to finish or use another "
                    f"--work-dir (if that process is not a tuneforge run in this work dir, delete {path})"
                ) from None
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            if holder is not None:
                note = f"work dir: took over the lock {path} left by {holder.describe()}, which is no longer running"
            else:
                note = (
                    f"work dir: took over the lock {path}, which names no running process (left by a process that "
                    "died while taking it, or edited)"
                )
    raise UserError(f"work dir {work_dir}: another run took the lock at the same moment; start again")


def lock_holder(work_dir: Path) -> tuple[bool | None, float | None]:
    """Whether a live process holds the work dir's lock (None: no lock, so no run yet or one that ended
    cleanly; False: its holder died, e.g. killed), and when it took the lock. A holder on another host is
    taken to be alive: its process cannot be asked from here."""
    holder = _read_holder(work_dir / LOCK_FILE)
    if holder is None:
        return None, None
    return holder.host != socket.gethostname() or _alive(holder), holder.started


def release_lock(work_dir: Path) -> None:
    path = work_dir / LOCK_FILE
    holder = _read_holder(path)
    if holder is not None and holder.pid == os.getpid() and holder.host == socket.gethostname():
        path.unlink(missing_ok=True)


def _present(work_dir: Path) -> list[str]:
    """Which of `RUN_OUTPUTS` are in `work_dir` (a link counts as there; an empty `checkpoints/` does not)."""
    found = [name for name in RUN_OUTPUTS if os.path.lexists(work_dir / name)]
    checkpoints = work_dir / CHECKPOINTS
    real = CHECKPOINTS in found and checkpoints.is_dir() and not checkpoints.is_symlink()
    if real and not any(checkpoints.iterdir()):
        found.remove(CHECKPOINTS)
    return found


def previous_outputs(work_dir: Path) -> list[str]:
    """The outputs in `work_dir` that make it another run's: a fresh run is refused there (or moves them aside
    with --archive-previous). Diagnostics, a reusable reference and the run record alone do not."""
    return [name for name in _present(work_dir) if name not in (DIAGNOSTICS, REFERENCE, RUN_FILE)]


def _shown(work_dir: Path, name: str) -> str:
    return f"{name}/" if (work_dir / name).is_dir() and not (work_dir / name).is_symlink() else name


def written_by_tuneforge(work_dir: Path) -> bool:
    """Whether a tuneforge run recorded itself in `work_dir`: its `run.json`, or (a run from before run records)
    the resolved `config.yaml` it wrote, which names every section of the config."""
    if os.path.lexists(work_dir / RUN_FILE):
        return True
    try:
        config = yaml.safe_load((work_dir / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return False
    from tuneforge.config.schema import Config

    return isinstance(config, dict) and set(Config.model_fields) <= set(config)


LINKS_REFUSED = (CONFIG, METRICS, SAMPLES, EVAL, PLOT, DIAGNOSTICS, RUN_FILE)
"""Files the run writes or replaces in its work dir: one that is a symbolic link (in a work dir someone handed
over) would be written through, outside the work dir. (`checkpoints/` may be a link to a bigger disk.)"""


def start_run(work_dir: Path, resume: str | None, archive: bool) -> tuple[str, str]:
    """This run's id, and a note. A fresh run into another run's outputs is refused (or archives them with
    `archive`); a resumed run keeps the id recorded in the work dir. Files that no tuneforge run recorded are
    never moved: a fresh run into them is refused, and so is a file the run writes that is a symbolic link."""
    linked = [name for name in LINKS_REFUSED if (work_dir / name).is_symlink()]
    if linked:
        raise UserError(
            f"work dir {work_dir}: {', '.join(f'{name} -> {os.readlink(work_dir / name)}' for name in linked)}: "
            "a run writes these itself and never through a symbolic link; remove the link(s), then start again"
        )
    record = work_dir / RUN_FILE
    if resume is not None and os.path.lexists(record):
        return _recorded_id(record), ""
    note = ""
    # A precomputed reference is checked when read: one copied in from another run is reused.
    foreign = [name for name in _present(work_dir) if name != REFERENCE]
    if foreign and resume is None and not written_by_tuneforge(work_dir):
        raise UserError(
            f"work dir {work_dir} holds {', '.join(_shown(work_dir, name) for name in foreign)}, but no tuneforge "
            f"run recorded itself there (no {RUN_FILE}): tuneforge neither writes into nor moves files it did not "
            "write. Train into another --work-dir, or move them away yourself"
        )
    found = previous_outputs(work_dir)
    if found and resume is None:
        moved = [name for name in RUN_OUTPUTS if os.path.lexists(work_dir / name)]
        listed = ", ".join(_shown(work_dir, name) for name in moved)
        if not archive:
            raise UserError(
                f"work dir {work_dir} holds another run's {', '.join(found)}; continue it with --resume auto, "
                "train into another --work-dir, or pass --archive-previous to move the old run "
                f"({listed}) to {work_dir / PREVIOUS_RUNS}/ and start afresh"
            )
        if (work_dir / PREVIOUS_RUNS).is_symlink():
            raise UserError(
                f"{work_dir / PREVIOUS_RUNS} is a symbolic link (to {os.readlink(work_dir / PREVIOUS_RUNS)}): "
                "--archive-previous moves the old run only within the work dir, never through a link; remove the "
                "link, then start again"
            )
        destination = work_dir / PREVIOUS_RUNS / time.strftime("%Y%m%d-%H%M%S")
        destination.mkdir(parents=True)
        for name in moved:
            shutil.move(str(work_dir / name), str(destination / name))
        note = f"work dir: the previous run's {listed} moved to {destination}"
    run_id = uuid.uuid4().hex[:12]
    written = record.with_name(record.name + ".tmp")
    written.unlink(missing_ok=True)  # never written through: a link there is replaced, not followed
    written.write_text(json.dumps({"run_id": run_id, "started": time.time()}), encoding="utf-8")
    written.replace(record)  # atomic: a reader sees the old record or the new one, never a part
    return run_id, note


def _recorded_id(record: Path) -> str:
    """The run id in `record` (run.json), or one message naming it when it is not tuneforge's record."""
    try:
        run_id = json.loads(record.read_text(encoding="utf-8"))["run_id"]
    except (OSError, ValueError, TypeError, KeyError, IndexError) as exc:
        reason = first_line(exc) if not isinstance(exc, KeyError | TypeError | IndexError) else "no run_id in it"
        run_id = None
    else:
        reason = f"run_id is {run_id!r}"
    if not isinstance(run_id, str) or not run_id:
        raise UserError(
            f'{record}: not a run record tuneforge wrote ({reason}; it holds {{"run_id": ...}}). Delete it to '
            "continue the newest checkpoint in this work dir with --resume auto, or train into another --work-dir"
        )
    return run_id


def recorded_run(work_dir: Path) -> str | None:
    record = work_dir / RUN_FILE
    return _recorded_id(record) if os.path.lexists(record) else None
