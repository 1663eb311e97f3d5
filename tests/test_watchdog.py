"""A stall becomes stacks on disk, a message naming the phase and the line, and a non-zero exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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


def test_no_report_while_progress_continues(tmp_path):
    script = SCRIPT.replace("stuck_in_a_collective()\n", "dog.stop()\n").replace("range(3)", "range(10)")
    result = run_script(tmp_path, script)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "stacks-rank-0.txt").exists() and not (tmp_path / "report.txt").exists()
