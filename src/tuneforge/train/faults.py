"""Fault injection for the hang tests: `TUNEFORGE_INJECT_FAULT=kind:rank:step[:seconds]`.

Testing only. It makes one rank misbehave at one optimizer step in a way real jobs do, so the watchdog's
diagnosis can be checked end to end through the real launcher:

- `skip_all_reduce`: the rank skips the step's closing all-reduce of its loss and counts, and waits on a path
  of its own instead (a branch that differs between ranks; going on to its next collective would pair that
  one with the skipped one, a mismatch: `extra_collective`);
- `rank_only_collective`: the rank runs an "evaluation" with an all-reduce that only it issues;
- `extra_collective`: the model's code issues an all-reduce on that rank only, inside the step's first
  training forward (gloo aborts a rank whose collective does not pair up: a SIGABRT, not an exception);
- `extra_batch`: the rank gets one micro-batch more than the others in that step (uneven data);
- `sleep_data`: the rank sleeps `seconds` while loading that step's data (a straggler);
- `kill`: the rank kills itself with SIGKILL (a crash, or the OOM killer);
- `sigterm`, `sigint`: the rank sends itself that signal while loading that step's data (a scheduler's
  preemption, a Ctrl-C);
- `kill_in_save`: the same, in the middle of writing that step's checkpoint;
- `disk_full_in_save`: writing that step's checkpoint fails as on a full disk (ENOSPC);
- `slow_stop_save`: the checkpoint saved after the ranks agreed to stop on a signal takes `seconds` longer on
  that rank (step ignored);
- `disk_full_in_engine_save`: on that rank alone, the engine's own writes of that step's checkpoint fail as on
  a full disk (every `torch.save` and DeepSpeed's copy of its recovery scripts raise ENOSPC), while the other
  ranks' succeed;
- `unwritable_in_save`: writing that step's checkpoint fails as in a directory made read-only (EACCES);
- `nan_loss`: the rank's loss of that step is NaN (a bad sample, an overflow);
- `freeze`: the rank stops itself with SIGSTOP (what `kill -STOP`, a debugger or a swapping node does) as it
  enters phase `PHASE` (`freeze:RANK:STEP:PHASE`, a heartbeat phase: `data`, `save`, `eval`, `generation`,
  `model` for the reference pass...) at that step or later.

The faults live in wrappers around the run's parts (the step groups, the engine, the model's last decoder
layer), installed by `run.setup` only when the variable is set: the training loop has no test switches.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from tuneforge.engines.base import Engine
from tuneforge.model.structure import decoder_layers
from tuneforge.train.parts import StepGroups
from tuneforge.watchdog import StallWatchdog

ENV = "TUNEFORGE_INJECT_FAULT"
KINDS = (
    "skip_all_reduce",
    "rank_only_collective",
    "extra_collective",
    "extra_batch",
    "sleep_data",
    "kill",
    "sigterm",
    "sigint",
    "kill_in_save",
    "disk_full_in_save",
    "disk_full_in_engine_save",
    "unwritable_in_save",
    "slow_stop_save",
    "nan_loss",
    "freeze",
)


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    seconds: float = 0.0
    phase: str = ""


def injected_fault() -> Fault | None:
    spec = os.environ.get(ENV)
    if not spec:
        return None
    kind, rank, step, *rest = spec.split(":")
    if kind not in KINDS:
        raise ValueError(f"{ENV}: unknown fault {kind!r}; one of {', '.join(KINDS)}")
    if kind == "freeze":
        return Fault(kind, int(rank), int(step), phase=rest[0])
    return Fault(kind, int(rank), int(step), float(rest[0]) if rest else 0.0)


class FaultInjector:
    """Knows the step in progress (from the step groups it hands out) and fires its fault there."""

    def __init__(self, fault: Fault, rank: int, watchdog: StallWatchdog):
        self.fault = fault
        self.rank = rank
        self.watchdog = watchdog
        self.step = 0
        self._extra_issued_at = 0

    def due(self, kind: str) -> bool:
        return self.fault.kind == kind and self.fault.rank == self.rank and self.fault.step == self.step

    def wrap_steps(self, groups: StepGroups, start_step: int) -> StepGroups:
        for self.step, (epoch, group) in enumerate(groups, start=start_step + 1):
            self._inject_data_fault()
            if self.due("extra_batch"):
                group = [*group, group[-1]]
            yield epoch, group

    def _inject_data_fault(self) -> None:
        if self.due("sleep_data"):
            time.sleep(self.fault.seconds)
        if self.due("kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        for kind, number in (("sigterm", signal.SIGTERM), ("sigint", signal.SIGINT)):
            if self.due(kind):
                os.kill(os.getpid(), number)

    def watch_phases(self) -> None:
        """Freezes this rank as its watchdog is told it enters the fault's phase (the beat is recorded first,
        so its heartbeat names the phase it froze in)."""
        if self.fault.kind != "freeze" or self.fault.rank != self.rank:
            return
        watchdog, beat = self.watchdog, self.watchdog.beat

        def beat_then_freeze(phase: str, *args: object, **kwargs: object) -> None:
            beat(phase, *args, **kwargs)  # type: ignore[arg-type]
            if phase == self.fault.phase and watchdog.step >= self.fault.step:
                watchdog._write_heartbeat()  # published now (frequent phases wait for the next second's write)
                os.kill(os.getpid(), signal.SIGSTOP)

        watchdog.beat = beat_then_freeze  # type: ignore[method-assign]

    def wrap_engine(self, engine: Engine) -> Engine:
        if self.fault.kind == "nan_loss":
            decoder_layers(engine.unwrapped)[-1].register_forward_hook(self._poison)
        if self.fault.kind == "extra_collective":
            decoder_layers(engine.unwrapped)[-1].register_forward_hook(self._extra_collective)
        return cast(Engine, FaultyEngine(engine, self))

    def _extra_collective(self, module: torch.nn.Module, _inputs: object, output: object) -> object:
        if self.due("extra_collective") and module.training and self._extra_issued_at != self.step:
            self._extra_issued_at = self.step
            torch.distributed.all_reduce(torch.ones(1))  # as model code might: on this rank only
        return output

    def _poison(self, module: torch.nn.Module, _inputs: object, output: object) -> object:
        """The last decoder layer's output times NaN in training forwards: the loss and every gradient of the
        step become NaN."""
        if not self.due("nan_loss") or not module.training:
            return output
        if isinstance(output, tuple):
            return (output[0] * float("nan"), *output[1:])
        return output * float("nan")


class FaultyEngine:
    """An engine that passes every call through (`__getattr__`: whatever the engine has, now or later),
    misbehaving in the few it overrides where its injector says so."""

    def __init__(self, inner: Engine, injector: FaultInjector):
        self.inner = inner
        self.injector = injector
        self._skipped_at = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def sum_tensor_across_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        # The first collective the step issues through the engine (a dense model's: its closing sum) is skipped.
        if self.injector.due("skip_all_reduce") and self._skipped_at != self.injector.step:
            self._skipped_at = self.injector.step
            while True:  # until the watchdog ends the job
                time.sleep(1)
        return self.inner.sum_tensor_across_ranks(tensor)

    def step(self, lr: float, max_grad_norm: float) -> torch.Tensor | float:
        norm = self.inner.step(lr, max_grad_norm)
        if self.injector.due("rank_only_collective"):
            self.injector.watchdog.beat("eval")
            torch.distributed.all_reduce(torch.zeros(1, device=self.inner.info.device))
        return norm

    def save_state(self, directory: Path) -> None:
        injector = self.injector
        mine = injector.fault.kind == "slow_stop_save" and injector.fault.rank == injector.rank
        if mine and injector.watchdog.stops.agreed:
            time.sleep(injector.fault.seconds)
        if self.injector.due("disk_full_in_engine_save"):
            with torch_save_fails(errno.ENOSPC):
                self.inner.save_state(directory)
        else:
            self.inner.save_state(directory)
        if self.injector.due("kill_in_save"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.injector.due("disk_full_in_save"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "engine.pt"))
        if self.injector.due("unwritable_in_save"):
            raise PermissionError(
                errno.EACCES, os.strerror(errno.EACCES), str(directory / f"rng-rank-{self.inner.info.rank}")
            )


@contextlib.contextmanager
def torch_save_fails(code: int) -> Iterator[None]:
    """Every `torch.save` inside, and the file copies DeepSpeed's engine makes (its recovery scripts), raise
    OSError(code) after writing nothing: a disk failing under an engine's own writer, where no wrapper of
    tuneforge's stands between."""
    import sys

    def failing(first: object, second: object, *args: object, **kwargs: object) -> None:
        raise OSError(code, os.strerror(code), str(second))

    engine = sys.modules.get("deepspeed.runtime.engine")
    real_save, real_copy = torch.save, getattr(engine, "copyfile", None)
    torch.save = failing
    if engine is not None:
        engine.copyfile = failing
    try:
        yield
    finally:
        torch.save = real_save
        if engine is not None:
            engine.copyfile = real_copy
