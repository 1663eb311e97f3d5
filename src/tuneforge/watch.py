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

    def over(self, now: float) -> bool:
        """The run ended: every rank said it finished, a diagnosis was written, or no rank beats any more."""
        if self.diagnosis is not None:
            return True
        if not self.ranks:
            return False
        if all(rank.get("finished") for rank in self.ranks):
            return True
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
    ranks = []
    for path in sorted((work_dir / "diagnostics" / "live").glob("rank-*.json")):
        try:
            beat = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):  # being replaced right now: the next refresh reads it
            continue
        numbers = ("updated", "limit_s")
        if isinstance(beat, dict) and all(isinstance(beat.get(key), (int, float)) for key in numbers):
            ranks.append(beat)  # anything else is no heartbeat of ours, and is left out
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
        if rank.get("finished"):
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
    elapsed = last.get("elapsed_s")
    if total and elapsed and last["step"] < total:
        parts.append(f"ETA {_duration(elapsed / last['step'] * (total - last['step']))}")
    text.append("  ".join(parts) + "\n")
    return text


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
        return 3 if view.diagnosis is not None else 0
    with Live(render(view), console=console, refresh_per_second=4, transient=False) as live:
        while not view.over(time.time()):
            time.sleep(interval_s)
            view = read_run(work_dir)
            live.update(render(view))
    return 3 if view.diagnosis is not None else 0
