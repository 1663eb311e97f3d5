"""Continuing a run from a step checkpoint: which one, checked against this run's settings before the model
loads (and the precision it goes on in); then the model, optimizer, RNG and data position it recorded, with the
logs cut back to its step."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from tuneforge.config.schema import Config
from tuneforge.data.loader import data_plan
from tuneforge.distributed import DistInfo, barrier
from tuneforge.engines import Engine
from tuneforge.errors import UserError, first_line
from tuneforge.model.precision import choose_precision, native_cpu_half_precision, resumed_precision
from tuneforge.model.quantized_experts import quantized_experts_count
from tuneforge.run_files import RunFiles, step_record
from tuneforge.train.checkpoint import set_aside_newer, step_checkpoints
from tuneforge.train.loop import Trainer
from tuneforge.train.state import (
    TRAINING_STATE,
    ResumePoint,
    check_compatible,
    check_same_data_plan,
    check_same_expert_storage,
    check_same_quantization,
    find_resume,
    load_rng,
    read_state,
)
from tuneforge.train.workdir import recorded_run


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
        files = RunFiles(work_dir)
        for log in (files.metrics, files.samples):
            if dropped := truncate_log(log, point.step):
                print(f"resume: {dropped} unreadable line(s) of {log} dropped (cut off by a crash)")
        for line in set_aside_newer(files.checkpoints, point.step):
            print(line)
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
        record = step_record(line) if line.strip() else None
        if record is None:
            dropped += bool(line.strip())
        elif record["step"] <= step:
            kept.append(line)
    # Written beside it and renamed over it: a kill or a full disk now leaves the whole log, never an empty one.
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return dropped


def run_precision(requested: str, info: DistInfo, resume_dir: Path | None) -> tuple[str, str]:
    """What this run computes in (`train.precision`, `auto` resolved for this machine) and why; a resumed run
    under `auto` goes on in the interrupted run's precision (`resumed_precision`)."""
    on_gpu = info.device.type == "cuda"
    native_bf16 = not on_gpu or torch.cuda.is_bf16_supported(including_emulation=False)
    precision, why = choose_precision(requested, on_gpu, native_bf16)
    if resume_dir is None:
        return precision, why
    trained_in = read_state(resume_dir).precision
    if not on_gpu:
        native_bf16 = native_cpu_half_precision()
    return resumed_precision(requested, precision, why, trained_in, on_gpu, native_bf16, str(resume_dir))


def checked_resume(
    cfg: Config, work_dir: Path, resume: str | None, info: DistInfo, engine_name: str, say: Callable[[str], None]
) -> Path | None:
    """The checkpoint to resume from (None: from the start), checked against this run's settings before the
    model loads."""
    passed_over: list[str] = []
    resume_dir = find_resume(work_dir, resume, recorded_run(work_dir), passed_over)
    if resume_dir is None and passed_over:
        raise UserError(
            "\n".join(passed_over)
            + "\nevery step checkpoint of this run is damaged: restore one (--resume PATH), or start afresh without "
            "--resume (--archive-previous keeps them aside)"
        )
    for note in passed_over:
        say(note)
    if resume_dir is not None:
        train = cfg.train
        point = read_state(resume_dir)
        if train.max_steps is not None and point.step >= train.max_steps:  # said before the model loads
            raise UserError(f"--resume {resume_dir}: step {point.step} is already the last of {train.max_steps}")
        check_compatible(
            point,
            resume_dir,
            world_size=info.world_size,
            micro_batch_size=train.micro_batch_size,
            gradient_accumulation=train.gradient_accumulation,
            engine=engine_name,
            sequence_parallel=cfg.parallel.sequence_parallel,
            expert_parallel=cfg.parallel.expert_parallel,
        )
        check_same_quantization(resume_dir, cfg.model.quantization)
        check_same_data_plan(point, resume_dir, data_plan(cfg))
    return resume_dir
