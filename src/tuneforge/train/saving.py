"""Writing a checkpoint from every rank: atomically, and with a write that fails on any rank (a full disk, a
file-size limit, a directory made unwritable) ending every rank alike, with one message and nothing half-written.

Every rank writes its training state into `.tmp-NAME`, rank 0 adds the Hugging Face files and renames the
directory into place. Between the phases the ranks vote (one all-reduce, where barriers stood before) on which
faults any of them met, so no rank waits in a collective for one that gave up, and all stop at the same point.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from transformers import PreTrainedTokenizerBase

from tuneforge.checkpoint_records import QUANTIZED_EXPERTS
from tuneforge.config.schema import Config
from tuneforge.data.templates import DEFAULT_TEMPLATE, TOKENIZER
from tuneforge.distributed import barrier
from tuneforge.engines import Engine
from tuneforge.errors import SharedUserError, first_line
from tuneforge.model.quantized_experts import quantized_experts_count
from tuneforge.model.vision import is_vision_model
from tuneforge.train.checkpoint import (
    commit_checkpoint,
    directory_bytes,
    fresh_dir,
    prune_checkpoints,
    remove_entry,
    step_checkpoints,
    temporary_dir,
    write_model_files,
)
from tuneforge.train.state import TRAINING_STATE, ResumePoint, save_rng, write_state
from tuneforge.train.write_faults import WriteFault, classify, file_size_limit, nearest_existing


def chat_meta(cfg: Config, engine: Engine) -> dict[str, Any]:
    """What `chat` and `export` need to use a checkpoint as it was trained: the template, the system prompt and,
    for adapters, how to rebuild the base model they were trained on."""
    data = cfg.data.model_dump(mode="json")
    # A vision-language model's default is its processor's chat template, saved with the checkpoint.
    template = data["template"] or (TOKENIZER if is_vision_model(cfg.model) else DEFAULT_TEMPLATE)
    meta: dict[str, Any] = {"template": template, "system": data["system"]}
    if cfg.model.lora is not None:
        meta["adapter"] = {
            "dtype": cfg.model.dtype,
            "trust_remote_code": cfg.model.trust_remote_code,
            "quantization": cfg.model.quantization.model_dump() if cfg.model.quantization else None,
            QUANTIZED_EXPERTS: quantized_experts_count(engine.unwrapped),
        }
    return meta


class Checkpointer:
    """Every checkpoint of a run: step checkpoints with the training state (keeping the last
    `checkpoint.keep_last`), the final and best models, and the one saved when the ranks agreed to stop. Owns
    atomicity (a temporary directory renamed into place), the vote on write faults and their one message."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: PreTrainedTokenizerBase,
        checkpoints_dir: Path,
        config_file: Path,
        keep_last: int | None,
        meta: dict[str, Any],
        log: Callable[[str], None],
        beat: Callable[[], None],
        processor: Any = None,
    ):
        self.engine = engine
        self.processor = processor
        self.tokenizer = tokenizer
        self.checkpoints_dir = checkpoints_dir
        self.config_file = config_file
        self.keep_last = keep_last
        self.meta = meta
        self.log = log
        self.beat = beat
        self.adapter_note_said = False
        self.last_state_save_s: float | None = None
        """How long the last checkpoint with training state took: whether another fits in a stop's grace time."""

    def save_step(self, point: ResumePoint) -> Path:
        """`checkpoints/step-N` with the training state for an exact resume."""
        return self.save(f"step-{point.step}", {**self.meta, "step": point.step}, point)

    def save_model(self, name: str, step: int) -> Path:
        """`checkpoints/final` or `checkpoints/best`: the model alone."""
        return self.save(name, {**self.meta, "step": step}, None)

    def save_before_stop(self, point: ResumePoint, grace_left_s: float) -> Path | None:
        """The step checkpoint when the ranks agreed to stop on a signal, unless the last one took longer than the
        grace time left on some rank (a half-written one would be discarded anyway when the scheduler kills the
        job). Every rank decides the same: one vote."""
        last = self.last_state_save_s
        too_slow = last is not None and last > grace_left_s
        (too_slow_anywhere,) = self.engine.sum_across_ranks([float(too_slow)])
        if too_slow_anywhere:
            self.log(
                f"no checkpoint at step {point.step}: the last one took {last or 0:.0f}s and "
                f"{max(grace_left_s, 0):.0f}s of watchdog.stop_grace_s are left; --resume auto takes the newest one"
            )
            return None
        return self.save_step(point)

    def save(self, name: str, meta: dict[str, Any], point: ResumePoint | None) -> Path:
        """`checkpoints/NAME`, with the training state for an exact resume when `point` is given. A collective:
        every rank calls it."""
        engine, is_main = self.engine, self.engine.info.is_main
        self.beat()
        started = time.monotonic()
        weights = engine.full_state_dict()  # a collective for sharded engines: every rank takes part
        final = self.checkpoints_dir / name
        tmp = temporary_dir(final)
        errors: list[tuple[BaseException, WriteFault]] = []
        if is_main:
            self._attempt(errors, tmp, lambda: self._fresh(tmp))
        self._agree(errors, tmp, final)
        if point is not None:
            self._attempt(errors, tmp, lambda: self._write_state(tmp))
            self._agree(errors, tmp, final)
        if is_main:
            self._attempt(errors, tmp, lambda: self._write_model(tmp, final, meta, point, weights))
        self._agree(errors, tmp, final)
        if is_main:
            self.log(f"saved checkpoint {final}")
            self._prune()
        if point is not None:
            self.last_state_save_s = time.monotonic() - started
        self.beat()
        return final

    @staticmethod
    def _attempt(errors: list[tuple[BaseException, WriteFault]], tmp: Path, write: Callable[[], None]) -> None:
        """Run one phase's writes; a failure is kept with its kind, judged while the half-written files are there
        (removing them frees the space a later look would miss)."""
        try:
            write()
        except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
            errors.append((exc, classify(exc, tmp)))

    @staticmethod
    def _fresh(tmp: Path) -> None:
        # Whatever stands at `.tmp-NAME` is removed without being followed (a link planted in a handed-over work
        # dir is unlinked, its target left alone), and the directory is created anew: never written through.
        fresh_dir(tmp)
        (tmp / TRAINING_STATE).mkdir()

    def _write_state(self, tmp: Path) -> None:
        self.engine.save_state(tmp / TRAINING_STATE)
        save_rng(tmp / TRAINING_STATE, self.engine.info.rank)

    def _write_model(
        self, tmp: Path, final: Path, meta: dict[str, Any], point: ResumePoint | None, weights: dict | None
    ) -> None:
        note = write_model_files(
            self.engine.unwrapped, self.tokenizer, tmp, meta, self.config_file, weights, self.processor
        )
        if note and not self.adapter_note_said:
            self.log(note)
            self.adapter_note_said = True
        if point is not None:
            write_state(tmp / TRAINING_STATE, point)
        else:
            shutil.rmtree(tmp / TRAINING_STATE)
        commit_checkpoint(tmp, final)

    def _prune(self) -> None:
        """After the commit: a checkpoint that cannot be removed is said, and the run goes on (the new one is
        written; the disk fills sooner, and the next save says so if it does)."""
        try:
            prune_checkpoints(self.checkpoints_dir, self.keep_last)
        except OSError as exc:
            self.log(f"warning: an old checkpoint could not be removed ({exc}); checkpoint.keep_last not kept")

    def _agree(self, errors: list[tuple[BaseException, WriteFault]], tmp: Path, final: Path) -> None:
        """Every rank learns which faults any rank met; on any, the half-written directory goes and every rank
        stops: with one message for a fault of the disk, or its own error where it was another kind (a rank
        with such an error raises it at once; the others do not wait for a message then)."""
        mine = [0.0] * len(WriteFault)
        for _, fault in errors:
            mine[fault] = 1.0
        votes = self.engine.sum_across_ranks(mine)
        if not any(votes):
            return
        written = directory_bytes_or_zero(tmp)
        if self.engine.info.is_main:
            remove_entry(tmp, ignore_errors=True)
        if errors and errors[0][1] == WriteFault.OTHER:
            raise errors[0][0]
        if votes[WriteFault.OTHER]:
            raise SharedUserError(f"checkpoint {final} not written: another rank failed writing it (its error above)")
        faults = [fault for fault in WriteFault if votes[fault]]
        reason = errors[0][0] if errors else None
        try:
            message = self.explain(faults[0], final, written, reason)
        except OSError:  # the disk is failing under the explanation too
            message = f"checkpoint {final} not written: {faults[0].name.lower().replace('_', ' ')}"
        if self.engine.info.is_main:
            print(f"error: {message}", file=sys.stderr, flush=True)
        # The others exit only once it is said: the launcher stops every rank as soon as the first one ends.
        barrier(self.engine.info)
        raise SharedUserError(message, said=True)

    def explain(self, fault: WriteFault, final: Path, written: int, reason: BaseException | None = None) -> str:
        checkpoints = self.checkpoints_dir
        previous = [path for _, path in step_checkpoints(checkpoints) if path != final]
        kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
        head = f"checkpoint {final} not written"
        if fault == WriteFault.NOT_WRITABLE:
            why = f" ({first_line(reason)})" if reason is not None else ""
            return (
                f"{head}: {checkpoints} is not writable{why}; {kept}. Make it writable again (or move the work "
                "dir), then continue with --resume auto"
            )
        if previous:
            size = f"about {size_text(directory_bytes(previous[-1]))} (the size of {previous[-1].name})"
        else:
            size = f"at least {size_text(written)} (this much was written before the write failed)"
        if fault == WriteFault.FILE_TOO_LARGE:
            limit = file_size_limit()
            shown = f"{limit:,} bytes" if limit is not None else "set on another rank"
            return (
                f"{head}: a file reached the process's file-size limit ({shown}, `ulimit -f`; a checkpoint of this "
                f"run takes {size}); {kept}. Raise the limit (`ulimit -f unlimited`), then continue with "
                "--resume auto"
            )
        free = size_text(shutil.disk_usage(nearest_existing(checkpoints)).free)
        return (
            f"{head}: no space left ({free} free on the disk of {checkpoints}; a checkpoint of this run "
            f"takes {size}); {kept}. Free space or lower checkpoint.keep_last, then continue with --resume auto"
        )


def size_text(size: int) -> str:
    """Bytes in the largest binary unit that keeps them at or above 1 (`1.25 GiB`, `652.4 KiB`)."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def directory_bytes_or_zero(directory: Path) -> int:
    try:
        return directory_bytes(directory) if directory.exists() else 0
    except OSError:
        return 0
