"""`tuneforge diagnose`: the last report again, or a live dump of a running job without stopping it.

What it prints comes from files anyone who can write into the work dir may have written: it goes out through
`safe_text` (no terminal control), and a rank's file holding a field of a type the watchdog never writes is
named in a one-line error instead of a traceback from the report."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from tuneforge.diagnostics.files import STOPPED, black_box_file
from tuneforge.diagnostics.recorder import read_black_box
from tuneforge.diagnostics.report import REPORT, build_report
from tuneforge.errors import UserError
from tuneforge.run_files import RunFiles
from tuneforge.terminal import safe_text

MAX_WORLD_SIZE = 1 << 16
"""More ranks than this is no world size a heartbeat holds (and would have the report read that many files)."""
MAX_PID = (1 << 31) - 1
TEXT_FIELDS = ("host", "phase", "module", "where", "in_flight", "detail", "reason", "outcome")
COUNT_FIELDS = ("rank", "world_size", "pid_started", "step", "total_steps", "micro_step", "micro_steps")
NUMBER_FIELDS = ("updated", "limit_s", "idle_s")


def _shown(value: object, limit: int = 60) -> str:
    """A value from a file, quoted in a message."""
    text = safe_text(repr(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _record_problem(record: object) -> str | None:
    """What is wrong with one recorded collective, as the report reads it; None if nothing."""
    if not isinstance(record, dict):
        return "is not an object"
    shapes, dtypes = record.get("shapes"), record.get("dtypes")
    if not _is_count(record.get("seq")):
        return f"has seq {_shown(record.get('seq'))}, not a whole number"
    if not all(isinstance(record.get(key), str) for key in ("op", "module", "phase")):
        return "lacks the text of op, module or phase"
    if not isinstance(record.get("site", ""), str):
        return f"has site {_shown(record.get('site'))}, not text"
    if not isinstance(shapes, list) or not all(isinstance(s, list) and all(map(_is_count, s)) for s in shapes):
        return f"has shapes {_shown(shapes)}, not lists of sizes"
    if not isinstance(dtypes, list) or not all(isinstance(d, str) for d in dtypes):
        return f"has dtypes {_shown(dtypes)}, not a list of names"
    return None


def _field_problem(key: str, value: object) -> str | None:
    if value is None:
        return None
    if key in TEXT_FIELDS and not isinstance(value, str):
        return f'"{key}" is {_shown(value)}, not text'
    if key in COUNT_FIELDS and not _is_count(value):
        return f'"{key}" is {_shown(value)}, not a whole number'
    if key == "pid" and not (_is_count(value) and 0 < value <= MAX_PID):
        return f'"pid" is {_shown(value)}, not a process id'
    if key in NUMBER_FIELDS and not _is_number(value):
        return f'"{key}" is {_shown(value)}, not a finite number'
    if key == "collectives":
        if not isinstance(value, list):
            return f'"collectives" is {_shown(value)}, not a list'
        for record in value:
            if (problem := _record_problem(record)) is not None:
                return f'"collectives" holds a record that {problem}'
    return None


def _refuse(path: Path, problem: str) -> UserError:
    return UserError(f"{path}: {problem}; tuneforge did not write it this way (move it away and diagnose again)")


def _read_object(path: Path) -> dict | None:
    """A JSON object from `path`, whatever its fields hold; None for anything else."""
    try:
        data = json.loads(path.read_bytes()) if path.is_file() else None
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _read_state(path: Path, heartbeat: bool = False) -> dict | None:
    """A rank's dump or heartbeat as the report will read it (None: absent or not JSON, which it leaves out);
    refused with a one-line error when a field it reads has a type the watchdog never writes."""
    try:
        if not path.is_file():  # absent, or no file a rank writes (a FIFO would block)
            return None
        state = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    except RecursionError:  # the report's reader would end on it too
        raise _refuse(path, "holds JSON nested too deep to read") from None
    if not isinstance(state, dict):
        raise _refuse(path, f"holds {_shown(state)}, not a JSON object")
    required = ("updated", "pid") if heartbeat else ()
    for key in required:
        if key not in state:
            raise _refuse(path, f'no "{key}"')
    for key, value in state.items():
        if (problem := _field_problem(key, value)) is not None:
            raise _refuse(path, problem)
    return state


def _world_size(diagnostics: Path) -> int:
    sizes = set()
    for path in sorted((diagnostics / "live").glob("rank-*.json")):
        state = _read_state(path, heartbeat=True)
        size = state.get("world_size") if state is not None else None
        if size is not None and not 1 <= size <= MAX_WORLD_SIZE:
            raise _refuse(path, f'"world_size" is {size}, not a number of ranks')
        if size is not None:
            sizes.add(size)
    if not sizes:
        raise UserError(f"{diagnostics}: no heartbeats; was this work dir used by a tuneforge train run?")
    return max(sizes)


def _check_rank_files(diagnostics: Path, world_size: int) -> list[dict | None]:
    """Every file the report reads of each rank, checked; the ranks' heartbeats."""
    beats = []
    for rank in range(world_size):
        _read_state(diagnostics / f"rank-{rank}.json")
        beats.append(_read_state(diagnostics / "live" / f"rank-{rank}.json", heartbeat=True))
        in_flight = read_black_box(black_box_file(diagnostics, rank))
        if in_flight is not None and (problem := _record_problem(in_flight)) is not None:
            raise _refuse(black_box_file(diagnostics, rank), f"its collective {problem}")
    return beats


def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def last_report(work_dir: Path) -> str:
    """The report written when the run stopped, or one built now from its dumps and heartbeats: text safe to
    print."""
    return safe_text(_last_report(work_dir))


def _last_report(work_dir: Path) -> str:
    diagnostics = RunFiles(work_dir).diagnostics
    if (diagnostics / REPORT).is_file():
        return _read_text(diagnostics / REPORT).rstrip()
    if not diagnostics.exists():
        raise UserError(f"{work_dir}: no diagnostics/ directory; pass the work dir of a tuneforge train run")
    if (diagnostics / STOPPED).is_file():
        stopped = _read_text(diagnostics / STOPPED).strip()
        return f"tuneforge diagnosis: no hang: the ranks {stopped}; continue with --resume auto"
    world_size = _world_size(diagnostics)
    beats = _check_rank_files(diagnostics, world_size)
    if all(beat is not None and beat.get("finished") for beat in beats):
        return _ended_without_a_stall(work_dir, [beat for beat in beats if beat is not None])
    return build_report(diagnostics, world_size)


def _ended_without_a_stall(work_dir: Path, beats: list[dict]) -> str:
    """Every rank stopped its watchdog itself: the run finished, or ended on an error it reported."""
    from tuneforge.train.checkpoint import step_checkpoints

    step = max(beat.get("step") or 0 for beat in beats)
    total = beats[0].get("total_steps")
    final = RunFiles(work_dir).checkpoints / "final"
    steps = step_checkpoints(RunFiles(work_dir).checkpoints)
    newest = f"the newest step checkpoint is {steps[-1][1]}" if steps else "no step checkpoint was kept"
    if total is not None and step >= total:
        kept = f"its final checkpoint is {final}" if final.exists() else f"no final checkpoint was saved; {newest}"
        return f"tuneforge diagnosis: no hang: the run finished all {total} steps; {kept}"
    of = f" of {total}" if total is not None else ""
    return (
        f"tuneforge diagnosis: no hang: the run ended at step {step}{of} without a stall or a failed collective "
        f"(every rank stopped its watchdog itself, as on an error the run's output names); {newest}, and "
        "--resume auto continues from it"
    )


def _field(state: dict, key: str, empty: str = "?") -> str:
    """One field of a rank's live dump, on one line."""
    value = state.get(key)
    return empty if value is None or value == "" else safe_text(value).replace("\n", "\\n")


def _answer(rank: int, state: dict) -> str:
    waiting = f", waiting in {_field(state, 'in_flight')}" if state.get("in_flight") else ""
    idle = state.get("idle_s")
    idle_text = f"{idle:.1f}s" if _is_number(idle) else "?"
    return (
        f"  rank {rank}: phase {_field(state, 'phase')}, step {_field(state, 'step')}, module "
        f"{_field(state, 'module', '-')}, at {_field(state, 'where')}{waiting}; idle {idle_text}"
    )


def live_dump(work_dir: Path, timeout_s: float = 10.0) -> str:
    """Ask every rank's watchdog thread (it runs even when the main thread is blocked) to dump its stacks and
    collectives; wait for the answers; summarise where each rank is, as text safe to print."""
    diagnostics = RunFiles(work_dir).diagnostics
    world_size = _world_size(diagnostics)
    request = diagnostics / "live" / "request"
    request.write_text(str(time.time()))
    asked = request.stat().st_mtime
    deadline = time.monotonic() + timeout_s
    answered: set[int] = set()
    while time.monotonic() < deadline and len(answered) < world_size:
        for rank in range(world_size):
            mark = diagnostics / "live" / f"answered-rank-{rank}"
            if mark.exists() and mark.stat().st_mtime >= asked:
                answered.add(rank)
        time.sleep(0.2)
    lines = [f"live dump of {work_dir} ({len(answered)}/{world_size} ranks answered):"]
    for rank in range(world_size):
        # Only shown, each field as text: a field of another type shows as such.
        state = _read_object(diagnostics / f"live-{rank}.json") if rank in answered else None
        if state is None:
            heartbeat = _read_object(diagnostics / "live" / f"rank-{rank}.json") or {}
            lines.append(f"  rank {rank}: no answer (last heartbeat: {json.dumps(heartbeat.get('phase'))})")
            continue
        lines.append(_answer(rank, state))
    lines.append(f"stacks: {diagnostics}/stacks-live-*.txt")
    return safe_text("\n".join(lines))
