"""`plot.png`: training (and validation) loss and learning rate against the optimizer step, from `metrics.jsonl`."""

from __future__ import annotations

import contextlib
import math
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tuneforge.errors import UserError
from tuneforge.run_files import PLOT, RunFiles, StepLog, read_step_log

PLOTTED = ("loss", "val_loss", "lr", "skipped")
"""What the plot draws of each record (the rest is not kept)."""


def read_metrics(path: Path) -> StepLog:
    """Every record of `path` (`run_files.step_record`'s rule): a line cut off by a crash, not UTF-8 or no step
    record is left out but counted, so the caller can say so."""
    try:
        return read_step_log(path, keep=PLOTTED)
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def _finite(value: object) -> float | None:
    """A JSON number as a finite float; None for anything else (text, booleans, NaN, an int past float)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], value) for r in records if (value := _finite(r.get(key))) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def plot_metrics(work_dir: Path, out: Path | None = None, warn: Callable[[str], None] = _warn) -> Path:
    """Draw `<work_dir>/metrics.jsonl` into `out` (default `<work_dir>/plot.png`) and return its path. Lines
    that are not records (one cut off by a crash) are left out, and `warn` is told how many."""
    source = RunFiles(work_dir).metrics
    if not source.is_file():
        raise UserError(f"{work_dir}: no metrics.jsonl here; give the work dir of a run (tuneforge train --work-dir)")
    metrics = read_metrics(source)
    if not metrics.records:
        raise UserError(f"{source}: no step records to plot yet")
    if metrics.unreadable:
        warn(describe_unreadable(metrics, source))

    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, and safe off the main thread
    import matplotlib.pyplot as plt

    fig, (loss_ax, lr_ax) = plt.subplots(2, 1, sharex=True, figsize=(8, 6), height_ratios=(2, 1))
    try:
        steps, losses = _series(metrics.records, "loss")
        loss_ax.plot(steps, losses, label="train loss", linewidth=1)
        val_steps, val_losses = _series(metrics.records, "val_loss")
        if val_steps:
            loss_ax.plot(val_steps, val_losses, "o-", label="validation loss", markersize=3)
        skipped = [r["step"] for r in metrics.records if r.get("skipped")]
        for step in skipped:  # non-finite steps have no loss point; mark where they were
            loss_ax.axvline(step, color="red", alpha=0.3, linewidth=1)
        loss_ax.set_ylabel("loss")
        name = work_dir.name.replace("$", r"\$")  # a `$` starts matplotlib's math text: one alone fails
        title = f"{name}: {len(metrics.records)} steps"
        if metrics.unreadable:
            title += f" ({len(metrics.unreadable)} unreadable line(s) left out)"
        loss_ax.set_title(title)
        loss_ax.legend(loc="upper right")
        loss_ax.grid(alpha=0.3)

        lr_steps, lrs = _series(metrics.records, "lr")
        lr_ax.plot(lr_steps, lrs, color="tab:green", linewidth=1)
        lr_ax.set_ylabel("learning rate")
        lr_ax.set_xlabel("optimizer step")
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        lr_ax.grid(alpha=0.3)

        fig.tight_layout()
        out = out or RunFiles(work_dir).plot
        if out.is_dir():
            raise UserError(f"--out {out}: a directory; give the PNG file to write, e.g. {out / PLOT}")
        tmp = out.with_name(f".{out.name}.tmp")
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(tmp, format="png", dpi=100)
            tmp.replace(out)  # a viewer never sees half a file
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise UserError(
                f"{out}: the plot cannot be written ({exc.strerror or exc}); choose another --out"
            ) from None
    finally:
        plt.close(fig)
    return out


def describe_unreadable(metrics: StepLog, source: Path) -> str:
    shown = ", ".join(map(str, metrics.unreadable[:5])) + (", ..." if len(metrics.unreadable) > 5 else "")
    return f"{source}: {len(metrics.unreadable)} unreadable line(s) left out of the plot (line {shown})"


def plot_at_end(work_dir: Path) -> str | None:
    """Draw the plot after training and return the summary's line for it. A failure prints one warning and
    returns None: the trained model matters more than its picture."""
    try:
        path = plot_metrics(work_dir)
    except Exception as exc:
        from tuneforge.terminal import safe_text

        reason = safe_text((str(exc).splitlines() or [""])[0])  # an error may quote what a file held
        retry = f"tuneforge plot {shlex.quote(str(work_dir))}"
        _warn(f"plot not written ({type(exc).__name__}: {reason}); retry with: {retry}")
        return None
    return f"plot: {path} (redraw: tuneforge plot {shlex.quote(str(work_dir))})"
