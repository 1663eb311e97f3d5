"""The one training loop: accumulate token-weighted gradients, clip, step, report, sample, save."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tuneforge.data.batching import BatchPlanner, MicroBatch
from tuneforge.data.conversation import prompt_conversation
from tuneforge.data.loader import data_plan
from tuneforge.diagnostics.files import GENERATION
from tuneforge.distributed import gather_objects
from tuneforge.engines import Engine
from tuneforge.errors import StoppedBySignal, UserError
from tuneforge.estimate.hardware import peak_flops
from tuneforge.generate import generate_replies
from tuneforge.model.transfer import to_device
from tuneforge.objective import Objective
from tuneforge.run_files import RunFiles
from tuneforge.train.checkpoint_scores import checkpoint_scores
from tuneforge.train.metrics import MetricsLog
from tuneforge.train.parts import RunParts
from tuneforge.train.progress import ProgressReporter
from tuneforge.train.saving import Checkpointer, chat_meta
from tuneforge.train.schedule import LRSchedule, resolve_warmup
from tuneforge.train.sinks import open_sinks
from tuneforge.train.state import ResumePoint
from tuneforge.train.telemetry import StepClock, peak_memory_gb
from tuneforge.train.validate import ValidationResult, validation_loss
from tuneforge.watchdog import STOP_SIGNALS

FIGURES = ("loss", "router_aux_loss")
"""Summed on the device over the micro-steps, first in a step's sums (the router term 0 without one)."""
COUNTS = ("num_targets", "num_tokens", "num_slots", "step_seconds")
"""Copied up from the host after the objective's metrics: target tokens, tokens, positions computed (padding
included), and each rank's seconds per step as it last measured them (the pace of the stop checks)."""


@dataclass(frozen=True)
class SumsLayout:
    """Where each figure of a step lives in its one tensor of sums, all-reduced once and read once: `FIGURES`,
    the objective's metrics, `COUNTS`, then one stop vote per signal."""

    metric_names: tuple[str, ...]
    signals: int

    @property
    def metrics(self) -> slice:
        return slice(len(FIGURES), len(FIGURES) + len(self.metric_names))

    @property
    def counts(self) -> slice:
        return slice(self.metrics.stop, self.metrics.stop + len(COUNTS))

    @property
    def votes(self) -> slice:
        return slice(self.counts.stop, self.counts.stop + self.signals)

    @property
    def size(self) -> int:
        return self.votes.stop

    def index(self, name: str) -> int:
        """The position of a `FIGURES` or `COUNTS` entry."""
        return FIGURES.index(name) if name in FIGURES else self.counts.start + COUNTS.index(name)


@dataclass
class AccumulatedStep:
    """A step's sums over all ranks, left on the device (all-reduced in stream order) until read: `read`, or
    `read_together` for several steps at once, in one transfer that can take the gradient norms along."""

    sums: torch.Tensor
    """Laid out as `layout` says."""
    layout: SumsLayout
    has_router_loss: bool
    step_units: int
    _values: list[float] | None = field(default=None, repr=False)

    @property
    def metric_names(self) -> tuple[str, ...]:
        return self.layout.metric_names

    def read(self, *device_values: torch.Tensor | float) -> list[float]:
        """Read the sums, and `device_values` (the gradient norm) with them, in one transfer; returns the latter."""
        values = _read_all([self.sums, *(_as_sum(v, self.sums.device) for v in device_values)])
        self._values = values[: self.layout.size]
        return values[self.layout.size :]

    @property
    def _read(self) -> list[float]:
        if self._values is None:
            self.read()
        assert self._values is not None
        return self._values

    def _named(self, name: str) -> float:
        return self._read[self.layout.index(name)]

    @property
    def loss(self) -> float:
        """The objective's mean over the step's units (target tokens for SFT, pairs for preference objectives)."""
        return self._named("loss")

    @property
    def router_aux_loss(self) -> float | None:
        """Router balance loss, weighted by each micro-batch's share of the step's units (MoE models only)."""
        return self._named("router_aux_loss") if self.has_router_loss else None

    @property
    def metrics(self) -> dict[str, float]:
        """The objective's figures (`Objective.metric_names`), each a mean over the step's units."""
        values = self._read[self.layout.metrics]
        return {name: value / self.step_units for name, value in zip(self.metric_names, values, strict=True)}

    @property
    def num_targets(self) -> int:
        return int(self._named("num_targets"))

    @property
    def num_tokens(self) -> int:
        return int(self._named("num_tokens"))

    @property
    def num_slots(self) -> int:
        """Positions computed, padding included (rows x padded width), over all ranks."""
        return int(self._named("num_slots"))

    @property
    def step_seconds(self) -> float:
        """The ranks' seconds per step as each last measured them, summed (0 before any measured)."""
        return self._named("step_seconds")

    @property
    def stop_votes(self) -> tuple[int, ...]:
        """Per stop signal (SIGTERM, SIGINT): how many ranks had received it by the end of the step."""
        return tuple(int(v) for v in self._read[self.layout.votes])


def _as_sum(value: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float64, device=device).reshape(1)


def _read_all(parts: list[torch.Tensor]) -> list[float]:
    return torch.cat(parts).tolist()


def read_together(steps: list[AccumulatedStep], norms: list[torch.Tensor | float]) -> list[float]:
    """Several steps' sums and their gradient norms in one host read; returns the norms."""
    device = steps[0].sums.device
    values = _read_all(
        [part for step, norm in zip(steps, norms, strict=True) for part in (step.sums, _as_sum(norm, device))]
    )
    read, at = [], 0
    for step in steps:
        step._values = values[at : at + step.layout.size]
        read.append(values[at + step.layout.size])
        at += step.layout.size + 1
    return read


class StepObserver:
    """What the loop learns from inside a step: micro-steps starting and ending, and this rank's stop requests.
    This one observes nothing; the Trainer's reports to the watchdog and the progress line."""

    def micro_step_started(self, index: int) -> None:
        pass

    def micro_step_done(self, index: int) -> None:
        pass

    def micro_steps_over(self) -> None:
        """The micro-steps are done; the step's closing sum comes next."""

    def stop_requests(self) -> tuple[int, ...]:
        """Per stop signal (SIGTERM, SIGINT): 1 if this rank received it."""
        return ()

    def step_seconds(self) -> float:
        """This rank's seconds per step as it last measured them (0: not yet)."""
        return 0.0


def accumulate_gradients(
    engine: Engine, micro_batches: list[MicroBatch], objective: Objective, observer: StepObserver | None = None
) -> AccumulatedStep:
    """Backward every micro-batch with its loss divided by the step's units (target tokens for SFT) over all
    ranks, so the gradient is that of the mean over all of them, however they are split into micro-batches and
    ranks. The divisor comes from the batching plan every rank holds: no collective before the first forward.
    Every rank runs the same number of micro-batches and collectives. The observer's stop requests ride on the
    step's closing sum, so every rank learns at the same step whether any rank was asked to stop."""
    observer = observer or StepObserver()
    step_units = sum(objective.global_count(batch) for batch in micro_batches)
    assert step_units > 0, "tokenization drops samples without targets"
    # Summed where the losses are: the closing sum reads them once per step, nothing reads them per micro-step.
    zero = torch.zeros((), dtype=torch.float32, device=objective.forward.device)
    # FIGURES, then the objective's metrics: summed on the device, read once at the end
    totals = [zero] * (len(FIGURES) + len(objective.metric_names))
    for index, batch in enumerate(micro_batches, start=1):
        observer.micro_step_started(index)
        with engine.micro_step(last=index == len(micro_batches)):
            terms = objective.terms(batch, step_units)
            engine.backward(terms.total)
        aux = terms.router_aux if terms.router_aux is not None else zero
        metrics = [terms.metrics[name] for name in objective.metric_names]
        totals = [total + value for total, value in zip(totals, [terms.loss, aux, *metrics], strict=True)]
        observer.micro_step_done(index)
    observer.micro_steps_over()
    counts = {
        "num_targets": sum(mb.num_targets for mb in micro_batches),
        "num_tokens": sum(mb.num_tokens for mb in micro_batches),
        "num_slots": sum(mb.input_ids.numel() for mb in micro_batches),
        "step_seconds": observer.step_seconds(),
    }
    votes = observer.stop_requests()
    layout = SumsLayout(objective.metric_names, len(votes))
    host = torch.tensor([*(counts[name] for name in COUNTS), *votes], dtype=torch.float64)
    # The closing sum, on the device: losses as they are (no read), counts and stop votes copied up to join them.
    sums = torch.cat([torch.stack(totals).double(), to_device(host, zero.device)])
    assert sums.numel() == layout.size
    engine.sum_tensor_across_ranks(sums)
    return AccumulatedStep(sums, layout, objective.balance is not None, step_units)


def over_updates(updates: list[AccumulatedStep]) -> AccumulatedStep:
    """A step of several updates (online RL's updates per rollout) as one record: its losses and metrics the
    mean over the updates, its counts and stop votes the last update's (every update sees the same rows)."""
    if len(updates) == 1:
        return updates[0]
    last = updates[-1]
    sums = last.sums.clone()
    figures = slice(0, last.layout.metrics.stop)
    sums[figures] = torch.stack([update.sums[figures] for update in updates]).mean(dim=0)
    return AccumulatedStep(sums, last.layout, last.has_router_loss, last.step_units)


def steps_per_epoch(num_micro_batches: int, accumulation: int) -> int:
    """The last optimizer step of an epoch may take fewer micro-batches; it is weighted by tokens anyway."""
    return math.ceil(num_micro_batches / accumulation)


def planned_micro_batches(num_micro_batches: int, accumulation: int, step: int) -> int:
    """How many micro-batches optimizer step `step` (from 1) takes by the plan: `accumulation`, fewer at the
    end of an epoch. The watchdog holds every rank to it (a rank beyond it has uneven data)."""
    per_epoch = steps_per_epoch(num_micro_batches, accumulation)
    if (step - 1) % per_epoch < per_epoch - 1:
        return accumulation
    return num_micro_batches - accumulation * (per_epoch - 1)


def step_groups(
    batches: BatchPlanner, accumulation: int, start_step: int = 0
) -> Iterator[tuple[int, list[MicroBatch]]]:
    """(epoch, micro-batches of one optimizer step), cycling over epochs; a step never spans two epochs.
    `start_step` steps are skipped without collating anything: the data position of a resumed run."""
    epoch, steps_into_epoch = divmod(start_step, steps_per_epoch(len(batches), accumulation))
    skip = steps_into_epoch * accumulation
    while True:
        group: list[MicroBatch] = []
        for batch in batches.epoch(epoch, start=skip):
            group.append(batch)
            if len(group) == accumulation:
                yield epoch, group
                group = []
        if group:
            yield epoch, group
        epoch += 1
        skip = 0


STOP_CHECKS_PER_GRACE = 5
"""Stop checks within `watchdog.stop_grace_s`: the steps' figures are read at least that often, by the pace the
ranks agreed on, so a stop signal is seen and agreed on well before the watchdog's deadline."""
MAX_UNREAD_STEPS = 64
"""At most this many steps queued on the device with their figures not read on the host."""


@dataclass
class PendingStep:
    """A step queued on the device whose figures the host has not read yet, with what its record and its checks
    need beside them."""

    step: int
    epoch: int
    lr: float
    accumulated: AccumulatedStep
    grad_norm: torch.Tensor | float
    loss_scale: float | None
    """The fp16 loss scale this step's gradients carry."""
    scale_after: float | None
    """The scale the engine goes on with after the step."""
    origins: list[list[str]]
    """Each micro-batch's samples, named if the step is not finite."""
    started: torch.cuda.Event | float
    ended: torch.cuda.Event | float
    peak_memory_gb: float
    figures: dict[str, float] = field(default_factory=dict)
    """What the objective's making of the step's data reports (online RL's rewards), already host values."""


class Trainer:
    """Runs the steps. Every rank executes the same calls in the same order; only rank 0 writes files."""

    def __init__(self, parts: RunParts):
        self.parts = parts
        self.cfg = cfg = parts.cfg
        self.engine = parts.engine
        self.watchdog = parts.watchdog
        self.stops = parts.watchdog.stops
        self.work_dir = parts.work_dir
        self.is_main = parts.engine.info.is_main
        self.best_val_loss = float("inf")
        self.zero_std_warned = False
        self.nonfinite_in_row = 0
        self.samples_consumed = 0
        self.stop_votes: tuple[int, ...] = ()
        self.pending: list[PendingStep] = []
        """Steps queued on the device whose figures are not read yet (see `reads_after`)."""
        self.step_seconds = 0.0
        """This rank's wall seconds per step over its last read window: the pace of the stop checks."""
        self.next_check = 0
        """The step after which the figures are read at the latest: the ranks' stop check (the same on all)."""
        self.peak_flops = peak_flops(parts.engine.info.device)
        train = cfg.train
        per_epoch = steps_per_epoch(len(parts.planner), train.gradient_accumulation)
        self.total_steps = train.max_steps or per_epoch * train.epochs
        self.schedule = LRSchedule(
            peak=train.lr,
            min_lr=train.min_lr,
            total_steps=self.total_steps,
            warmup_steps=resolve_warmup(self.total_steps, train.warmup_ratio, train.warmup_steps),
            kind=train.schedule,
        )
        self.progress = ProgressReporter(
            self.total_steps,
            train.gradient_accumulation,
            cfg.log.progress if self.is_main else "off",
            cfg.log.every_steps,
        )
        self.checkpoints_dir = RunFiles(parts.work_dir).checkpoints
        self.data_signature = parts.planner.data.signature()  # recorded in every step checkpoint
        self.checkpoint_scores = checkpoint_scores(parts, self.progress.log)
        self.checkpointer = Checkpointer(
            parts.engine,
            parts.tokenizer,
            self.checkpoints_dir,
            RunFiles(parts.work_dir).config,
            cfg.checkpoint.keep_last,
            chat_meta(cfg, parts.engine),
            self.progress.log,
            lambda: self.watchdog.beat("save"),
            parts.images.processor if parts.images is not None else None,
        )
        self.watchdog.plan(self.total_steps)

    def run(self, start: ResumePoint | None = None) -> list[dict]:
        cfg = self.cfg
        self.engine.model.train()
        start_step = start.step if start is not None else 0
        self.progress.first_step = start_step
        if start is not None:
            self.samples_consumed = start.samples_consumed
            if start.best_val_loss is not None:
                self.best_val_loss = start.best_val_loss
        metrics_log = (
            MetricsLog(
                RunFiles(self.work_dir).metrics,
                append=start_step > 0,
                sinks=open_sinks(cfg.log, self.work_dir, cfg.model_dump(mode="json"), start_step),
            )
            if self.is_main
            else None
        )
        history: list[dict] = []
        self.started = self.window_started = time.monotonic()
        self.clock = StepClock(self.engine.info.device)
        try:
            if cfg.eval.sample_at_start and cfg.eval.sample_prompts and start_step == 0:
                self.sample_chats(step=0)
            groups = self.parts.steps_from(start_step)
            with self.stops.graceful():  # to the last step, a stop signal ends the run at a step end, saved
                for step in range(start_step + 1, self.total_steps + 1):
                    self.watchdog.beat("data", training=step > 1, step=step, micro_step=0)
                    epoch, micro_batches = next(groups)
                    self.pending.append(self.train_step(step, epoch, micro_batches))
                    every = cfg.eval.every_steps
                    validating = bool(self.parts.validation) and (
                        (every and step % every == 0) or step == self.total_steps
                    )
                    sample_every = cfg.eval.sample_every_steps
                    sampling = bool(sample_every) and step % sample_every == 0 and step < self.total_steps
                    saving = bool(cfg.checkpoint.every_steps) and step % cfg.checkpoint.every_steps == 0
                    if not (validating or sampling or saving or self.reads_after(step)):
                        continue  # nothing of this step is needed on the host yet: the device goes on to the next
                    records = self.read_pending()
                    if validating:
                        validated = self.validate(step, epoch)
                        records[-1]["val_loss"] = validated.loss
                        records[-1].update({f"val_{name}": value for name, value in validated.metrics.items()})
                    for record in records:
                        if metrics_log is not None:
                            metrics_log.write(record)
                        history.append(record)
                        self.progress.step(record["step"], record)
                    if sampling:
                        self.sample_chats(step)
                    if saving:
                        saved = self.checkpointer.save_step(self.resume_point(step, epoch))
                        if self.checkpoint_scores is not None:
                            self.checkpoint_scores.score(step, saved)
                    self._stop_if_asked(step, epoch)
            if cfg.eval.sample_prompts:
                self.sample_chats(self.total_steps)
            if cfg.checkpoint.save_final:
                self.checkpointer.save_model("final", self.total_steps)
        finally:
            if metrics_log is not None:
                metrics_log.close()
            self.progress.close()
        return history

    def train_step(self, step: int, epoch: int, micro_batches: list[MicroBatch]) -> PendingStep:
        """One optimizer step, top to bottom: the gradient of the mean loss over every target token of the
        global batch, one clipped optimizer step (skipped on the device where not finite), all queued on the
        device without waiting for it; `read_pending` reads its figures later and checks them."""
        engine, train = self.engine, self.cfg.train
        started = self.clock.mark()
        planned = planned_micro_batches(len(self.parts.planner), train.gradient_accumulation, step)
        objective = self.parts.objective
        if objective.generates:
            self.watchdog.beat(GENERATION, training=step > 1)
        made = objective.prepare_step(micro_batches, step)
        self.write_samples(step, made.samples)
        # From the plan every rank holds: samples (a pair's answers as one), not rows, and no repeated filler row.
        self.samples_consumed += sum(mb.global_samples for mb in micro_batches) // self.parts.planner.group
        lr = self.schedule(step)
        updates = []
        for _ in range(objective.updates_per_step):  # one, but for online RL's updates per rollout
            self.watchdog.beat("forward/backward", training=step > 1, micro_steps=planned)
            observer = TrainerObserver(self, step, len(made.micro_batches))
            updates.append(accumulate_gradients(engine, made.micro_batches, objective, observer))
            loss_scale = engine.loss_scale  # the scale this update's gradients carry
            grad_norm = engine.step(lr, train.max_grad_norm)  # a device tensor, read with the step's sums
        accumulated = over_updates(updates)
        return PendingStep(
            step,
            epoch,
            lr,
            accumulated,
            grad_norm,
            loss_scale,
            engine.loss_scale,
            [mb.origins for mb in micro_batches],
            started,
            self.clock.mark(),
            peak_memory_gb(engine.info.device),
            made.figures,
        )

    def reads_after(self, step: int) -> bool:
        """Whether the host reads the queued steps' figures after `step` (checkpoints, validation and samples
        read them too): the first step of this process, the steps that print a line, the last step, and the
        stop checks. Every rank decides alike: from the config and the figures all of them read."""
        first = step == self.progress.first_step + 1
        logged = step % self.cfg.log.every_steps == 0
        return first or logged or step == self.total_steps or step >= self.next_check

    def read_pending(self) -> list[dict]:
        """The queued steps' figures in one host read, then each step's checks (non-finite, fp16 overflow) and
        record, in step order as if each had been read at its end; the stop votes of the last one, which hold
        every request made so far (a request stays until the run stops), and the next stop check."""
        pending, self.pending = self.pending, []
        norms = read_together([p.accumulated for p in pending], [p.grad_norm for p in pending])
        now = time.monotonic()
        self.step_seconds = (now - self.window_started) / len(pending)
        self.window_started = now
        last = pending[-1].accumulated
        self.stop_votes = last.stop_votes
        self.next_check = pending[-1].step + self.steps_between_checks(last.step_seconds / self.engine.info.world_size)
        return [self._checked_record(p, norm) for p, norm in zip(pending, norms, strict=True)]

    def steps_between_checks(self, seconds_per_step: float) -> int:
        """How many steps may go unread: `STOP_CHECKS_PER_GRACE` checks within the watchdog's stop grace at the
        ranks' mean pace (read from the step's sums, so the same number on every rank); 1 before it is known."""
        if seconds_per_step <= 0:
            return 1
        steps = int(self.stops.grace_s / STOP_CHECKS_PER_GRACE / seconds_per_step)
        return max(1, min(MAX_UNREAD_STEPS, steps))

    def _checked_record(self, pending: PendingStep, grad_norm: float) -> dict:
        accumulated, step = pending.accumulated, pending.step
        finite = math.isfinite(accumulated.loss) and math.isfinite(grad_norm)
        overflow = not finite and self._fp16_overflow(step, accumulated.loss, pending.loss_scale, pending.scale_after)
        if not finite and not overflow:
            self._nonfinite_step(step, accumulated.loss, grad_norm, pending.origins)
        self.nonfinite_in_row = 0 if finite or overflow else self.nonfinite_in_row + 1
        record = self._record(pending, grad_norm)
        if not finite:
            record["skipped"] = self.engine.skips_nonfinite
        if overflow:
            record["overflow"] = True
        if pending.loss_scale is not None:
            record["loss_scale"] = pending.loss_scale
        return record

    def _stop_if_asked(self, step: int, epoch: int) -> None:
        """After a step at which some rank had a stop signal: save a step checkpoint if the time left allows,
        then stop every rank with StoppedBySignal."""
        voted = [number for number, votes in zip(STOP_SIGNALS, self.stop_votes, strict=True) if votes]
        if not voted:
            return
        if step == self.total_steps:
            self.stops.clear()  # the run is complete: its final checkpoint comes next, as without a signal
            return
        self.stops.agree()
        received = voted[0]
        ranks = sum(self.stop_votes)
        self.progress.log(
            f"stopping after step {step}: {received.name} received by {ranks} of {self.engine.info.world_size} rank(s)"
        )
        checkpoint: Path | None = self.checkpoints_dir / f"step-{step}"
        every = self.cfg.checkpoint.every_steps
        if not (every and step % every == 0):
            checkpoint = self.checkpointer.save_before_stop(self.resume_point(step, epoch), self.stops.grace_left_s())
        message = StoppedBySignal(
            received.name, received, step, self.total_steps, str(checkpoint) if checkpoint else None
        )
        if self.is_main:
            RunFiles(self.work_dir).diagnostics.mkdir(exist_ok=True)
            RunFiles(self.work_dir).stopped.write_text(str(message) + "\n")
        raise message

    def _record(self, pending: PendingStep, grad_norm: float) -> dict:
        info, accumulated = self.engine.info, pending.accumulated
        seconds = self.clock.seconds(pending.started, pending.ended)
        record = {
            "step": pending.step,
            "epoch": pending.epoch,
            "loss": accumulated.loss,
            "lr": pending.lr,
            "grad_norm": grad_norm,
            "tokens_per_s": accumulated.num_tokens / seconds,
            "trained_tokens_per_s": accumulated.num_targets / seconds,
            "tokens": accumulated.num_tokens,
            "trained_tokens": accumulated.num_targets,
            "padding": 1 - accumulated.num_tokens / accumulated.num_slots,
            "elapsed_s": self.clock.since_origin(pending.ended),
        }
        flops = self.parts.flops_per_token * accumulated.num_tokens / seconds
        record["model_tflops"] = flops / 1e12
        if self.peak_flops:
            record["mfu"] = flops / (self.peak_flops * info.world_size)
        record["peak_memory_gb"] = pending.peak_memory_gb
        if accumulated.router_aux_loss is not None:
            record["router_aux_loss"] = accumulated.router_aux_loss
        record.update(accumulated.metrics)
        record.update(pending.figures)
        self._warn_if_nothing_learned(record)
        return record

    ZERO_STD_WARNING = 0.8
    """The share of prompt groups whose completions all got the same reward above which a step is said to teach
    little."""

    def _warn_if_nothing_learned(self, record: dict) -> None:
        """Once per run: most groups' completions rewarded alike have advantages of zero and teach nothing."""
        share = record.get("frac_reward_zero_std")
        if share is None or share < self.ZERO_STD_WARNING or self.zero_std_warned:
            return
        self.zero_std_warned = True
        self.progress.log(
            f"warning: at step {record['step']}, {share:.0%} of prompt groups got the same reward for every "
            "completion (advantage zero: nothing learned from them); the task is too easy or too hard for the "
            "model: raise rl.generations, rl.temperature, or choose prompts it solves sometimes"
        )

    def write_samples(self, step: int, samples: list[dict]) -> None:
        """A step's generated completions with their rewards into samples.jsonl, at the steps that log."""
        if not samples or not self.is_main or step % self.cfg.log.every_steps:
            return
        lines = [json.dumps({"step": step, **sample}, ensure_ascii=False) + "\n" for sample in samples]
        try:
            with RunFiles(self.work_dir).samples.open("a", encoding="utf-8") as handle:
                handle.writelines(lines)
        except OSError as exc:  # a full disk loses the samples, never the run
            self.progress.log(f"samples: not written ({exc.strerror or exc})")

    def _fp16_overflow(self, step: int, loss: float, loss_scale: float | None, scale_after: float | None) -> bool:
        """Under dynamic fp16 scaling, gradients that overflow at a scale above the minimum are the scaler's
        normal search for its scale: skipped and counted, not an error. A non-finite loss, or an overflow at
        the smallest or a fixed scale, is a real non-finite step."""
        fixed = self.cfg.train.loss_scale is not None
        if loss_scale is None or not math.isfinite(loss) or fixed or loss_scale <= 1.0:
            return False
        self.progress.log(
            f"step {step}: fp16 gradients overflowed at loss scale {loss_scale:g}; the step was skipped and the "
            f"scale lowered to {scale_after:g}"
        )
        return True

    def _nonfinite_step(self, step: int, loss: float, norm: float, micro_batch_origins: list[list[str]]) -> None:
        """Report the step with the samples of the whole global batch; stop after too many in a row."""
        mine = sorted({o for batch in micro_batch_origins for o in batch})
        origins = gather_objects(mine, self.engine.info)
        samples = sorted({o for rank_origins in origins for o in rank_origins})
        shown = ", ".join(samples[:8]) + (f" and {len(samples) - 8} more" if len(samples) > 8 else "")
        skipped = self.engine.skips_nonfinite
        self.progress.log(
            f"step {step}: loss {loss} / gradient norm {norm} is not finite; the step was "
            f"{'skipped' if skipped else 'applied (DeepSpeed cannot skip it)'}; its samples: {shown}"
        )
        in_row = self.nonfinite_in_row + 1
        if not skipped or in_row >= self.cfg.train.max_nonfinite_steps:
            raise UserError(
                f"training stopped at step {step}: {in_row} non-finite step(s) in a row "
                f"(train.max_nonfinite_steps={self.cfg.train.max_nonfinite_steps}); last samples: {shown}. Lower "
                "train.lr, check those samples, or resume from the last checkpoint with --resume auto"
            )

    def validate(self, step: int, epoch: int) -> ValidationResult:
        self.watchdog.beat("eval")
        result = validation_loss(self.engine, self.parts.validation or [], self.parts.objective)
        if self.cfg.checkpoint.keep_best and result.loss < self.best_val_loss:
            self.checkpointer.save_model("best", step)
        self.best_val_loss = min(self.best_val_loss, result.loss)
        self.watchdog.beat("eval")
        return result

    def sample_chats(self, step: int) -> None:
        evaluation = self.cfg.eval
        self.watchdog.beat(GENERATION, training=step > 0)
        prompts = [prompt_conversation([], prompt) for prompt in evaluation.sample_prompts]
        replies = generate_replies(
            self.engine.unwrapped,
            self.parts.tokenizer,
            self.parts.template,
            prompts,
            self.cfg.data.system if evaluation.sample_system is None else evaluation.sample_system,
            evaluation.sample_max_new_tokens,
            self.cfg.train.precision,
            synced=self.engine.generates_in_lockstep,
            on_batch=lambda: self.watchdog.beat(GENERATION, training=step > 0),
            images=self.parts.images,
        )
        if not self.is_main:
            return
        lines = []
        for prompt, reply in zip(evaluation.sample_prompts, replies, strict=True):
            self.progress.log(f"[sample @ step {step}] {prompt!r} -> {reply!r}")
            lines.append(json.dumps({"step": step, "prompt": prompt, "reply": reply}, ensure_ascii=False) + "\n")
        try:
            with RunFiles(self.work_dir).samples.open("a", encoding="utf-8") as handle:
                handle.write("".join(lines))
        except OSError as exc:  # a full disk ends the run at the next checkpoint, not here
            self.progress.log(f"warning: samples.jsonl: step {step}'s samples not written ({exc.strerror})")

    def resume_point(self, step: int, epoch: int) -> ResumePoint:
        """Where the run is after `step`: what a step checkpoint records for an exact resume."""
        train = self.cfg.train
        return ResumePoint(
            step=step,
            epoch=epoch,
            samples_consumed=self.samples_consumed,
            world_size=self.engine.info.world_size,
            micro_batch_size=train.micro_batch_size,
            gradient_accumulation=train.gradient_accumulation,
            engine=self.engine.name,
            best_val_loss=self.best_val_loss if self.best_val_loss < float("inf") else None,
            run_id=self.parts.run_id or None,
            sequence_parallel=self.parts.layout.size,
            train_data=self.data_signature,
            expert_parallel=self.cfg.parallel.expert_parallel,
            precision=train.precision,
            data_plan=data_plan(self.cfg),
        )


class TrainerObserver(StepObserver):
    """Heartbeats to the watchdog and the progress line's micro-step timing, for one step of a Trainer."""

    def __init__(self, trainer: Trainer, step: int, count: int):
        self.trainer = trainer
        self.watchdog = trainer.watchdog
        self.progress = trainer.progress
        self.step = step
        self.count = count
        self.last = time.monotonic()

    def micro_step_started(self, index: int) -> None:
        self.watchdog.beat("forward/backward", training=self.step > 1 or index > 1, micro_step=index)

    def micro_step_done(self, index: int) -> None:
        now = time.monotonic()
        self.watchdog.beat("forward/backward")
        self.progress.micro_step(self.step, index, self.count, now - self.last)
        self.last = now

    def micro_steps_over(self) -> None:
        self.watchdog.beat("optimizer")  # the closing sum is outside every module's forward and backward

    def stop_requests(self) -> tuple[int, ...]:
        received = self.trainer.stops.signal
        return tuple(int(received == number) for number in STOP_SIGNALS)

    def step_seconds(self) -> float:
        return self.trainer.step_seconds
