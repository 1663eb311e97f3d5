"""A stall becomes stacks on disk, a message naming the phase and the line, and a non-zero exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tuneforge.watchdog import STALL_EXIT_CODE

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from tuneforge.watchdog import StallWatchdog

    def stuck_in_a_collective():
        time.sleep(60)

    dog = StallWatchdog(Path(sys.argv[1]), startup_timeout_s=30, stall_timeout_s=1.0)
    dog.start()
    for _ in range(3):
        dog.beat("forward/backward")
        time.sleep(0.2)
    dog.beat("optimizer")
    stuck_in_a_collective()
    """
)


def run_script(tmp_path, script: str) -> subprocess.CompletedProcess:
    path = tmp_path / "job.py"
    path.write_text(script)
    return subprocess.run([sys.executable, str(path), str(tmp_path)], capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_stall_dumps_stacks_and_exits_non_zero(tmp_path):
    result = run_script(tmp_path, SCRIPT)
    assert result.returncode == STALL_EXIT_CODE
    assert "tuneforge diagnosis: HANG (stuck)" in result.stderr
    assert "rank 0 (stall): phase optimizer" in result.stderr and "in stuck_in_a_collective" in result.stderr
    assert "no progress for 1s (limit 1s)" in result.stderr
    assert result.stderr.count("tuneforge diagnosis") == 1
    assert (tmp_path / "report.txt").read_text().startswith("tuneforge diagnosis: HANG")
    dump = (tmp_path / "stacks-rank-0.txt").read_text()
    assert "stuck_in_a_collective" in dump and "time.sleep(60)" in dump


@pytest.mark.slow
def test_no_report_while_progress_continues(tmp_path):
    script = SCRIPT.replace("stuck_in_a_collective()\n", "dog.stop()\n").replace("range(3)", "range(10)")
    result = run_script(tmp_path, script)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "stacks-rank-0.txt").exists() and not (tmp_path / "report.txt").exists()


def test_a_stop_signal_delivered_twice_at_once_is_one_request_and_a_later_one_a_second():
    """A terminal's Ctrl-C reaches every process and torchrun forwards it again: one request. A signal sent
    later means "now": `request` says so and the caller stops at once."""
    import signal

    from tuneforge.stop_requests import SAME_STOP_S, StopRequests

    stops = StopRequests(grace_s=25)
    with stops.graceful():
        assert stops.inside and stops.waited_s() == 0
        assert stops.request(signal.SIGINT) and stops.signal == signal.SIGINT
        assert stops.request(signal.SIGINT) and stops.request(signal.SIGTERM)
        assert stops.signal == signal.SIGINT  # the first one names the stop
        stops.requested_at -= SAME_STOP_S + 1
        assert not stops.request(signal.SIGTERM) and 23 - SAME_STOP_S < stops.grace_left_s() < 24 - SAME_STOP_S
    assert not stops.inside


@pytest.mark.trivial_process("two `python -c` one-liners without imports: a pid that has ended, one stopped")
def test_a_peer_is_gone_when_its_heartbeat_is_missing_stale_or_finished(tmp_path):
    """What ends a graceful stop's wait at once: the ranks can no longer all vote on a step to stop at. A peer
    on another host is judged by its heartbeat's age, with room for a busy rank's lagging monitor thread; a
    peer on this host by its process (the full suite on 2 cores once delayed a heartbeat past 3 s)."""
    import json
    import signal
    import socket
    import time

    from tuneforge.diagnostics.files import process_start_ticks
    from tuneforge.watchdog import GONE_AFTER_S, StallWatchdog

    dog = StallWatchdog(tmp_path, startup_timeout_s=30, stall_timeout_s=None, rank=0, world_size=2)
    (tmp_path / "live").mkdir()
    assert dog._a_peer_is_gone()  # rank 1 never wrote a heartbeat
    beat = tmp_path / "live" / "rank-1.json"
    elsewhere = {"rank": 1, "host": "another-node", "pid": 1}
    for age, finished, gone in [(5, False, False), (GONE_AFTER_S + 1, False, True), (0, True, True)]:
        beat.write_text(json.dumps({**elsewhere, "updated": time.time() - age, "finished": finished}))
        assert dog._a_peer_is_gone() == gone, (age, finished)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while process_state(frozen.pid) != "T":  # the stop takes effect asynchronously
            assert time.monotonic() < deadline, f"process {frozen.pid} never stopped"
            time.sleep(0.01)
        here, me = socket.gethostname(), os.getpid()
        for pid, started, gone in [
            (me, process_start_ticks(me), False),  # alive: not gone, however old its heartbeat
            (int(ended.stdout), None, True),  # its process has ended
            (me, (process_start_ticks(me) or 0) + 1, True),  # the pid names another process now
            (frozen.pid, process_start_ticks(frozen.pid), True),  # stopped (SIGSTOP): it cannot vote
        ]:
            stale = {"rank": 1, "host": here, "pid": pid, "pid_started": started, "updated": time.time() - 60}
            beat.write_text(json.dumps({**stale, "finished": False}))
            assert dog._a_peer_is_gone() == gone, (pid, started)
    finally:
        frozen.kill()
        frozen.wait()
    assert not StallWatchdog(tmp_path, startup_timeout_s=30, stall_timeout_s=None)._a_peer_is_gone()  # alone


def test_a_peer_whose_heartbeat_stopped_for_the_stall_limit_is_stalled_in_any_phase(tmp_path):
    """The silence limit is the training stall limit (never the start-up one a save allows for itself), at least
    GONE_AFTER_S; heartbeats of a previous attempt, finished peers and peers still beating are not stalled."""
    import json
    import time

    from tuneforge.watchdog import GONE_AFTER_S, StallWatchdog

    dog = StallWatchdog(tmp_path, startup_timeout_s=1800, stall_timeout_s=20, rank=0, world_size=2)
    (tmp_path / "live").mkdir()
    dog.beat("save", training=True)
    dog.started_at -= 100  # this attempt started before the heartbeats below
    assert dog.limit_s == 1800 and dog.silence_limit_s == 20
    assert StallWatchdog(tmp_path, 1800, stall_timeout_s=2).silence_limit_s == GONE_AFTER_S
    assert StallWatchdog(tmp_path, 1800, stall_timeout_s=None, floor_s=300).silence_limit_s == 300
    beat = tmp_path / "live" / "rank-1.json"
    assert dog._silent_peer() is None  # no heartbeat yet: the start-up limit covers a peer that never started
    for phase in ("data", "forward/backward", "optimizer", "save", "eval", "generation", "model"):
        for age, finished, stalled in [(5, False, False), (21, False, True), (21, True, False)]:
            beat.write_text(
                json.dumps({"rank": 1, "phase": phase, "step": 7, "updated": time.time() - age, "finished": finished})
            )
            found = dog._silent_peer()
            assert (found is not None) == stalled, (phase, age, finished)
            if stalled:
                assert found.startswith(f"rank 1 stopped beating: its last heartbeat, in phase {phase} at step 7")
    dog.started_at = time.time() + 30  # the heartbeat above now predates this attempt: a killed run's leftover
    assert dog._silent_peer() is None


@pytest.mark.slow
def test_the_backstop_never_ends_a_run_that_keeps_progressing(tmp_path):
    """The backstop (faulthandler's timer, for a monitor thread that cannot run) fires after twice the limit and
    a margin: here 1 s + 1 s + 0.5 s, pushed back every 0.5 s. A run beating for 5 s, twice that, ends normally;
    armed once and never pushed back, it killed every run that long, progressing or not."""
    script = SCRIPT.replace(
        "from tuneforge.watchdog import StallWatchdog\n",
        "import tuneforge.watchdog as w\nfrom tuneforge.watchdog import StallWatchdog\n"
        "w.BACKSTOP_MARGIN_S, w.BACKSTOP_REARM_EVERY_S = 0.5, 0.5\n",
    )
    script = script.replace("range(3)", "range(25)").replace("stuck_in_a_collective()\n", "dog.stop()\n")
    result = run_script(tmp_path, script)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.slow
def test_a_stall_on_a_full_disk_still_ends_the_rank_with_its_stacks_on_the_terminal(tmp_path):
    """Every write fails (ENOSPC) once the run is going: the dump that cannot be written goes to stderr, and the
    rank still exits with the stall status instead of losing its monitor thread and hanging."""
    script = SCRIPT.replace(
        'dog.beat("optimizer")\n',
        'dog.beat("optimizer")\n'
        "import errno, pathlib\n"
        "def full(*args, **kwargs):\n"
        "    raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "pathlib.Path.write_text = full\n"
        "import tuneforge.watchdog\n"
        "tuneforge.watchdog.write_json = full\n",
    )
    script = script.replace("stall_timeout_s=1.0)", "stall_timeout_s=1.0, grace_s=1.0)")  # its own dump never comes
    result = run_script(tmp_path, script)
    assert result.returncode == STALL_EXIT_CODE, result.stderr[-2000:]
    assert f"tuneforge: {tmp_path} not written (No space left on device); rank 0: stall:" in result.stderr
    assert "stuck_in_a_collective" in result.stderr


def process_state(pid: int) -> str:
    """The state letter of a process in /proc (T: stopped by a signal)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def test_a_fifo_or_a_huge_file_planted_as_a_peers_heartbeat_is_no_heartbeat_and_blocks_nothing(tmp_path):
    """The monitor thread reads its peers' heartbeats every second: a FIFO in a shared work dir blocked it for
    good (and with it the stall detection), a huge file filled its memory."""
    import threading

    from tuneforge.diagnostics.files import MAX_JSON_BYTES, read_json

    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "huge.json").write_text('{"a": "' + "x" * MAX_JSON_BYTES + '"}')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "ok.json").write_text('{"rank": 1}')
    found = {}
    reader = threading.Thread(target=lambda: found.update({p.name: read_json(p) for p in tmp_path.iterdir()}))
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "read_json blocked on the FIFO"
    assert found == {"fifo.json": None, "huge.json": None, "list.json": None, "ok.json": {"rank": 1}}


def test_generation_has_its_own_limit_and_the_stall_limit_without_one(tmp_path):
    from tuneforge.watchdog import StallWatchdog

    dog = StallWatchdog(tmp_path, startup_timeout_s=1800, stall_timeout_s=20, generation_timeout_s=600)
    dog.beat("generation", training=False)  # sample chats before the first step
    assert dog.limit_s == 600
    dog.beat("forward/backward", training=True)
    assert dog.limit_s == 20
    dog.beat("generation")
    assert dog.limit_s == 600
    plain = StallWatchdog(tmp_path, startup_timeout_s=1800, stall_timeout_s=20)
    plain.beat("forward/backward", training=True)
    plain.beat("generation")
    assert plain.limit_s == 20
