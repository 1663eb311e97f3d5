"""`tuneforge watch WORK_DIR`: a live view of a run from its work dir alone (another terminal, or another node
on a shared filesystem): each rank's phase, step and heartbeat age against the stall timeout, the loss and
learning-rate curves as sparklines, throughput, memory, ETA, the last sample chat, and the diagnosis as soon
as one is written. It reads only the files the run writes (`diagnostics/live/rank-N.json`, `metrics.jsonl`,
`samples.jsonl`, `diagnostics/report.txt`), so watching never disturbs the run.

Whoever can write into a shared work dir writes what this view shows: every string read from a run's files is
data, shown as rich `Text` (never markup) after `safe_text`, and every number is checked to be one. The two
JSON-lines files are read incrementally into bounded state, so a long run's view stays small and quick."""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISREG
from typing import BinaryIO, Generic, Protocol, TypeVar

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from tuneforge.errors import UserError
from tuneforge.run_files import METRICS, RUN_FILE, SAMPLES, RunFiles, step_record
from tuneforge.terminal import safe_text
from tuneforge.train.workdir import lock_holder

BARS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 60
STALE_AFTER_S = 60.0
"""A heartbeat this much older than its stall timeout: the rank is gone (no diagnosis will come from it)."""
WAIT_FOR_RUN_S = 300.0
"""How long a watch started before its run waits for the work dir to hold one (`--once` does not wait)."""
MAX_LINE_BYTES = 1 << 20
"""A JSON line longer than this is no record a run writes: it is counted as left out, never held in memory."""
MAX_REPORT_BYTES = 64 << 10
MAX_CHATS = 10
FIELD_CHARS = 80
CHAT_CHARS = 500
RECENT_STEPS = 20
"""The ETA's pace: the latest logged steps, not the whole run (early steps compile and warm up)."""


def _one_line(value: object, limit: int = FIELD_CHARS) -> str:
    """A field shown on one line of a table or title: newlines made visible, cut to `limit` characters."""
    text = safe_text(value).replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _text_field(value: object) -> str:
    return "" if value is None else _one_line(value)


def _number(value: object) -> float | None:
    """A JSON number as a float (NaN and infinities too); None for anything else, booleans included."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def _finite(value: object) -> float | None:
    number = _number(value)
    return number if number is not None and math.isfinite(number) else None


def _count(value: object) -> int | None:
    """A whole number from 0 up (a step, a rank), or None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


@dataclass(frozen=True)
class Beat:
    """A rank's last heartbeat (`diagnostics/live/rank-N.json`): the fields watch shows, typed."""

    label: str
    host: str
    phase: str
    step: int | None
    total_steps: int | None
    micro_step: int | None
    micro_steps: int | None
    updated: float
    limit_s: float
    finished: bool
    failed: bool
    order: tuple[int, int, str]

    @classmethod
    def parse(cls, data: object) -> Beat | None:
        """None for what is no heartbeat of ours: one needs a finite `updated` and `limit_s`."""
        if not isinstance(data, dict):
            return None
        updated, limit = _finite(data.get("updated")), _finite(data.get("limit_s"))
        if updated is None or limit is None or limit < 0:
            return None
        rank = data.get("rank")
        label = "?" if rank is None else _one_line(rank)
        number = _count(rank)
        finished = data.get("finished") is True
        return cls(
            label=label,
            host=_text_field(data.get("host")),
            phase=_text_field(data.get("phase")),
            step=_count(data.get("step", 0)),
            total_steps=_count(data.get("total_steps")),
            micro_step=_count(data.get("micro_step", 0)),
            micro_steps=_count(data.get("micro_steps")),
            updated=updated,
            limit_s=limit,
            finished=finished,
            failed=finished and data.get("outcome") == "failed",
            order=(0, number, "") if number is not None else (1, 0, label),
        )

    def stale(self, now: float) -> bool:
        """Past its stall timeout by STALE_AFTER_S: the rank stopped beating, so no diagnosis comes from it."""
        return now - self.updated > self.limit_s + STALE_AFTER_S


@dataclass(frozen=True)
class Step:
    """A step record of `metrics.jsonl`: the fields watch shows, typed (None: absent, or not a number)."""

    step: int
    loss: float
    lr: float | None = None
    elapsed_s: float | None = None
    tokens_per_s: float | None = None
    peak_memory_gb: float | None = None
    val_loss: float | None = None

    @classmethod
    def parse(cls, data: object) -> Step | None:
        if not isinstance(data, dict):
            return None
        step, loss = _count(data.get("step")), _number(data.get("loss"))
        if step is None or loss is None:
            return None
        return cls(
            step,
            loss,
            _number(data.get("lr")),
            _finite(data.get("elapsed_s")),
            _number(data.get("tokens_per_s")),
            _number(data.get("peak_memory_gb")),
            _number(data.get("val_loss")),
        )


class Curve:
    """A whole run's curve in bounded memory: its values averaged into at most 2 * `width` buckets of equal
    size, neighbours merged (the size doubled) as the run grows."""

    def __init__(self, width: int = SPARK_WIDTH):
        self.limit = 2 * width
        self.size = 1
        self.sums: list[float] = []
        self.counts: list[int] = []

    def add(self, value: float | None) -> None:
        if value is None or not math.isfinite(value):  # a skipped step (NaN) draws nothing
            return
        if self.counts and self.counts[-1] < self.size:
            self.sums[-1] += value
            self.counts[-1] += 1
        else:
            self.sums.append(value)
            self.counts.append(1)
        if len(self.sums) > self.limit:
            self.sums = [sum(self.sums[i : i + 2]) for i in range(0, len(self.sums), 2)]
            self.counts = [sum(self.counts[i : i + 2]) for i in range(0, len(self.counts), 2)]
            self.size *= 2

    def values(self) -> list[float]:
        return [total / count for total, count in zip(self.sums, self.counts, strict=True)]


UNREADABLE = object()
"""A line that is not JSON (cut off, not UTF-8, nested too deep, too long)."""


class Records(Protocol):
    left_out: int

    def take(self, record: object) -> None: ...


@dataclass
class Progress:
    """What watch keeps of `metrics.jsonl`: bounded however long the run."""

    rows: int = 0
    left_out: int = 0
    """Lines that are no step record (not JSON, not an object, no integer step and numeric loss)."""
    last: Step | None = None
    last_val: Step | None = None
    loss: Curve = field(default_factory=Curve)
    lr: Curve = field(default_factory=Curve)
    recent: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS + 1))
    """(step, elapsed_s) of the latest timed rows: the ETA's window."""
    lowest_earlier: int | None = None
    """The lowest step of the timed rows that left `recent`."""

    def take(self, record: object) -> None:
        row = Step.parse(record)
        if row is None:
            self.left_out += 1
            return
        self.rows += 1
        self.last = row
        if row.val_loss is not None:
            self.last_val = row
        self.loss.add(row.loss)
        self.lr.add(row.lr)
        if row.elapsed_s is not None:
            if len(self.recent) == self.recent.maxlen:
                dropped = self.recent[0][0]
                self.lowest_earlier = dropped if self.lowest_earlier is None else min(self.lowest_earlier, dropped)
            self.recent.append((row.step, row.elapsed_s))

    def seconds_per_step(self) -> float | None:
        return seconds_per_step(list(self.recent), self.lowest_earlier)


@dataclass
class Chats:
    """The sample chats of the latest step in `samples.jsonl` (MAX_CHATS of them kept, the rest counted)."""

    seen: bool = False
    step: object = None
    chats: list[tuple[str, str]] = field(default_factory=list)
    more: int = 0
    left_out: int = 0

    def take(self, record: object) -> None:
        if not isinstance(record, dict):
            self.left_out += 1
            return
        step = record.get("step")
        if not self.seen or step != self.step:
            self.seen, self.step, self.chats, self.more = True, step, [], 0
        if len(self.chats) < MAX_CHATS:
            self.chats.append((_chat_text(record.get("prompt", "")), _chat_text(record.get("reply", ""))))
        else:
            self.more += 1


def _chat_text(value: object) -> str:
    # repr: quoted as the run's own log shows it, with its line breaks written out.
    return _one_line(repr(value), CHAT_CHARS)


R = TypeVar("R", bound=Records)


class Tail(Generic[R]):
    """The records appended to a JSON-lines file since the last refresh, from where that one stopped: whole
    lines only (the last may be half-written). A file that shrank or was replaced (a fresh run's, an archived
    run's) is read again from its start into fresh records."""

    def __init__(self, path: Path, records: Callable[[], R]):
        self.path = path
        self.make = records
        self.records = records()
        self.identity: tuple[int, int] | None = None
        self.offset = 0
        self.skipping = False
        """Inside a line longer than MAX_LINE_BYTES (already counted)."""

    def refresh(self) -> R:
        try:
            stat = self.path.stat()
        except OSError:  # not written yet, or moved away: keep what was read until another one appears
            return self.records
        if not S_ISREG(stat.st_mode):  # a FIFO or a device would block the view or never end
            return self.records
        identity = (stat.st_dev, stat.st_ino)
        if identity != self.identity or stat.st_size < self.offset:
            self.identity, self.offset, self.skipping, self.records = identity, 0, False, self.make()
        if stat.st_size > self.offset:
            try:
                with self.path.open("rb") as handle:
                    handle.seek(self.offset)
                    self._read(handle)
            except OSError:  # vanished meanwhile: the next refresh sees what replaced it
                pass
        return self.records

    def _read(self, handle: BinaryIO) -> None:
        while True:
            line = handle.readline(MAX_LINE_BYTES + 1)
            if not line.endswith(b"\n") and len(line) <= MAX_LINE_BYTES:
                return  # the end, or a line still being written: the next refresh reads it whole
            self.offset += len(line)
            if not line.endswith(b"\n"):  # too long to be a record: skipped to its end, counted once
                if not self.skipping:
                    self.records.take(UNREADABLE)
                self.skipping = True
            elif self.skipping:
                self.skipping = False
            elif line.strip():  # a blank line is no record, nor a damaged one
                record = step_record(line)  # the rule every reader of a run's logs applies
                self.records.take(UNREADABLE if record is None else record)


def _parse(line: bytes) -> object:
    try:
        return json.loads(line.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):
        return UNREADABLE


@dataclass
class RunView:
    work_dir: Path
    started: float | None
    ranks: list[Beat] = field(default_factory=list)
    progress: Progress = field(default_factory=Progress)
    chats: Chats = field(default_factory=Chats)
    diagnosis: str | None = None
    locked: bool | None = None
    """A live process holds the work dir's lock (None: no lock; False: its holder died)."""
    foreign: list[str] = field(default_factory=list)
    """Names of `rank-*.json` files that are no heartbeat (left out)."""

    @property
    def failed(self) -> bool:
        """A rank ended with an error (its last heartbeat says so)."""
        return any(rank.failed for rank in self.ranks)

    def over(self, now: float) -> bool:
        """The run ended: a diagnosis was written, the process holding the work dir died, every rank said it
        ended, the lock was released after the run logged (a run without heartbeats: watchdog off), or every
        rank that did not say it ended stopped beating."""
        if self.diagnosis is not None or self.locked is False:
            return True
        if self.ranks and all(rank.finished for rank in self.ranks):
            return True
        if not self.ranks:
            return self.locked is None and self.progress.last is not None
        return all(rank.finished or rank.stale(now) for rank in self.ranks)

    def vanished(self, now: float) -> list[Beat]:
        """Ranks that stopped beating without saying they ended (killed, or their node went down)."""
        return [rank for rank in self.ranks if not rank.finished and rank.stale(now)]

    def status(self, now: float) -> int:
        """The launcher's statuses: 3 after a diagnosis (a hang), 1 after an error or ranks that vanished,
        0 otherwise."""
        if self.diagnosis is not None:
            return 3
        if self.failed or self.locked is False or (self.over(now) and self.vanished(now)):
            return 1
        return 0


def _missing(work_dir: Path) -> str:
    return f"{work_dir}: no such work dir; give the run's --work-dir (default work_dirs/CONFIG_NAME)"


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:
        return False


def _no_run(work_dir: Path) -> str | None:
    """Why `work_dir` holds no run to watch (yet), or None when it does."""
    try:
        if not work_dir.is_dir():
            return _missing(work_dir)
        beats = any(RunFiles(work_dir).live.glob("rank-*.json"))
    except OSError as exc:
        return f"{work_dir}: cannot be read ({exc.strerror or exc})"
    files = RunFiles(work_dir)
    if beats or any(_exists(path) for path in (files.record, files.lock, files.metrics, files.report)):
        return None
    return (
        f"{work_dir}: not a run's work dir (no {RUN_FILE}, {METRICS}, heartbeat or lock in it); give the run's "
        "--work-dir (default work_dirs/CONFIG_NAME)"
    )


def _read_small(path: Path, limit: int) -> bytes | None:
    """The first `limit` bytes and one more of a regular file; None for anything else (a FIFO would block the
    view, a device never end) or when it cannot be read now (being replaced)."""
    try:
        if not path.is_file():
            return None
        with path.open("rb") as handle:
            return handle.read(limit + 1)
    except OSError:
        return None


def _read_json(path: Path) -> object:
    """The JSON in `path`; None when it cannot be read now, UNREADABLE when it is no JSON (or too long)."""
    data = _read_small(path, MAX_LINE_BYTES)
    if data is None:
        return None
    return _parse(data) if len(data) <= MAX_LINE_BYTES else UNREADABLE


def _run_started(work_dir: Path) -> float | None:
    record = _read_json(RunFiles(work_dir).record)
    return _finite(record.get("started")) if isinstance(record, dict) else None


def _lock(work_dir: Path) -> tuple[bool | None, float | None]:
    try:
        locked, started = lock_holder(work_dir)
    except (OverflowError, ValueError):  # a pid no process can have: no lock tuneforge wrote
        return None, None
    return locked, _finite(started)


def _heartbeats(work_dir: Path, oldest: float | None) -> tuple[list[Beat], list[str]]:
    """This attempt's heartbeats, and the names of files there that are none."""
    beats, foreign = [], []
    for path in sorted(RunFiles(work_dir).live.glob("rank-*.json")):
        data = _read_json(path)
        if data is None:  # being replaced right now: the next refresh reads it
            continue
        beat = Beat.parse(data)
        if beat is None:
            foreign.append(path.name)
        elif oldest is None or beat.updated >= oldest:
            beats.append(beat)  # older ones are a previous attempt's (ranks a resumed run no longer has)
    return sorted(beats, key=lambda beat: beat.order), foreign


def _diagnosis(work_dir: Path, started: float | None) -> str | None:
    report = RunFiles(work_dir).report
    try:
        if started is not None and report.stat().st_mtime < started:
            return None  # a previous run's
    except OSError:
        return None
    data = _read_small(report, MAX_REPORT_BYTES)
    if data is None:
        return None
    text = data[:MAX_REPORT_BYTES].decode("utf-8", errors="replace")
    return text + (f"\n... (cut here: the whole report is {report})" if len(data) > MAX_REPORT_BYTES else "")


class RunReader:
    """Reads a work dir at each refresh: heartbeats, lock and report anew, the JSON-lines files incrementally."""

    def __init__(self, work_dir: Path):
        self.work_dir = work_dir
        files = RunFiles(work_dir)
        self.metrics = Tail(files.metrics, Progress)
        self.samples = Tail(files.samples, Chats)

    def read(self) -> RunView:
        try:
            present = self.work_dir.is_dir()
        except OSError as exc:
            raise UserError(f"{self.work_dir}: cannot be read ({exc.strerror or exc})") from None
        if not present:
            raise UserError(_missing(self.work_dir))
        started = _run_started(self.work_dir)
        locked, attempt_started = _lock(self.work_dir)
        ranks, foreign = _heartbeats(self.work_dir, attempt_started if attempt_started is not None else started)
        return RunView(
            work_dir=self.work_dir,
            started=started,
            ranks=ranks,
            progress=self.metrics.refresh(),
            chats=self.samples.refresh(),
            diagnosis=_diagnosis(self.work_dir, started),
            locked=locked,
            foreign=foreign,
        )


def read_run(work_dir: Path) -> RunView:
    """One look at a work dir."""
    return RunReader(work_dir).read()


def sparkline(values: list[float], width: int = SPARK_WIDTH) -> str:
    """The last `width` values (averaged into `width` buckets when more) as bar characters, low to high."""
    values = [v for v in values if math.isfinite(v)]  # NaN (a skipped step) draws nothing
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
    if not math.isfinite(span):  # values near the float limits: their difference overflows
        return BARS[0] * len(values)
    return "".join(BARS[min(len(BARS) - 1, int((v - low) / span * len(BARS)))] for v in values)


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = max(0, int(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _state(beat: Beat, now: float) -> tuple[str, str]:
    age = now - beat.updated
    if beat.failed:
        return "ended with an error", "bold red"
    if beat.finished:
        return "finished", "green"
    if age > beat.limit_s:
        return "stalled: past the stall timeout", "bold red"
    if age > beat.limit_s / 2:
        return "slow: past half the stall timeout", "yellow"
    return "running", "green"


def ranks_table(view: RunView, now: float) -> Table:
    table = Table(title="ranks", title_justify="left", expand=False)
    for column in ("rank", "host", "phase", "step", "heartbeat", "state"):
        table.add_column(column)
    for beat in view.ranks:
        state, style = _state(beat, now)
        step = f"{'?' if beat.step is None else beat.step}/{beat.total_steps or '?'}"
        if beat.micro_steps is not None and beat.micro_steps > 1:
            step += f" ({beat.micro_step or 0}/{beat.micro_steps})"
        heartbeat = f"{_duration(now - beat.updated)} ago / {_duration(beat.limit_s)} limit"
        # Text, not str: a table's strings are read as markup.
        cells = (beat.label, beat.host, beat.phase, step, heartbeat)
        table.add_row(*(Text(cell) for cell in cells), Text(state, style=style))
    return table


def progress_lines(view: RunView, now: float) -> Text:
    text = Text()
    progress = view.progress
    last = progress.last
    if last is None:
        text.append("no optimizer step logged yet\n", style="dim")
        return text
    total = max((beat.total_steps or 0 for beat in view.ranks), default=0)
    text.append(f"loss {last.loss:.4f}  ", style="bold")
    text.append(sparkline(progress.loss.values()) + "\n", style="cyan")
    text.append(f"lr   {'?' if last.lr is None else format(last.lr, '.2e')}  ")
    text.append(sparkline(progress.lr.values()) + "\n", style="magenta")
    parts = [f"step {last.step}" + (f"/{total}" if total else "")]
    if last.tokens_per_s is not None:
        parts.append(f"{last.tokens_per_s:,.0f} tok/s")
    if last.peak_memory_gb is not None:
        parts.append(f"mem {last.peak_memory_gb:.1f} GB")
    if (validated := progress.last_val) is not None and validated.val_loss is not None:
        parts.append(f"val_loss {validated.val_loss:.4f} (step {validated.step})")
    if total and last.step < total and (per_step := progress.seconds_per_step()) is not None:
        parts.append(f"ETA {_duration(per_step * (total - last.step))}")
    text.append("  ".join(parts) + "\n")
    return text


def seconds_per_step(rows: Sequence[tuple[int, float]], lowest_earlier: int | None = None) -> float | None:
    """The recent pace from (step, elapsed_s) of the latest logged rows, of the latest attempt only: `elapsed_s`
    counts from each attempt's start, so a resumed run's rows begin again near zero. `lowest_earlier`: the
    lowest step of the rows before these."""
    attempt = list(rows[-1:])
    for row in reversed(rows[:-1]):
        if len(attempt) > RECENT_STEPS or row[1] >= attempt[0][1] or row[0] >= attempt[0][0]:
            break
        attempt.insert(0, row)
    if len(attempt) >= 2:
        return (attempt[-1][1] - attempt[0][1]) / (attempt[-1][0] - attempt[0][0])
    if not attempt or attempt[0][0] <= 0:
        return None
    step, elapsed = attempt[0]
    earlier = [row[0] for row in rows[:-1]] + ([] if lowest_earlier is None else [lowest_earlier])
    # The first logged step of a fresh run: its clock started with step 1.
    return elapsed / step if all(number >= step for number in earlier) else None


def _left_out(view: RunView) -> Text | None:
    """One line counting what the view left out, so that damaged or foreign files are not silently ignored."""
    parts = []
    if view.progress.left_out:
        parts.append(f"{view.progress.left_out} line(s) of {METRICS} that are no step record")
    if view.chats.left_out:
        parts.append(f"{view.chats.left_out} line(s) of {SAMPLES} that are no sample")
    if view.foreign:
        names = ", ".join(_one_line(name, 40) for name in view.foreign[:3]) + (", ..." if len(view.foreign) > 3 else "")
        parts.append(f"{len(view.foreign)} file(s) in diagnostics/live that are no heartbeat ({names})")
    return Text("left out: " + "; ".join(parts), style="dim") if parts else None


def _vanished_line(view: RunView, now: float) -> Text:
    gone = view.vanished(now)
    labels = ", ".join(beat.label for beat in gone[:8]) + (", ..." if len(gone) > 8 else "")
    age = _duration(now - max(beat.updated for beat in gone))
    return Text(
        f"the ranks stopped beating without finishing: rank(s) {labels} last beat {age} ago, past their stall "
        "timeout, and wrote no diagnosis (killed, or their node went down): see the run's terminal output",
        style="bold red",
    )


def render(view: RunView, now: float | None = None) -> RenderableType:
    now = time.time() if now is None else now
    parts: list[RenderableType] = [Text(f"tuneforge watch {safe_text(view.work_dir)}", style="bold")]
    if view.ranks:
        parts.append(ranks_table(view, now))
    else:
        parts.append(Text("no rank has written a heartbeat yet (starting up)", style="dim"))
    parts.append(progress_lines(view, now))
    if view.chats.seen:
        chats = view.chats
        body = "\n".join(f"{prompt} -> {reply}" for prompt, reply in chats.chats)
        body += f"\n(and {chats.more} more)" if chats.more else ""
        title = Text(f"sample chat at step {_one_line(chats.step, 20)}")
        parts.append(Panel(Text(body), title=title, title_align="left"))
    if (left_out := _left_out(view)) is not None:
        parts.append(left_out)
    if view.diagnosis is not None:
        diagnosis = Text(safe_text(view.diagnosis.rstrip()))
        parts.append(Panel(diagnosis, title="diagnosis", title_align="left", border_style="red"))
    elif view.failed or view.locked is False:
        parts.append(Text("the run has ended with an error: see its terminal output", style="bold red"))
    elif view.over(now) and view.vanished(now):
        parts.append(_vanished_line(view, now))
    elif view.over(now):
        parts.append(Text("the run has ended", style="bold green"))
    return Group(*parts)


def _wait_for_run(work_dir: Path, wait_s: float, interval_s: float, console: Console) -> None:
    """Return once `work_dir` holds a run; wait up to `wait_s` for one (a watch started just before its run)."""
    problem = _no_run(work_dir)
    if problem is None:
        return
    if wait_s <= 0:
        raise UserError(problem)
    console.print(
        Text(f"{safe_text(work_dir)} holds no run yet: waiting up to {_duration(wait_s)} for one to start", style="dim")
    )
    deadline = time.monotonic() + wait_s
    while (problem := _no_run(work_dir)) is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise UserError(f"{problem} (no run started there in {_duration(wait_s)})")
        time.sleep(min(interval_s, left))


def watch(
    work_dir: Path,
    interval_s: float = 1.0,
    once: bool = False,
    wait_s: float | None = None,
    console: Console | None = None,
) -> int:
    """Refresh until the run ends, with the status `RunView.status` gives. Started before its run, it waits up
    to `wait_s` (default WAIT_FOR_RUN_S) for one to appear; `once` does not wait."""
    from rich.live import Live

    console = console or Console()
    if once:
        wait_s = 0.0
    _wait_for_run(work_dir, WAIT_FOR_RUN_S if wait_s is None else wait_s, interval_s, console)
    reader = RunReader(work_dir)
    view, now = reader.read(), time.time()
    if once:
        console.print(render(view, now))
        return view.status(now)
    with Live(render(view, now), console=console, refresh_per_second=4, transient=False) as live:
        while not view.over(now):
            time.sleep(interval_s)
            view, now = reader.read(), time.time()
            live.update(render(view, now))
    return view.status(now)
