"""Stall watchdog: every stall becomes a per-rank diagnosis and a non-zero exit within a bounded time.

The training loop beats at every phase change (data, forward/backward, optimizer, generation, eval, save).
A monitor thread per rank, independent of the process group, does three things:

- writes this rank's heartbeat (phase, step, module, recent collectives) to `diagnostics/live/` every
  second: a side channel that works when the collectives are stuck, and across nodes on shared storage;
- warns when this rank waits in a collective for a peer that is busy elsewhere (a straggler: "slow");
- when this rank makes no progress for the limit, dumps every thread's stack and its recent collectives,
  waits briefly for the other ranks' dumps, lets the lowest rank that dumped write one report
  (`diagnostics/report.txt`, see `diagnostics.report`), and exits with STALL_EXIT_CODE.

The thread keeps running while the main thread is blocked in C code (collectives release the GIL).
`faulthandler` is armed as a backstop for a main thread that never releases the GIL, and writes every thread's
stack to `diagnostics/fatal-rank-R.txt` when the rank dies of a fatal signal (gloo and NCCL abort a rank
whose collectives do not pair up with its peers'); the collective in flight then is in the recorder's black
box (`diagnostics/live/collective-rank-R.bin`). The report reads both.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import select
import signal
import socket
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

from tuneforge.config.schema import WatchdogConfig
from tuneforge.diagnostics.files import (
    GENERATION,
    HEARTBEAT_EVERY_S,
    SLOW_PHASES,
    black_box_file,
    fatal_stacks_file,
    process_start_ticks,
    process_state,
    same_process_alive,
    write_json,
)
from tuneforge.diagnostics.heartbeats import Heartbeats
from tuneforge.diagnostics.recorder import RECORDER, CollectiveRecorder
from tuneforge.diagnostics.stacks import thread_stacks
from tuneforge.errors import ERRORS_DIR_ENV
from tuneforge.stop_requests import StopRequests

STALL_EXIT_CODE = 3
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
RECENT_COLLECTIVES = 32


BACKSTOP_MARGIN_S = 60.0
"""The backstop fires when the monitor thread itself has not run for twice the stall limit plus this."""
BACKSTOP_REARM_EVERY_S = 5.0
"""How often the monitor thread pushes the backstop back: while it runs, the backstop never fires."""

GONE_AFTER_S = 10 * HEARTBEAT_EVERY_S
"""A peer on another host whose heartbeat is this old is taken for gone. A busy rank's monitor thread can lag a
few seconds behind its schedule on loaded cores; a peer on this host is asked directly instead."""


def _gone(peer: dict, now: float) -> bool:
    """A peer that finished, whose process has ended or is stopped (SIGSTOP: it cannot vote) on this host, or
    whose heartbeat stopped (elsewhere)."""
    if peer.get("finished"):
        return True
    alive = same_process_alive(peer)
    if alive is None:
        return now - peer["updated"] > GONE_AFTER_S
    return not alive or process_state(int(peer["pid"])) in ("T", "t", "Z")


def _a_rank_met_a_user_error() -> bool:
    """Another rank stopped on a mistake in the config or data, which the launcher prints once the ranks ended: the
    stop that follows is its consequence, and a hint to resume would mislead."""
    directory = os.environ.get(ERRORS_DIR_ENV)
    return bool(directory) and any(Path(directory).glob("error-rank-*.json"))


class StallWatchdog:
    @classmethod
    def for_config(cls, settings: WatchdogConfig, diagnostics_dir: Path, rank: int, world_size: int) -> StallWatchdog:
        """The watchdog `watchdog:` asks for, on this rank."""
        return cls(
            diagnostics_dir,
            settings.startup_timeout_s,
            settings.stall_timeout_s,
            settings.enabled,
            rank=rank,
            world_size=world_size,
            floor_s=settings.stall_floor_s,
            step_multiple=settings.stall_step_multiple,
            generation_timeout_s=settings.generation_timeout_s,
            grace_s=settings.report_grace_s,
            stop_grace_s=settings.stop_grace_s,
        )

    def __init__(
        self,
        diagnostics_dir: Path,
        startup_timeout_s: float,
        stall_timeout_s: float | None,
        enabled: bool = True,
        *,
        rank: int = 0,
        world_size: int = 1,
        floor_s: float = 300.0,
        step_multiple: float = 10.0,
        grace_s: float = 10.0,
        stop_grace_s: float = 25.0,
        generation_timeout_s: float | None = None,
        recorder: CollectiveRecorder = RECORDER,
    ):
        self.diagnostics_dir = diagnostics_dir
        self.live_dir = diagnostics_dir / "live"
        self.heartbeats = Heartbeats(self.live_dir, rank, world_size)
        self.startup_timeout_s = startup_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.enabled = enabled
        self.rank = rank
        self.world_size = world_size
        self.floor_s = floor_s
        self.step_multiple = step_multiple
        self.grace_s = grace_s
        self.recorder = recorder
        self.pid_started = process_start_ticks(os.getpid())  # names this process in heartbeats, with its pid
        self.started_at = time.time()  # peers' heartbeats older than this are a previous attempt's
        self.phase = "startup"
        self.step = 0
        self.total_steps: int | None = None
        self.micro_step = 0
        self.micro_steps = 0
        self.last_beat = time.monotonic()
        self.started_training = False
        self.step_times: deque[float] = deque(maxlen=50)
        self._step_started: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._backstop_file = None
        self._fatal_file = None
        self._warned: set[tuple[int, int]] = set()
        self._failing = threading.Lock()
        # Graceful stop (`StopRequests`): the loop asks it at each step end; this watchdog receives the signals,
        # and dumps and stops at once a rank that cannot reach a step end within its grace.
        self.stops = StopRequests(stop_grace_s)
        self.generation_timeout_s = generation_timeout_s
        self._stop_announced = False

    # -- limits ---------------------------------------------------------------------------------------------
    @property
    def limit_s(self) -> float:
        if self.phase == GENERATION and self.generation_timeout_s is not None:
            return self.generation_timeout_s  # its own limit, also before the first step (sample_at_start)
        if not self.started_training or self.phase in SLOW_PHASES:
            return self.startup_timeout_s
        if self.stall_timeout_s is not None:
            return self.stall_timeout_s
        if not self.step_times:
            return self.startup_timeout_s
        return max(self.floor_s, self.step_multiple * statistics.median(self.step_times))

    @property
    def silence_limit_s(self) -> float:
        """How long a peer's heartbeat may go unwritten, in any phase, before that peer counts as stalled. Its
        monitor thread writes it every second whatever the main thread does (a slow save, a long reference pass,
        a wait in a collective), so silence means the process itself stopped: SIGSTOP, a debugger, a frozen
        node. The limit is the training stall limit, never the start-up one (a save's peers would otherwise wait
        30 minutes for a rank frozen in it), and at least a few missed beats (a busy host's thread lags)."""
        if self.stall_timeout_s is not None:
            limit = self.stall_timeout_s
        elif self.step_times:
            limit = max(self.floor_s, self.step_multiple * statistics.median(self.step_times))
        else:
            limit = self.floor_s
        return max(limit, GONE_AFTER_S)

    @property
    def warn_after_s(self) -> float:
        """How long a wait in a collective for a busy peer is worth a "slow" line."""
        return max(1.0, self.limit_s / 4)

    # -- life cycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self.recorder.phase = self.phase
        if not self.enabled:
            return
        self.live_dir.mkdir(parents=True, exist_ok=True)
        self._backstop_file = (self.diagnostics_dir / f"backstop-stacks-rank{self.rank}.txt").open("w")
        self._arm_backstop()
        self._fatal_file = fatal_stacks_file(self.diagnostics_dir, self.rank).open("w")
        faulthandler.enable(file=self._fatal_file, all_threads=True)
        if self.world_size > 1:
            self.recorder.arm_black_box(black_box_file(self.diagnostics_dir, self.rank))
        if threading.current_thread() is threading.main_thread():
            self._catch_stop_signals()
        self._write_heartbeat()
        self._thread = threading.Thread(target=self._watch, name="tuneforge-watchdog", daemon=True)
        self._thread.start()

    def plan(self, total_steps: int) -> None:
        """The run's length, shown in heartbeats (and `tuneforge watch`)."""
        self.total_steps = total_steps

    def beat(
        self,
        phase: str,
        training: bool = True,
        step: int | None = None,
        micro_step: int | None = None,
        micro_steps: int | None = None,
    ) -> None:
        """Record progress. `training=True` marks that the first micro-step is done (the step-based limit
        applies from then on)."""
        now = time.monotonic()
        publish = phase != self.phase and phase in (*SLOW_PHASES, "eval", GENERATION)
        if step is not None and step != self.step:
            if self._step_started is not None and self.started_training:
                self.step_times.append(now - self._step_started)
            self._step_started = now
            self.step = step
            publish = True
        if micro_step is not None:
            self.micro_step = micro_step
        if micro_steps is not None:
            self.micro_steps = micro_steps
        self.phase = phase
        self.recorder.phase = phase
        self.last_beat = now
        if publish:
            # Steps and rare phases are published at once, so a rank that dies right after still told the others
            # where it was (the monitor thread only writes every second).
            self._write_heartbeat()
        if training and not self.started_training:
            self.started_training = True
            if self.enabled:
                self._arm_backstop()

    def stop(self, outcome: str = "finished") -> None:
        """Ends the monitor; the last heartbeat says this rank is done and how (`finished` or `failed`), which is
        how `tuneforge watch` tells a crash from the end of training."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            faulthandler.cancel_dump_traceback_later()
            if threading.current_thread() is threading.main_thread() and hasattr(self, "_signal_read"):
                faulthandler.unregister(signal.SIGTERM)
                signal.set_wakeup_fd(self._previous_wakeup_fd)
                for number, previous in self._previous_handlers.items():
                    signal.signal(number, previous if previous is not None else signal.SIG_DFL)
                os.close(self._signal_read)
                os.close(self._signal_write)
            self._backstop_file.close()
            (self.diagnostics_dir / f"backstop-stacks-rank{self.rank}.txt").unlink(missing_ok=True)
            faulthandler.disable()
            self._fatal_file.close()
            fatal_stacks_file(self.diagnostics_dir, self.rank).unlink(missing_ok=True)
            self.recorder.disarm_black_box()
            black_box_file(self.diagnostics_dir, self.rank).unlink(missing_ok=True)
            self._write_heartbeat(finished=True, outcome=outcome)

    def _arm_backstop(self) -> None:
        # Pushed back by the monitor thread every few seconds (not per beat): it fires only if that thread itself
        # cannot run, for twice the limit and a margin. Armed once, it ended every run that long, progressing or not.
        faulthandler.dump_traceback_later(
            self.limit_s * 2 + BACKSTOP_MARGIN_S, repeat=False, file=self._backstop_file, exit=True
        )

    # -- stop signals -----------------------------------------------------------------------------------------
    def _catch_stop_signals(self) -> None:
        """SIGTERM (schedulers preempting, torchrun stopping the ranks when one failed) and SIGINT (Ctrl-C).

        Python runs signal handlers only when the main thread returns to the interpreter, which a rank blocked
        in a collective never does, but the C-level handler writes the signal number to the wakeup fd at once:
        the monitor thread reads it. In the training loop a signal asks for a graceful stop (finish the step,
        save, exit); a rank stuck waiting for a peer that is gone, or a signal outside the loop, is dumped as
        evidence and exits at once."""
        self._signal_read, signal_write = os.pipe()
        os.set_blocking(signal_write, False)
        self._terminated = threading.Event()

        def on_signal(number: int, _frame: object) -> None:  # in the main thread, between two bytecodes
            if self.stops.agreed:
                return  # the ranks are already saving and stopping together
            if self.stops.inside:
                self.stops.request(signal.Signals(number))
                return  # the loop stops at the step's end; the monitor thread handles a repeat
            if self._failing.locked():
                # This thread was writing a failure's dump (it may hold the recorder's lock): let it finish.
                return
            self._terminated.wait(10)  # the monitor thread writes its dump first
            os._exit(128 + number)

        self._previous_handlers = {number: signal.signal(number, on_signal) for number in STOP_SIGNALS}
        self._previous_wakeup_fd = signal.set_wakeup_fd(signal_write)
        self._signal_write = signal_write
        # C-level stacks as well (the backstop file), then the handler above.
        faulthandler.register(signal.SIGTERM, file=self._backstop_file, all_threads=True, chain=True)

    def _on_signals(self) -> None:
        ready, _, _ = select.select([self._signal_read], [], [], 0)
        if not ready:
            return
        for number in os.read(self._signal_read, 64):
            if number not in STOP_SIGNALS:
                continue
            received = signal.Signals(number)
            if self.stops.agreed:
                # After the agreement a peer that finished first exits, and torchrun then signals the others:
                # they are stopping already. With every peer still at work it is the user's second request.
                if not self.stops.repeated() and not self._a_peer_is_gone():
                    self._terminate(received, "a second time, while saving for the stop: stopping at once")
                continue
            if not self.stops.inside:
                self._terminate(
                    received,
                    "the launcher stops every rank when one fails"
                    if number == signal.SIGTERM and self.world_size > 1
                    else "",
                )
            elif self._a_peer_is_gone():
                self._terminate(received, "a rank is gone, so the ranks cannot agree on a step to stop at")
            elif not self.stops.request(received):
                self._terminate(received, "a second time: stopping at once, without a checkpoint")

    def _check_graceful_stop(self) -> None:
        stops = self.stops
        if stops.signal is None or stops.agreed:
            return
        # Said here, not in the signal handler, which may interrupt a print of the main thread.
        if not self._stop_announced and self.rank == 0:
            self._stop_announced = True
            print(
                f"tuneforge: rank {self.rank}: {stops.signal.name} received: finishing step {max(self.step, 1)}, "
                f"then saving a checkpoint and stopping (within watchdog.stop_grace_s={stops.grace_s:g}s; send "
                "it again to stop at once)",
                file=sys.stderr,
                flush=True,
            )
        if self._a_peer_is_gone():
            self._terminate(stops.signal, "a rank is gone, so the ranks cannot agree on a step to stop at")
        if stops.waited_s() > stops.grace_s:
            self._terminate(
                stops.signal,
                f"step {self.step} did not end within watchdog.stop_grace_s={stops.grace_s:g}s: stopping without "
                "a checkpoint",
            )

    def _a_peer_is_gone(self) -> bool:
        """A rank that exited or stopped publishing its heartbeat: the agreement a graceful stop needs (every
        rank's vote in one all-reduce) can no longer happen. A rank blocked in a collective or an async handle's
        wait still publishes (the monitor thread writes it), so a slow peer is not taken for a gone one."""
        if self.world_size == 1:
            return False
        now = time.time()
        peers = self.peers()
        return len(peers) < self.world_size - 1 or any(_gone(peer, now) for peer in peers.values())

    def _terminate(self, received: signal.Signals, why: str) -> None:
        detail = f"stopped by {received.name}" + (f" ({why})" if why else "")
        if self._failing.acquire(blocking=False):
            self.dump("terminated", detail)
        else:
            # The main thread is writing this rank's dump of a failure, the better evidence: wait for it.
            deadline = time.monotonic() + 10
            while not (self.diagnostics_dir / f"rank-{self.rank}.json").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        if self.rank == 0 and not _a_rank_met_a_user_error():
            where = f"step {self.step}" if self.step else f"phase {self.phase}, before the first step"
            print(
                f"tuneforge: {detail}, at {where}; --resume auto continues from the newest step checkpoint, if any",
                file=sys.stderr,
                flush=True,
            )
        self._terminated.set()
        os._exit(128 + received)

    # -- monitor thread -------------------------------------------------------------------------------------
    def _watch(self) -> None:
        last_heartbeat, last_armed = 0.0, time.monotonic()
        while not self._stop.wait(0.25):
            if hasattr(self, "_signal_read"):
                self._on_signals()
                self._check_graceful_stop()
            now = time.monotonic()
            if now - last_armed >= BACKSTOP_REARM_EVERY_S:
                self._arm_backstop()
                last_armed = now
            if now - last_heartbeat >= HEARTBEAT_EVERY_S:
                self._write_heartbeat()
                last_heartbeat = now
                if self.world_size > 1 and (silent := self._silent_peer()) is not None:
                    self.fail("stall", silent)
            self._check_request()
            idle = now - self.last_beat
            if self.world_size > 1 and idle > self.warn_after_s:
                self._warn_if_waiting_for_a_straggler()
            if idle > self.limit_s:
                if self.world_size > 1 and self._peer_still_progressing():
                    continue  # collectives are still moving: slow, not hung; the "slow" lines say who
                self.fail("stall", f"no progress for {idle:.0f}s (limit {self.limit_s:.0f}s)")

    def state(self) -> dict:
        in_flight = self.recorder.in_flight
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_started": self.pid_started,
            "phase": self.phase,
            "step": self.step,
            "total_steps": self.total_steps,
            "micro_step": self.micro_step,
            "micro_steps": self.micro_steps,
            "module": self.recorder.module,
            "seq": self.recorder.seq,
            "in_flight": in_flight.describe() if in_flight is not None else None,
            "in_flight_seq": in_flight.seq if in_flight is not None else None,
            "idle_s": time.monotonic() - self.last_beat,
            "limit_s": self.limit_s,
            "step_times": list(self.step_times)[-10:],
            "updated": time.time(),
        }

    def _write_heartbeat(self, finished: bool = False, outcome: str | None = None) -> None:
        if not self.enabled:
            return
        self.heartbeats.write(
            {
                **self.state(),
                "finished": finished,
                "outcome": outcome,
                "collectives": self.recorder.snapshot()[-RECENT_COLLECTIVES:],
            }
        )

    def peers(self) -> dict[int, dict]:
        return self.heartbeats.peers()

    def _peer_still_progressing(self) -> bool:
        now = time.time()
        return any(
            now - p["updated"] < 3 * HEARTBEAT_EVERY_S and p["idle_s"] < self.limit_s and not p.get("finished")
            for p in self.peers().values()
        )

    def _silent_peer(self) -> str | None:
        """Why a peer of this attempt counts as stalled because its heartbeat stopped (None while every peer
        beats, finished, or has not written one yet: the start-up limit covers a peer that never started)."""
        now, limit = time.time(), self.silence_limit_s
        for rank, peer in sorted(self.peers().items()):
            updated = peer.get("updated")
            if not isinstance(updated, (int, float)) or updated < self.started_at or peer.get("finished"):
                continue
            if now - updated > limit:
                return (
                    f"rank {rank} stopped beating: its last heartbeat, in phase {peer.get('phase')} at step "
                    f"{peer.get('step')}, is {now - updated:.0f}s old (limit {limit:.0f}s); this rank was in phase "
                    f"{self.phase}"
                )
        return None

    def _warn_if_waiting_for_a_straggler(self) -> None:
        waiting = self.recorder.in_flight
        if waiting is None:
            return
        now = time.time()
        waited = now - waiting.started
        for rank, peer in self.peers().items():
            behind = peer["seq"] < waiting.seq and peer.get("in_flight") is None
            fresh = now - peer["updated"] < 3 * HEARTBEAT_EVERY_S
            # Busy, not stuck: loading data, or it made progress since this rank started waiting. (A peer blocked
            # in a collective that runs in C++, such as DDP's, looks idle in another phase: that is a hang.)
            busy = peer["phase"] == "data" or peer["idle_s"] < waited - 2 * HEARTBEAT_EVERY_S
            fresh = fresh and busy
            if not (behind and fresh) or (self.step, rank) in self._warned:
                continue
            self._warned.add((self.step, rank))
            times = ", ".join(
                f"rank {r}: {statistics.median(p['step_times']):.2f}s"
                for r, p in sorted({**self.peers(), self.rank: self.state()}.items())
                if p.get("step_times")
            )
            print(
                f"tuneforge watchdog: slow, not hung: rank {self.rank} has waited {now - waiting.started:.1f}s in "
                f"{waiting.op} #{waiting.seq} for rank {rank}, which is busy in phase '{peer['phase']}' at step "
                f"{peer['step']} ({peer['idle_s']:.1f}s so far); straggler: rank {rank}"
                + (f". Median step times: {times}" if times else ""),
                file=sys.stderr,
                flush=True,
            )

    # -- live dumps -----------------------------------------------------------------------------------------
    def _check_request(self) -> None:
        """`tuneforge diagnose --live` asks by writing a request file: dump without stopping."""
        request = self.live_dir / "request"
        try:
            requested = request.stat().st_mtime
        except OSError:
            return
        answered = self.live_dir / f"answered-rank-{self.rank}"
        if answered.exists() and answered.stat().st_mtime >= requested:
            return
        self.dump("live", "requested by tuneforge diagnose --live", prefix="live")
        with contextlib.suppress(OSError):  # a full disk: the request stays unanswered, training goes on
            answered.touch()

    # -- failure --------------------------------------------------------------------------------------------
    def dump(self, reason: str, detail: str, prefix: str = "rank", where: str | None = None) -> Path:
        stacks, main_where = thread_stacks()
        where = where or main_where
        state = {
            **self.state(),
            "reason": reason,
            "detail": detail,
            "where": where,
            "collectives": self.recorder.snapshot(),
        }
        text = f"rank {self.rank}: {reason}: {detail}\nphase {self.phase}, step {self.step}, at {where}\n\n{stacks}"
        path = self.diagnostics_dir / f"{prefix}-{self.rank}.json"
        try:
            (self.diagnostics_dir / f"stacks-{prefix}-{self.rank}.txt").write_text(text)
            write_json(path, state)
        except OSError as exc:  # a full disk: the evidence goes to the terminal instead of being lost
            with contextlib.suppress(OSError):
                print(f"tuneforge: {self.diagnostics_dir} not written ({exc.strerror or exc}); {text}", file=sys.stderr)
        return path

    def fail(self, reason: str, detail: str, exit_process: bool = True, where: str | None = None) -> None:
        """Dump, coordinate one report across ranks, print it, and (from the monitor thread) exit."""
        from tuneforge.diagnostics.report import collect_and_report

        if not self._failing.acquire(blocking=False):
            return
        try:
            self.dump(reason, detail, where=where)
            report = collect_and_report(self.diagnostics_dir, self.rank, self.world_size, self.grace_s)
            if report is not None:
                print(report, file=sys.stderr, flush=True)
        finally:  # whatever the report met (a full disk, a closed terminal), a stalled rank ends
            if exit_process:
                os._exit(STALL_EXIT_CODE)
