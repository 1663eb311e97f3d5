"""`tuneforge watch WORK_DIR`: a live view of a run from its work dir alone (another terminal, or another node
on a shared filesystem): each rank's phase, step and heartbeat age against the stall timeout, the loss and
learning-rate curves as sparklines, throughput, memory, ETA, the last sample chat, and the diagnosis as soon
as one is written. It reads only the files the run writes (`diagnostics/live/rank-N.json`, `metrics.jsonl`,
`samples.jsonl`, `diagnostics/report.txt`), so watching never disturbs the run."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from tuneforge.diagnostics.report import REPORT
from tuneforge.errors import UserError
from tuneforge.train.workdir import lock_holder

BARS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 60
STALE_AFTER_S = 60.0
"""A heartbeat this much older than its stall timeout: the rank is gone (no diagnosis will come from it)."""


@dataclass
class RunView:
    work_dir: Path
    started: float | None
    ranks: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    diagnosis: str | None = None
    locked: bool | None = None
    """A live process holds the work dir's lock (None: no lock; False: its holder died)."""

    @property
    def failed(self) -> bool:
        """A rank ended with an error (its last heartbeat says so)."""
        return any(rank.get("finished") and rank.get("outcome") == "failed" for rank in self.ranks)

    def over(self, now: float) -> bool:
        """The run ended: a diagnosis was written, the process holding the work dir died, every rank said it
        ended, the lock was released after the run logged (a run without heartbeats: watchdog off), or no rank
        beats any more."""
        if self.diagnosis is not None or self.locked is False:
            return True
        if self.ranks and all(rank.get("finished") for rank in self.ranks):
            return True
        if not self.ranks:
            return self.locked is None and bool(self.metrics)
        return all(now - rank["updated"] > rank.get("limit_s", 0) + STALE_AFTER_S for rank in self.ranks)


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """Whole lines only: the last one may be half-written while the run appends."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def read_run(work_dir: Path) -> RunView:
    if not work_dir.is_dir():
        raise UserError(f"{work_dir}: no such work dir; give the run's --work-dir (default work_dirs/CONFIG_NAME)")
    try:
        record = json.loads((work_dir / "run.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        record = None
    started = record.get("started") if isinstance(record, dict) else None
    started = started if isinstance(started, (int, float)) else None
    locked, attempt_started = lock_holder(work_dir)
    # Heartbeats older than this attempt are a previous one's (e.g. ranks a resumed run no longer has).
    oldest = attempt_started if attempt_started is not None else started
    ranks = []
    for path in sorted((work_dir / "diagnostics" / "live").glob("rank-*.json")):
        try:
            beat = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):  # being replaced right now: the next refresh reads it
            continue
        numbers = ("updated", "limit_s")
        ours = isinstance(beat, dict) and all(isinstance(beat.get(key), (int, float)) for key in numbers)
        if ours and (oldest is None or beat["updated"] >= oldest):
            ranks.append(beat)  # anything else is no heartbeat of ours (or this run's), and is left out
    report = work_dir / "diagnostics" / REPORT
    diagnosis = None
    if report.is_file() and (started is None or report.stat().st_mtime >= started):
        diagnosis = report.read_text(encoding="utf-8", errors="replace")
    return RunView(
        work_dir=work_dir,
        started=started,
        ranks=sorted(ranks, key=lambda rank: str(rank.get("rank", 0))),
        metrics=[
            row
            for row in _json_lines(work_dir / "metrics.jsonl")
            if isinstance(row, dict) and isinstance(row.get("loss"), (int, float)) and isinstance(row.get("step"), int)
        ],
        samples=[row for row in _json_lines(work_dir / "samples.jsonl") if isinstance(row, dict)],
        diagnosis=diagnosis,
        locked=locked,
    )


def sparkline(values: list[float], width: int = SPARK_WIDTH) -> str:
    """The last `width` values (averaged into `width` buckets when more) as bar characters, low to high."""
    values = [v for v in values if v == v]  # NaN (a skipped step) draws nothing
    if not values:
        return ""
    if len(values) > width:
        size = len(values) / width
        values = [
            sum(values[int(i * size) : int((i + 1) * size)]) / len(values[int(i * size) : int((i + 1) * size)])
            for i in range(width)
        ]
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(BARS[min(len(BARS) - 1, int((v - low) / span * len(BARS)))] for v in values)


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def ranks_table(view: RunView, now: float) -> Table:
    table = Table(title="ranks", title_justify="left", expand=False)
    for column in ("rank", "host", "phase", "step", "heartbeat", "state"):
        table.add_column(column)
    for rank in view.ranks:
        age, limit = now - rank["updated"], rank.get("limit_s", 0.0)
        if rank.get("finished") and rank.get("outcome") == "failed":
            state, style = "ended with an error", "bold red"
        elif rank.get("finished"):
            state, style = "finished", "green"
        elif age > limit:
            state, style = "stalled: past the stall timeout", "bold red"
        elif age > limit / 2:
            state, style = "slow: past half the stall timeout", "yellow"
        else:
            state, style = "running", "green"
        step = f"{rank.get('step', 0)}/{rank.get('total_steps') or '?'}"
        if rank.get("micro_steps", 1) > 1:
            step += f" ({rank.get('micro_step', 0)}/{rank['micro_steps']})"
        table.add_row(
            str(rank.get("rank", "?")),
            str(rank.get("host", "")),
            str(rank.get("phase", "")),
            step,
            f"{_duration(age)} ago / {_duration(limit)} limit",
            Text(state, style=style),
        )
    return table


def progress_lines(view: RunView, now: float) -> Text:
    text = Text()
    if not view.metrics:
        text.append("no optimizer step logged yet\n", style="dim")
        return text
    last = view.metrics[-1]
    total = max((rank.get("total_steps") or 0 for rank in view.ranks), default=0)
    losses = [row["loss"] for row in view.metrics]
    text.append(f"loss {last['loss']:.4f}  ", style="bold")
    text.append(sparkline(losses) + "\n", style="cyan")
    text.append(f"lr   {last.get('lr', 0):.2e}  ")
    text.append(sparkline([row.get("lr", 0.0) for row in view.metrics]) + "\n", style="magenta")
    parts = [f"step {last['step']}" + (f"/{total}" if total else "")]
    if "tokens_per_s" in last:
        parts.append(f"{last['tokens_per_s']:,.0f} tok/s")
    if "peak_memory_gb" in last:
        parts.append(f"mem {last['peak_memory_gb']:.1f} GB")
    if "val_loss" in (validated := next((r for r in reversed(view.metrics) if "val_loss" in r), {})):
        parts.append(f"val_loss {validated['val_loss']:.4f} (step {validated['step']})")
    if total and last["step"] < total and (per_step := seconds_per_step(view.metrics)) is not None:
        parts.append(f"ETA {_duration(per_step * (total - last['step']))}")
    text.append("  ".join(parts) + "\n")
    return text


RECENT_STEPS = 20
"""The ETA's pace: the latest logged steps, not the whole run (early steps compile and warm up)."""


def seconds_per_step(metrics: list[dict[str, Any]]) -> float | None:
    """The recent pace, from the logged rows of the latest attempt only: `elapsed_s` counts from each attempt's
    start, so a resumed run's rows begin again near zero."""
    rows = [row for row in metrics if isinstance(row.get("elapsed_s"), (int, float))]
    attempt = rows[-1:]
    for row in reversed(rows[:-1]):
        if (
            len(attempt) > RECENT_STEPS
            or row["elapsed_s"] >= attempt[0]["elapsed_s"]
            or row["step"] >= attempt[0]["step"]
        ):
            break
        attempt.insert(0, row)
    if len(attempt) >= 2:
        return (attempt[-1]["elapsed_s"] - attempt[0]["elapsed_s"]) / (attempt[-1]["step"] - attempt[0]["step"])
    if attempt and attempt[0]["step"] > 0 and not any(row["step"] < attempt[0]["step"] for row in rows[:-1]):
        return attempt[0]["elapsed_s"] / attempt[0]["step"]  # the first logged step of a fresh run
    return None


def render(view: RunView, now: float | None = None) -> RenderableType:
    now = time.time() if now is None else now
    parts: list[RenderableType] = [Text(f"tuneforge watch {view.work_dir}", style="bold")]
    if view.ranks:
        parts.append(ranks_table(view, now))
    else:
        parts.append(Text("no rank has written a heartbeat yet (starting up)", style="dim"))
    parts.append(progress_lines(view, now))
    if view.samples:
        last_step = view.samples[-1].get("step")
        chats = [s for s in view.samples if s.get("step") == last_step]
        body = "\n".join(f"{s.get('prompt', '')!r} -> {s.get('reply', '')!r}" for s in chats)
        parts.append(Panel(body, title=f"sample chat at step {last_step}", title_align="left"))
    if view.diagnosis is not None:
        parts.append(Panel(view.diagnosis.rstrip(), title="diagnosis", title_align="left", border_style="red"))
    elif view.failed or view.locked is False:
        parts.append(Text("the run has ended with an error: see its terminal output", style="bold red"))
    elif view.over(now):
        parts.append(Text("the run has ended", style="bold green"))
    return Group(*parts)


def watch(work_dir: Path, interval_s: float = 1.0, once: bool = False) -> int:
    """Refresh until the run ends; 3 when it ended with a diagnosis (the launcher's exit status for a hang),
    0 otherwise."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    view = read_run(work_dir)
    if once:
        console.print(render(view))
        return _status(view)
    with Live(render(view), console=console, refresh_per_second=4, transient=False) as live:
        while not view.over(time.time()):
            time.sleep(interval_s)
            view = read_run(work_dir)
            live.update(render(view))
    return _status(view)


def _status(view: RunView) -> int:
    """The launcher's statuses: 3 after a diagnosis (a hang), 1 after an error, 0 otherwise."""
    if view.diagnosis is not None:
        return 3
    return 1 if view.failed or view.locked is False else 0
