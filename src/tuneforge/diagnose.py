"""`tuneforge diagnose`: the last report again, or a live dump of a running job without stopping it."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tuneforge.diagnostics.files import STOPPED, read_json
from tuneforge.diagnostics.report import REPORT, build_report
from tuneforge.errors import UserError


def _world_size(diagnostics: Path) -> int:
    states = [read_json(p) for p in (diagnostics / "live").glob("rank-*.json")]
    sizes = {s["world_size"] for s in states if s}
    if not sizes:
        raise UserError(f"{diagnostics}: no heartbeats; was this work dir used by a tuneforge train run?")
    return max(sizes)


def last_report(work_dir: Path) -> str:
    """The report written when the run stopped, or one built now from its dumps and heartbeats."""
    diagnostics = work_dir / "diagnostics"
    if (diagnostics / REPORT).exists():
        return (diagnostics / REPORT).read_text().rstrip()
    if not diagnostics.exists():
        raise UserError(f"{work_dir}: no diagnostics/ directory; pass the work dir of a tuneforge train run")
    if (diagnostics / STOPPED).exists():
        stopped = (diagnostics / STOPPED).read_text().strip()
        return f"tuneforge diagnosis: no hang: the ranks {stopped}; continue with --resume auto"
    world_size = _world_size(diagnostics)
    beats = [read_json(diagnostics / "live" / f"rank-{rank}.json") for rank in range(world_size)]
    if all(beat is not None and beat.get("finished") for beat in beats):
        return _ended_without_a_stall(work_dir, beats)
    return build_report(diagnostics, world_size)


def _ended_without_a_stall(work_dir: Path, beats: list[dict]) -> str:
    """Every rank stopped its watchdog itself: the run finished, or ended on an error it reported."""
    from tuneforge.train.checkpoint import step_checkpoints

    step = max(beat["step"] for beat in beats)
    total = beats[0].get("total_steps")
    final = work_dir / "checkpoints" / "final"
    steps = step_checkpoints(work_dir / "checkpoints")
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


def live_dump(work_dir: Path, timeout_s: float = 10.0) -> str:
    """Ask every rank's watchdog thread (it runs even when the main thread is blocked) to dump its stacks and
    collectives; wait for the answers; summarise where each rank is."""
    diagnostics = work_dir / "diagnostics"
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
        state = read_json(diagnostics / f"live-{rank}.json") if rank in answered else None
        if state is None:
            heartbeat = read_json(diagnostics / "live" / f"rank-{rank}.json") or {}
            lines.append(f"  rank {rank}: no answer (last heartbeat: {json.dumps(heartbeat.get('phase'))})")
            continue
        waiting = f", waiting in {state['in_flight']}" if state.get("in_flight") else ""
        lines.append(
            f"  rank {rank}: phase {state['phase']}, step {state['step']}, module {state['module'] or '-'}, "
            f"at {state['where']}{waiting}; idle {state['idle_s']:.1f}s"
        )
    lines.append(f"stacks: {diagnostics}/stacks-live-*.txt")
    return "\n".join(lines)
