"""`tuneforge train --nproc-per-node N`: start the workers with PyTorch's elastic launcher (torchrun)."""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser
from torch.distributed.run import run as elastic_run

from tuneforge.diagnostics.files import STOPPED
from tuneforge.diagnostics.report import REPORT, build_report
from tuneforge.errors import UserError, first_line
from tuneforge.launcher_watch import LAUNCHER_PID
from tuneforge.watchdog import STALL_EXIT_CODE

USER_ERROR_EXIT = 2
"""What `tuneforge` exits with after printing a UserError."""


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
    heartbeats and exit statuses."""
    launcher_args = [
        f"--nproc-per-node={nproc_per_node}",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--master-addr={master_addr}",
        f"--master-port={master_port}",
        "--module",
        "tuneforge",
        *argv,
    ]
    args = get_args_parser().parse_args(launcher_args)
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the workers' way to tell this launcher from init as process 1
    if node_rank == 0:
        check_port_free(master_addr, master_port)
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
        # SIGTERM or SIGINT to the launcher: torchrun passed it on to the ranks and waited for them to stop.
        if not _stopped_together(work_dir, started):
            print(f"tuneforge: stopped by {exc.sigval.name}", file=sys.stderr)
        return 128 + exc.sigval
    except ChildFailedError as exc:
        if _stopped_together(work_dir, started):
            return exc.get_first_failure()[1].exitcode  # the ranks said why and how to resume
        report_failure(exc, work_dir, nproc_per_node * nnodes, started)
        # A configuration or data error and a stall keep their own status, as in one process; anything else is a
        # failure.
        first = exc.get_first_failure()[1].exitcode
        if first == USER_ERROR_EXIT:
            return USER_ERROR_EXIT
        return STALL_EXIT_CODE if any(f.exitcode == STALL_EXIT_CODE for f in exc.failures.values()) else 1
    return 0


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
    marker = work_dir / "diagnostics" / STOPPED
    return marker.exists() and marker.stat().st_mtime >= started


def report_failure(exc: ChildFailedError, work_dir: Path | None, world_size: int, started: float) -> None:
    first_rank_failed, first = exc.get_first_failure()
    print(f"tuneforge: rank {first_rank_failed} failed first (exit {first.exitcode})", file=sys.stderr)
    if work_dir is None or first.exitcode == USER_ERROR_EXIT:
        return  # a configuration or data error, already explained by the ranks: not a hang
    diagnostics = work_dir / "diagnostics"
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
