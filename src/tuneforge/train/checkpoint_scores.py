"""`eval.lm_eval.at_checkpoints`: each step checkpoint scored by lm-evaluation-harness while training waits.

The harness runs as `tuneforge eval CHECKPOINT` in a process of its own on the first rank's device (its failures
its own, its memory returned when it ends). Every rank waits for it together, one small vote a second (never one
long collective, which the process group's timeout would end), beating the watchdog in the `eval` phase; a
scoring that outlives `eval.lm_eval.timeout_s`, or a stop signal on any rank, ends the child and training goes on.
Before it starts, the first rank checks that the device has room for the model beside training's own memory; a
checkpoint without room is not scored, said with the fix. Results: `eval/lm_eval-step-N.json`, the harness's
output in `eval/lm_eval-step-N.log`, one line per task on the console.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tuneforge.config.schema import LmEvalConfig
from tuneforge.launcher_watch import FOLLOW_PARENT
from tuneforge.lm_eval_tasks import eval_command
from tuneforge.trained import model_values

POLL_S = 1.0
RANK_SETTINGS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR"}
RANK_SETTINGS |= {"MASTER_PORT", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME"}
ROOM_FACTOR = 1.2
"""The model's weights in the harness's dtype, plus a fifth for its activations and the CUDA context."""
EVAL_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
EVAL_DTYPES = {"bf16": "bf16", "fp16": "fp16"}
"""The harness scores in the run's half precision (fp32 otherwise): half the memory beside training."""


def device_room_bytes(device: torch.device) -> int | None:
    """Bytes free for another process on `device` (training's cached blocks released first); None on CPU, where
    the host's free memory is the operating system's to share."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


class CheckpointScores:
    """Scores step checkpoints as `eval.lm_eval` asks; `score` is a collective every rank calls alike."""

    def __init__(
        self,
        settings: LmEvalConfig,
        work_dir: Path,
        device: torch.device,
        is_main: bool,
        sum_across_ranks: Callable[[list[float]], list[float]],
        beat: Callable[[], None],
        stop_pending: Callable[[], bool],
        log: Callable[[str], None],
        precision: str = "fp32",
        trust_remote_code: bool = False,
    ):
        self.settings = settings
        self.dtype = EVAL_DTYPES.get(precision, "fp32")
        self.eval_dir = work_dir / "eval"
        self.device = device
        self.is_main = is_main
        self.sum_across_ranks = sum_across_ranks
        self.beat = beat
        self.stop_pending = stop_pending
        self.log = log
        self.trust_remote_code = trust_remote_code

    def score(self, step: int, checkpoint: Path) -> None:
        self.beat()
        (stopping,) = self.sum_across_ranks([float(self.stop_pending())])
        if stopping:  # the run stops at its next check: no scoring to start and end
            self.log(f"eval.lm_eval: step {step} not scored: a stop signal is pending")
            return
        child = self._start(step, checkpoint) if self.is_main else None
        started = time.monotonic()
        while True:
            running = child is not None and child.poll() is None
            late = running and time.monotonic() - started > self.settings.timeout_s
            # Every rank leaves the loop on the same votes: a rank deciding alone would leave the others in it.
            pending, stopping, over = self.sum_across_ranks([float(running), float(self.stop_pending()), float(late)])
            if not pending or stopping or over:
                break
            self.beat()
            time.sleep(POLL_S)
        if child is None:
            return
        ended_by = None
        if child.poll() is None:
            limit = f"it ran past eval.lm_eval.timeout_s ({self.settings.timeout_s:.0f}s)"
            ended_by = limit if over else "a stop signal arrived"
        elif stopping and child.returncode != 0:  # the signal reached the scoring too (its process group)
            ended_by = "a stop signal arrived"
        self._finish(step, child, ended_by)

    def _start(self, step: int, checkpoint: Path) -> subprocess.Popen | None:
        needed = model_values(checkpoint) * EVAL_BYTES.get(self.dtype, 4) * ROOM_FACTOR
        room = device_room_bytes(self.device)
        if room is not None and needed > room:
            self.log(
                f"eval.lm_eval: step {step} not scored: the model needs about {needed / 2**30:.1f} GiB on "
                f"{self.device} and {room / 2**30:.1f} GiB are free beside training; score it afterwards with "
                f"`tuneforge eval {checkpoint} --tasks {','.join(self.settings.tasks)}` (on another device: --device)"
            )
            return None
        out = self.eval_dir / f"lm_eval-step-{step}.json"
        command = eval_command(
            self.settings, checkpoint, str(self.device), self.trust_remote_code, base=False, dtype=self.dtype
        )
        command += ["--out", str(out)]
        self.log(f"eval.lm_eval: scoring step {step} ({' '.join(command[3:])})")
        # One process of its own: none of the rank's torchrun settings (which would make it a rank, watching for a
        # launcher); it watches the run that started it instead.
        env = {k: v for k, v in os.environ.items() if k not in RANK_SETTINGS and not k.startswith("TORCHELASTIC")}
        env[FOLLOW_PARENT] = "1"
        try:
            self.eval_dir.mkdir(parents=True, exist_ok=True)
            with (self.eval_dir / f"lm_eval-step-{step}.log").open("w", encoding="utf-8") as output:
                return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
        except OSError as exc:  # a full disk, a vanished interpreter: said, and training goes on
            self.log(f"eval.lm_eval: step {step} not scored: the harness did not start ({exc})")
            return None

    def _finish(self, step: int, child: subprocess.Popen, ended_by: str | None) -> None:
        log_file = self.eval_dir / f"lm_eval-step-{step}.log"
        if ended_by is not None:
            child.kill()
            child.wait()
            self.log(f"eval.lm_eval: step {step} not scored: {ended_by}; its output so far is in {log_file}")
            return
        if child.returncode != 0:
            self.log(
                f"eval.lm_eval: scoring step {step} stopped with status {child.returncode}; training goes on "
                f"(the harness's output: {log_file})"
            )
            return
        for line in score_lines(self.eval_dir / f"lm_eval-step-{step}.json"):
            self.log(f"eval.lm_eval @ step {step}: {line}")


def score_lines(result: Path) -> list[str]:
    """One line per task of a `tuneforge eval` result: its metrics with their values."""
    try:
        results = json.loads(result.read_text(encoding="utf-8"))["results"]
    except (OSError, ValueError, KeyError, TypeError):
        return [f"(no results in {result})"]
    lines = []
    for task, values in sorted(results.items()):
        shown = [
            f"{name.split(',')[0]} {value:.4f}"
            for name, value in values.items()
            # The harness's metrics are `name,filter`; its other numbers (the sample count) are not scores.
            if "," in name and "stderr" not in name and isinstance(value, int | float) and not isinstance(value, bool)
        ]
        lines.append(f"{task}: {', '.join(shown)}")
    return lines


def checkpoint_scores(parts, log: Callable[[str], None]) -> CheckpointScores | None:
    """The run's checkpoint scoring (`parts`: its RunParts), or None when `eval.lm_eval.at_checkpoints` is off."""
    cfg = parts.cfg
    settings = cfg.eval.lm_eval
    if settings is None or not settings.at_checkpoints:
        return None
    engine, watchdog = parts.engine, parts.watchdog
    return CheckpointScores(
        settings,
        parts.work_dir,
        engine.info.device,
        engine.info.is_main,
        engine.sum_across_ranks,
        lambda: watchdog.beat("eval"),
        lambda: watchdog.stops.signal is not None,
        log,
        cfg.train.precision,
        cfg.model.trust_remote_code,
    )
