"""`tuneforge train --nproc-per-node N`: start the workers with PyTorch's elastic launcher (torchrun)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser
from torch.distributed.run import run as elastic_run

from tuneforge.diagnostics.report import REPORT, build_report
from tuneforge.errors import ERRORS_DIR_ENV, UserError, first_line
from tuneforge.launcher_watch import LAUNCHER_PID
from tuneforge.run_files import RunFiles
from tuneforge.stop_requests import SAME_STOP_S
from tuneforge.watchdog import STALL_EXIT_CODE, STOP_SIGNALS

USER_ERROR_EXIT = 2
"""What `tuneforge` exits with after printing a UserError."""
SHUTDOWN_TIMEOUT_S = 2 * 3600
"""torchrun's wait for the workers after a stop signal (or a failed rank) before it SIGKILLs them. Its default,
30 s, cut short a large model's stop checkpoint; the ranks bound their own stop (watchdog.stop_grace_s for the
step, the save's limit, 30 minutes by default), a second signal stops them at once and a third kills them
(`see_workers_out`). Bounded all the same, so a rank that answers nothing is never waited on for good."""


def launch_workers(
    argv: list[str],
    nproc_per_node: int,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    work_dir: Path | None = None,
) -> int:
    """Run `python -m tuneforge <argv>` in N workers per node; returns non-zero if any worker failed. When a
    worker fails without the watchdog's report (killed, crashed), the report is built here from the ranks'
    heartbeats and exit statuses. A UserError is said once: by rank 0, and here for what the other ranks met
    (`report_user_errors`), without torchrun's lines about the failed worker."""
    launcher_args = [
        f"--nproc-per-node={nproc_per_node}",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--master-addr={master_addr}",
        f"--master-port={master_port}",
        f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}",
        "--module",
        "tuneforge",
        *argv,
    ]
    args = get_args_parser().parse_args(launcher_args)
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the workers' way to tell this launcher from init as process 1
    if node_rank == 0:
        check_port_free(master_addr, master_port)
    # Where the local workers leave their UserErrors (errors.say_user_error): this node's own, never a stale one.
    errors_dir = Path(tempfile.mkdtemp(prefix="tuneforge-errors-"))
    os.environ[ERRORS_DIR_ENV] = str(errors_dir)
    quiet = QuietOnUserError(errors_dir)
    ELASTIC_LOG.addFilter(quiet)
    try:
        return _run_workers(args, master_addr, master_port, nnodes, nproc_per_node, work_dir, errors_dir)
    finally:
        ELASTIC_LOG.removeFilter(quiet)
        os.environ.pop(ERRORS_DIR_ENV, None)
        shutil.rmtree(errors_dir, ignore_errors=True)


ELASTIC_LOG = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
"""torchrun's logger of its workers' ends: `Sending process N closing signal SIGTERM` (to the ranks still running
when one failed) and `failed (exitcode: N) local_rank: ...` (the first failure)."""


class QuietOnUserError(logging.Filter):
    """Drops torchrun's lines about the ranks' ends when they stopped on a UserError: the error says what happened
    and the exit status is the launcher's. Any other failure keeps them, and the launcher's own report."""

    def __init__(self, errors_dir: Path):
        super().__init__()
        self.errors_dir = errors_dir

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("failed (exitcode:"):
            return not (record.args and isinstance(record.args, tuple) and record.args[0] == USER_ERROR_EXIT)
        if message.startswith("Sending process") and "closing signal" in message:
            try:
                return not any(self.errors_dir.glob("error-rank-*.json"))
            except OSError:
                return True
        return True


def _run_workers(
    args, master_addr: str, master_port: int, nnodes: int, nproc_per_node: int, work_dir: Path | None, errors_dir: Path
) -> int:
    started = time.time()
    try:
        elastic_run(args)
    except DistNetworkError as exc:  # the rendezvous could not listen or connect
        reason = first_line(exc, 300)
        raise UserError(
            f"the launcher's rendezvous on {master_addr}:{master_port} failed ({reason}); check --master-addr and "
            "--master-port (a free port on node 0, reachable from every node)"
        ) from None
    except DistStoreError as exc:  # a node that never joined (or joined another port) within the timeout
        reason = first_line(exc, 300)
        raise UserError(
            f"the launcher's rendezvous on {master_addr}:{master_port} did not complete ({reason}); start all "
            f"{nnodes} node(s) with the same --nnodes, --master-addr and --master-port, each with its own --node-rank"
        ) from None
    except SignalException as exc:
        # SIGTERM or SIGINT to the launcher: torchrun passed it on to the ranks and waited for them to stop, unless
        # a second signal ended its wait.
        see_workers_out(exc.sigval)
        if not _stopped_together(work_dir, started):
            print(f"tuneforge: stopped by {exc.sigval.name}", file=sys.stderr)
        return 128 + exc.sigval
    except ChildFailedError as exc:
        if _stopped_together(work_dir, started):
            return exc.get_first_failure()[1].exitcode  # the ranks said why and how to resume
        report_failure(exc, work_dir, nproc_per_node * nnodes, started, errors_dir)
        # A configuration or data error and a stall keep their own status, as in one process; anything else is a
        # failure.
        first = exc.get_first_failure()[1].exitcode
        if first == USER_ERROR_EXIT:
            return USER_ERROR_EXIT
        return STALL_EXIT_CODE if any(f.exitcode == STALL_EXIT_CODE for f in exc.failures.values()) else 1
    return 0


def _live_children() -> list[int]:
    """This process's children that have not ended: the local workers (torchrun's agent runs in this process)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue  # ended meanwhile
        if int(parent) == me and state != "Z":
            found.append(int(entry.name))
    return found


def _signal_workers(workers: list[int], number: int) -> None:
    for pid in workers:
        try:
            os.killpg(pid, number)  # each worker leads a session of its own, as torchrun starts them
        except (ProcessLookupError, PermissionError):
            continue


def see_workers_out(interrupting: signal.Signals) -> None:
    """A second signal while torchrun waits for the workers to stop ends its wait (it raises from its signal
    handler) but not the workers, which the first made finish the step and save a checkpoint, in sessions of their
    own that a terminal's next Ctrl-C never reaches. Returning then left them working on without a launcher (and
    the launcher-watch thread then ended them mid-save). So the launcher stays until they end, and passes each
    signal on: the ranks take one within SAME_STOP_S of the last for the same request delivered twice (a double
    Ctrl-C), a later one as a second request (stop at once); a third later one kills them."""
    workers = _live_children()
    if not workers:
        return
    received: list[int] = []
    previous = {number: signal.signal(number, lambda n, _frame: received.append(n)) for number in STOP_SIGNALS}
    print(
        "tuneforge: waiting for the ranks to stop (send the signal again to stop them at once)",
        file=sys.stderr,
        flush=True,
    )
    passed = [time.monotonic()]
    _signal_workers(workers, interrupting)
    try:
        while workers := _live_children():
            while received:
                number, now = received.pop(0), time.monotonic()
                if len(passed) >= 2 and now - passed[-1] > SAME_STOP_S:
                    print("tuneforge: stopping the ranks now (SIGKILL)", file=sys.stderr, flush=True)
                    _signal_workers(workers, signal.SIGKILL)
                else:
                    _signal_workers(workers, number)
                passed.append(now)
            time.sleep(0.1)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def check_port_free(address: str, port: int) -> None:
    """Node 0's launcher listens on `port`: one in use (another job's launcher, often) gives torch's
    DistNetworkError traceback, so it is tried first and named."""
    import socket

    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("" if address in ("127.0.0.1", "localhost") else address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UserError(
                    f"--master-port {port}: in use on this machine (another job's launcher?); pick a free one, e.g. "
                    "--master-port 29501"
                ) from None
            # Not an address of this machine, or not bindable here: torch's own error will say more.


def _stopped_together(work_dir: Path | None, started: float) -> bool:
    """The ranks agreed to stop on a signal, saved what they could and said so: not a failure to diagnose."""
    if work_dir is None:
        return False
    marker = RunFiles(work_dir).stopped
    return marker.exists() and marker.stat().st_mtime >= started


def report_failure(
    exc: ChildFailedError, work_dir: Path | None, world_size: int, started: float, errors_dir: Path | None = None
) -> None:
    first_rank_failed, first = exc.get_first_failure()
    if first.exitcode == USER_ERROR_EXIT and errors_dir is not None and report_user_errors(errors_dir):
        return  # a configuration or data error, explained: not a hang
    print(f"tuneforge: rank {first_rank_failed} failed first (exit {first.exitcode})", file=sys.stderr)
    if work_dir is None or first.exitcode == USER_ERROR_EXIT:
        return  # a configuration or data error, already explained by the ranks: not a hang
    diagnostics = RunFiles(work_dir).diagnostics
    report = diagnostics / REPORT
    if report.exists() and report.stat().st_mtime >= started:
        print(f"tuneforge: diagnosis above, and in {report}", file=sys.stderr)
        return
    if not diagnostics.exists():
        return
    exit_codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
    text = build_report(diagnostics, world_size, exit_codes)
    print(text, file=sys.stderr)
    try:
        report.write_text(text + "\n")
    except OSError as write_error:  # a full disk may be why the ranks failed: the report is printed anyway
        print(f"tuneforge: {report} not written ({write_error.strerror})", file=sys.stderr)


def report_user_errors(errors_dir: Path) -> bool:
    """Print the UserErrors the local ranks left (errors.say_user_error) that rank 0 did not say itself: each
    distinct one once, with the ranks that met it (`error: ranks 1-3: ...`); a shared one (every rank met it
    together), which is rank 0's to say, only when rank 0 left nothing here (killed first, or on another node), and
    without ranks. Returns whether any rank left one: then every one has been said."""
    left: dict[int, dict] = {}
    for path in errors_dir.glob("error-rank-*.json"):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            left[int(record["rank"])] = {
                "message": str(record["message"]),
                "shared": bool(record["shared"]),
                "said": bool(record.get("said")),
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    rank_0 = left.get(0)
    pending: dict[tuple[str, bool], list[int]] = {}
    for rank in sorted(left):
        record = left[rank]
        if rank_0 is not None and (record["shared"] or record["message"] == rank_0["message"]):
            continue  # rank 0 printed its own error, and says (or said) a shared one
        if record["said"]:
            continue
        pending.setdefault((record["message"], record["shared"]), []).append(rank)
    for (message, shared), ranks in pending.items():
        where = "" if shared else f"{rank_list(ranks)}: "
        print(f"error: {where}{message}", file=sys.stderr, flush=True)
    return bool(left)


def rank_list(ranks: list[int]) -> str:
    """`rank 3`, `ranks 1, 3`, `ranks 1-7, 9`: sorted ranks, runs of three or more as ranges."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    parts = []
    for run in runs:
        parts += [f"{run[0]}-{run[-1]}"] if len(run) >= 3 else [str(r) for r in run]
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(parts)}"
