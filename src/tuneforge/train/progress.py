"""Visible progress from the first micro-step: a live bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def _format_step(step: int, metrics: dict[str, float]) -> str:
    return (
        f"loss {metrics['loss']:.4f}  lr {metrics['lr']:.2e}  grad_norm {metrics['grad_norm']:.3f}  "
        f"tok/s {metrics['tokens_per_s']:,.0f}"
        + (f"  router_aux {metrics['router_aux_loss']:.4f}" if "router_aux_loss" in metrics else "")
        + (f"  margin {metrics['rewards/margin']:.3f}" if "rewards/margin" in metrics else "")
        + (f"  acc {metrics['rewards/accuracy']:.2f}" if "rewards/accuracy" in metrics else "")
        + (f"  reward {metrics['reward']:.3f}" if "reward" in metrics else "")
        + (f"  len {metrics['completion_length']:.0f}" if "completion_length" in metrics else "")
        + (f"  val_loss {metrics['val_loss']:.4f}" if "val_loss" in metrics else "")
        + (f"  val_acc {metrics['val_rewards/accuracy']:.2f}" if "val_rewards/accuracy" in metrics else "")
        + (f"  MFU {100 * metrics['mfu']:.0f}%" if "mfu" in metrics else "")
        + (f"  mem {metrics['peak_memory_gb']:.1f}GB" if "peak_memory_gb" in metrics else "")
    )


class ProgressReporter:
    """Reports micro-steps and optimizer steps; `log` prints a line without breaking the bar."""

    def __init__(self, total_steps: int, accumulation: int, mode: str, every_steps: int):
        self.console = Console(stderr=False, highlight=False)
        self.total_steps = total_steps
        self.accumulation = accumulation
        self.every_steps = every_steps
        self.silent = mode == "off"  # ranks other than 0
        use_bar = mode == "bar" or (mode == "auto" and self.console.is_terminal)
        self.bar: Progress | None = None
        self.started = time.monotonic()
        self.first_step = 0
        """Steps done before this process started (a resumed run): the ETA counts only this run's pace."""
        if use_bar:
            self.bar = Progress(
                TextColumn("step {task.fields[step]}/{task.fields[total_steps]}"),
                BarColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.task = self.bar.add_task(
                "train",
                total=total_steps * accumulation,
                step=0,
                total_steps=total_steps,
                stats="waiting for the first micro-step",
            )
            self.bar.start()

    def log(self, text: str) -> None:
        if not self.silent:
            self.console.print(text, markup=False, soft_wrap=True)

    def micro_step(self, step: int, micro: int, micro_count: int, seconds: float) -> None:
        """Called after each forward/backward: the first step is reported micro-step by micro-step."""
        if self.bar is not None:
            self.bar.update(self.task, completed=(step - 1) * self.accumulation + micro, step=step)
            if step == 1:
                self.bar.update(self.task, stats=f"first step: micro-step {micro}/{micro_count} took {seconds:.2f}s")
        elif step == 1:
            self.log(f"step 1/{self.total_steps}: micro-step {micro}/{micro_count} took {seconds:.2f}s")

    def step(self, step: int, metrics: dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step * self.accumulation, step=step, stats=_format_step(step, metrics))
            return
        if step == 1 or step % self.every_steps == 0 or step == self.total_steps:
            elapsed = time.monotonic() - self.started
            eta = elapsed / max(step - self.first_step, 1) * (self.total_steps - step)
            self.log(
                f"step {step}/{self.total_steps}  {_format_step(step, metrics)}  elapsed {elapsed:.0f}s  ETA {eta:.0f}s"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        sys.stdout.flush()
