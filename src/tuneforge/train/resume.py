"""Continuing a run from a step checkpoint: the model, optimizer, RNG and data position it recorded, with the
logs cut back to its step."""

from __future__ import annotations

import json
from pathlib import Path

from tuneforge.config.schema import Config
from tuneforge.distributed import DistInfo, barrier
from tuneforge.engines import Engine
from tuneforge.errors import UserError, first_line
from tuneforge.model.quantized_experts import quantized_experts_count
from tuneforge.train.checkpoint import step_checkpoints
from tuneforge.train.loop import Trainer
from tuneforge.train.state import TRAINING_STATE, ResumePoint, check_same_expert_storage, load_rng, read_state


def resume_from(
    checkpoint: Path, engine: Engine, trainer: Trainer, cfg: Config, info: DistInfo, work_dir: Path
) -> ResumePoint:
    """Model, optimizer, RNG and data position of `checkpoint` (checked compatible before the run began); logs
    cut back to its step."""
    point = read_state(checkpoint)
    if point.step >= trainer.total_steps:
        raise UserError(f"--resume {checkpoint}: step {point.step} is already the last of {trainer.total_steps}")
    check_same_expert_storage(checkpoint, quantized_experts_count(engine.unwrapped))
    try:
        engine.load_state(checkpoint / TRAINING_STATE)
    except (OSError, RuntimeError, ValueError, KeyError, EOFError) as exc:
        reason = first_line(exc, 300)
        older = [str(p) for s, p in step_checkpoints(checkpoint.parent) if s < point.step]
        fallback = f"; an older one: --resume {older[-1]}" if older else ""
        raise UserError(f"--resume {checkpoint}: its training state cannot be read ({reason}){fallback}") from None
    if info.is_main:
        for log in ("metrics.jsonl", "samples.jsonl"):
            if dropped := truncate_log(work_dir / log, point.step):
                print(f"resume: {dropped} unreadable line(s) of {work_dir / log} dropped (cut off by a crash)")
    barrier(info)
    load_rng(checkpoint / TRAINING_STATE, info.rank)  # last: building the model and engine drew random numbers
    return point


def truncate_log(path: Path, step: int) -> int:
    """Keep the records of steps up to `step`: the resumed run writes the rest again. Lines that are not a
    record (cut off by a crash or a full disk) are dropped; returns how many."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line) if line.strip() else None
        except ValueError:
            record = None
        if not isinstance(record, dict):
            dropped += bool(line.strip())
        elif record.get("step", 0) <= step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    return dropped
