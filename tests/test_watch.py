"""`tuneforge watch` on the work dir of a real 2-rank run, rendered while it trains (from another process, as
a user's second terminal would) and after it ended; and the diagnosis shown the moment one is written."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
from rich.console import Console

from tuneforge import watch as watch_module
from tuneforge.cli import main
from tuneforge.config import load_config
from tuneforge.model.precision import native_cpu_half_precision
from tuneforge.watch import (
    RECENT_STEPS,
    SPARK_WIDTH,
    STALE_AFTER_S,
    RunReader,
    read_run,
    render,
    seconds_per_step,
    sparkline,
)

from conftest import TINY_LLAMA, TUNEFORGE, chat, free_port, write_jsonl

CONFIG = (
    TINY_LLAMA
    + """\
data: {train_files: [train.jsonl], cache_dir: null}
train: {lr: 3.0e-3, micro_batch_size: 2, gradient_accumulation: 1, max_steps: 12}
checkpoint: {every_steps: 0, save_final: false}
eval: {sample_prompts: ["question 3"], sample_every_steps: 6, sample_max_new_tokens: 4}
watchdog: {startup_timeout_s: 120, stall_timeout_s: 40}
log: {progress: lines, plot: false}
"""
)


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """A view's lines unwrapped, as on a wide terminal."""
    monkeypatch.setenv("COLUMNS", "250")


def shown(view, now: float | None = None) -> str:
    console = Console(record=True, width=140)
    console.print(render(view, now))
    return console.export_text()


def test_a_sparkline_spans_the_lowest_to_the_highest_value_and_averages_long_curves():
    assert sparkline([3.0, 2.0, 1.0, 1.0]) == "█▅▁▁"
    assert sparkline([1.0] * 5) == "▁▁▁▁▁"
    assert len(sparkline(list(range(1000)), width=40)) == 40 and sparkline([float("nan")]) == ""


@pytest.mark.slow
def test_watch_shows_a_two_rank_run_while_it_trains_and_ends_with_it(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [chat(f"question {i}", f"answer {i * 7}") for i in range(40)])
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    run = tmp_path / "run"
    command = [TUNEFORGE, "train", str(tmp_path / "cfg.yaml"), "--work-dir", str(run), "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port())]
    # Rank 1 is slowed at step 4 so that the run is surely seen mid-way; the precision is left to `auto`.
    env = {**os.environ, "TUNEFORGE_INJECT_FAULT": "sleep_data:1:4:4"}
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120

        def mid_run() -> bool:
            view = read_run(run) if run.is_dir() else None
            last = view.progress.last if view is not None else None
            return view is not None and len(view.ranks) == 2 and last is not None and last.step >= 3

        while not mid_run():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
            time.sleep(0.2)
        during = subprocess.run([TUNEFORGE, "watch", str(run), "--once"], capture_output=True, text=True, timeout=60)
        assert during.returncode == 0, during.stderr
        lines = during.stdout.splitlines()
        rows = [line for line in lines if line.startswith("│ 0 ") or line.startswith("│ 1 ")]
        assert len(rows) == 2 and all("/12" in row and "/ 40s limit" in row and "running" in row for row in rows)
        assert any(line.startswith("loss ") for line in lines) and any(line.startswith("lr ") for line in lines)
        assert any("tok/s" in line and "ETA" in line for line in lines)
        assert "the run has ended" not in during.stdout

        # Following it live: the view ends by itself when the run does.
        live = subprocess.run([TUNEFORGE, "watch", str(run), "--interval", "0.2"], capture_output=True, text=True,
                              timeout=180)  # fmt: skip
    finally:
        out, err = job.communicate(timeout=180)
    assert job.returncode == 0, err[-3000:]
    # train.precision: auto, said once in the first lines and recorded in config.yaml.
    chosen = "bf16" if native_cpu_half_precision() else "fp32"
    said = [line for line in out.splitlines() if line.startswith("precision: ")]
    assert len(said) == 1 and said[0].startswith(f"precision: {chosen} (train.precision=auto: this CPU "), out[:3000]
    assert load_config(run / "config.yaml").train.precision == chosen
    assert live.returncode == 0 and "the run has ended" in live.stdout, live.stdout[-3000:]
    after = shown(read_run(run))
    assert after.count("finished") == 2 and "step 12/12" in after and "ETA" not in after
    assert "sample chat at step 12" in after and "'question 3' ->" in after


def test_a_diagnosis_is_shown_as_soon_as_it_is_written_and_watch_exits_with_the_hang_status(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "diagnostics" / "live").mkdir(parents=True)
    (run / "run.json").write_text(f'{{"run_id": "x", "started": {time.time() - 60}}}')
    beat = '{{"rank": {r}, "host": "h", "phase": "train", "step": 3, "total_steps": 9, "updated": {t}, "limit_s": 30}}'
    for rank in (0, 1):
        (run / "diagnostics" / "live" / f"rank-{rank}.json").write_text(beat.format(r=rank, t=time.time() - 40))
    view = read_run(run)
    text = shown(view)
    assert text.count("stalled: past the stall timeout") == 2 and not view.over(time.time())
    (run / "diagnostics" / "report.txt").write_text("tuneforge diagnosis: HANG (mismatch)\nlikely cause: ...\n")
    assert main(["watch", str(run), "--once"]) == 3
    assert "tuneforge diagnosis: HANG (mismatch)" in capsys.readouterr().out
    assert main(["watch", str(tmp_path / "nothing"), "--once"]) == 2
    assert "no such work dir" in capsys.readouterr().err


def test_damaged_or_foreign_files_in_a_work_dir_are_left_out_not_a_traceback(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "diagnostics" / "live").mkdir(parents=True)
    (run / "run.json").write_text("[1, 2]")
    (run / "diagnostics" / "live" / "rank-0.json").write_text('{"rank": 0, "updated": "yesterday", "limit_s": 30}')
    (run / "diagnostics" / "live" / "rank-1.json").write_text("{not json")
    metrics = '{"step": 1, "loss": 2.5, "lr": 0.001}\n[3]\n{"step": "x", "loss": 1}\n{"step": 2'
    (run / "metrics.jsonl").write_text(metrics)
    (run / "samples.jsonl").write_text('"just a string"\n')
    assert main(["watch", str(run), "--once"]) == 0
    out = capsys.readouterr().out
    assert "no rank has written a heartbeat yet" in out and "loss 2.5000" in out and "step 1" in out
    # A place no one may write to, root included (/proc takes no new files).
    assert main(["recipes", "copy", "llama-3-8b-lora-1gpu", "/proc/tuneforge-recipe.yaml"]) == 2
    assert "error: /proc/tuneforge-recipe.yaml: cannot write the recipe (" in capsys.readouterr().err


def heartbeat(run, index: int, updated: float, **fields) -> None:
    """`rank-INDEX.json`, of rank INDEX unless `fields` say another."""
    beat = {"rank": index, "host": "h", "phase": "train", "step": 3, "total_steps": 9, "updated": updated,
            "limit_s": 30, **fields}  # fmt: skip
    (run / "diagnostics" / "live").mkdir(parents=True, exist_ok=True)
    (run / "diagnostics" / "live" / f"rank-{index}.json").write_text(json.dumps(beat))


def hold_lock(run, pid: int, started: float) -> None:
    (run / ".tuneforge.lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": started}))


def test_a_crash_a_killed_run_and_a_run_without_heartbeats_each_end_the_view_as_what_they_were(tmp_path, capsys):
    run = tmp_path / "run"
    now = time.time()
    heartbeat(run, 0, now, finished=True, outcome="failed")
    heartbeat(run, 1, now, finished=True, outcome="finished")
    assert main(["watch", str(run), "--once"]) == 1
    out = capsys.readouterr().out
    assert "ended with an error" in out and "the run has ended with an error: see its terminal output" in out

    # A run whose watchdog is off writes no heartbeats: it is followed by its lock, held while it runs.
    quiet = tmp_path / "quiet"
    quiet.mkdir()
    (quiet / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5, "lr": 0.001, "elapsed_s": 1.0}\n')
    hold_lock(quiet, os.getpid(), now)
    assert not read_run(quiet).over(now)
    (quiet / ".tuneforge.lock").unlink()  # released: the run ended
    assert read_run(quiet).over(now) and main(["watch", str(quiet), "--once"]) == 0

    # A lock whose holder is gone (kill -9) ends the view at once, as an error; a heartbeat older than the
    # lock (a previous attempt's rank) is not shown.
    killed = tmp_path / "killed"
    heartbeat(killed, 0, now)
    heartbeat(killed, 3, now - 600)
    no_process = int(Path("/proc/sys/kernel/pid_max").read_text())  # pids stay below it: a holder that is gone
    hold_lock(killed, no_process, now - 60)
    view = read_run(killed)
    assert [rank.label for rank in view.ranks] == ["0"] and view.over(now)
    assert main(["watch", str(killed), "--once"]) == 1


def test_the_eta_follows_the_latest_attempts_recent_pace():
    first = [(s, 10.0 * s) for s in range(1, 11)]  # (step, elapsed_s): 10 s a step, then killed
    resumed = [(s, 30.0 + 2.0 * (s - 11)) for s in range(11, 15)]  # its clock starts again
    assert seconds_per_step(first) == 10.0
    assert seconds_per_step(first + resumed) == 2.0
    assert seconds_per_step(first + resumed[:1]) is None  # one step of the new attempt: no pace yet
    assert seconds_per_step(first[:1]) == 10.0


def watched(run, capsys) -> tuple[int, str]:
    status = main(["watch", str(run), "--once"])
    return status, capsys.readouterr().out


BEATS = {
    "a step as text, a host as a number": ({"step": "x", "host": 5}, "│ 0    │ 5    │ train │ ?/9  │"),
    "no rank": ({"rank": None}, "│ ?    │ h    │ train │ 3/9  │"),
    "micro-steps as text": ({"micro_steps": "2"}, "│ 0    │ h    │ train │ 3/9  │"),
    "a micro-step as a list": ({"micro_steps": 4, "micro_step": [1]}, "│ 3/9 (0/4) │"),
    "total steps as text": ({"total_steps": "x"}, "│ 0    │ h    │ train │ 3/?  │"),
    "a limit as text": ({"limit_s": "a"}, "1 file(s) in diagnostics/live that are no heartbeat (rank-0.json)"),
    "an update time that is NaN": ({"updated": float("nan")}, "that are no heartbeat (rank-0.json)"),
    "an endless limit": ({"limit_s": float("inf")}, "that are no heartbeat (rank-0.json)"),
}
ROWS = {
    "a loss in a list": ({"loss": [1]}, "left out: 1 line(s) of metrics.jsonl that are no step record"),
    "a step as text": ({"step": "x"}, "left out: 1 line(s) of metrics.jsonl that are no step record"),
    "a loss past any float": ({"loss": 10**400}, "left out: 1 line(s) of metrics.jsonl that are no step record"),
    "a learning rate as text": ({"lr": "x"}, "lr   ?"),
    "throughput and memory as text": ({"tokens_per_s": "x", "peak_memory_gb": []}, "step 1/9  ETA 16s\n"),
    "a validation loss and an elapsed time as text": ({"val_loss": "x", "elapsed_s": "x"}, "step 1/9\n"),
    "an infinite loss": ({"loss": float("inf")}, "loss inf"),
}


@pytest.mark.parametrize("case", [f"heartbeat: {name}" for name in BEATS] + [f"metrics: {name}" for name in ROWS])
def test_a_field_of_another_type_is_shown_as_far_as_it_goes_or_counted_never_a_traceback(tmp_path, capsys, case):
    kind, name = case.split(": ", 1)
    beat, row = (BEATS[name][0], {}) if kind == "heartbeat" else ({}, ROWS[name][0])
    expected = (BEATS if kind == "heartbeat" else ROWS)[name][1]
    run = tmp_path / "run"
    beat = dict(beat)
    heartbeat(run, 0, beat.pop("updated", time.time()), **beat)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.5, "lr": 1e-3, "elapsed_s": 2.0, **row}) + "\n")
    status, out = watched(run, capsys)
    assert status == 0 and expected in out, out


def test_a_byte_that_is_not_utf8_in_metrics_is_counted_with_its_line(tmp_path, capsys):
    run = tmp_path / "run"
    heartbeat(run, 0, time.time())
    lines = [b'{"step": 1, "loss": 2.5, "lr": 0.001}', b"\xff\xfe{", b'{"step": 2, "loss": 2.0, "note": "\xff"}']
    (run / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    status, out = watched(run, capsys)
    assert status == 0 and "loss 2.0000" in out and "left out: 1 line(s) of metrics.jsonl" in out


def test_a_directory_holding_no_run_is_said_to_be_none_not_watched_as_starting_up(tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty"
    (empty / "notes").mkdir(parents=True)
    assert main(["watch", str(empty), "--once"]) == 2
    err = capsys.readouterr().err
    assert f"error: {empty}: not a run's work dir (no run.json, metrics.jsonl, heartbeat or lock in it)" in err
    # Followed, it waits a bounded time for a run to start there, then says so.
    monkeypatch.setattr(watch_module, "WAIT_FOR_RUN_S", 0.3)
    started = time.monotonic()
    assert main(["watch", str(empty), "--interval", "0.05"]) == 2
    out, err = capsys.readouterr()
    assert f"{empty} holds no run yet: waiting up to " in out and "(no run started there in " in err
    assert time.monotonic() - started < 5


def test_watch_started_just_before_its_run_waits_for_the_work_dir_to_appear(tmp_path, capsys, monkeypatch):
    run = tmp_path / "later"

    def start_and_finish() -> None:
        time.sleep(0.3)
        heartbeat(run, 0, time.time(), finished=True, outcome="finished")
        (run / "metrics.jsonl").write_text('{"step": 9, "loss": 1.5}\n')

    monkeypatch.setattr(watch_module, "WAIT_FOR_RUN_S", 30.0)
    starter = threading.Thread(target=start_and_finish)
    starter.start()
    try:
        assert main(["watch", str(run), "--interval", "0.05"]) == 0
    finally:
        starter.join()
    out = capsys.readouterr().out
    assert f"{run} holds no run yet: waiting up to 30s for one to start" in out and "the run has ended" in out
    assert main(["watch", str(tmp_path / "never"), "--once"]) == 2  # --once looks once


def test_ranks_that_stopped_beating_without_finishing_end_the_view_as_an_error(tmp_path, capsys):
    run = tmp_path / "run"
    gone = time.time() - (30 + STALE_AFTER_S + 5)  # past the 30 s limit and the grace after it
    heartbeat(run, 0, gone, host="node-7")
    heartbeat(run, 1, gone, host="node-7")
    status, out = watched(run, capsys)
    assert status == 1 and "the run has ended" not in out
    assert "the ranks stopped beating without finishing: rank(s) 0, 1 last beat 1m35s ago" in out
    heartbeat(run, 0, time.time(), finished=True, outcome="finished")  # one finished, the other vanished
    status, out = watched(run, capsys)
    assert status == 1 and "rank(s) 1 last beat" in out
    heartbeat(run, 1, time.time() - 40)  # only past its limit: stalled, a diagnosis may still come
    status, out = watched(run, capsys)
    assert status == 0 and "stalled: past the stall timeout" in out and "stopped beating" not in out


def step_rows(steps, loss=lambda step: 10.0 - step / 1000, pace: float = 2.0) -> str:
    return "".join(json.dumps({"step": s, "loss": loss(s), "lr": 1e-3, "elapsed_s": pace * s}) + "\n" for s in steps)


def test_metrics_are_read_incrementally_into_bounded_state(tmp_path):
    run = tmp_path / "run"
    heartbeat(run, 0, time.time(), total_steps=30_000)
    metrics = run / "metrics.jsonl"
    metrics.write_text(step_rows(range(1, 10_001)))
    reader = RunReader(run)
    tracemalloc.start()
    try:
        progress = reader.read().progress
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert progress.rows == 10_000 and progress.last.step == 10_000 and kept < 1_000_000  # every row: ~8 MB
    assert len(progress.loss.sums) <= 2 * SPARK_WIDTH and len(progress.recent) == RECENT_STEPS + 1
    assert progress.seconds_per_step() == 2.0 and sparkline(progress.loss.values())[::59] == "█▁"
    assert "ETA 11h06m" in shown(reader.read())

    # Only appended whole lines are read: a half-written one waits for its end.
    with metrics.open("a") as handle:
        handle.write(step_rows([10_001]) + '{"step": 10002, "lo')
    assert reader.read().progress.rows == 10_001
    with metrics.open("a") as handle:
        handle.write('ss": 1.0}\n')
    progress = reader.read().progress
    assert progress.rows == 10_002 and progress.last.loss == 1.0 and progress.left_out == 0

    # Rewritten shorter (a fresh start), then replaced by another file: read again from the start.
    metrics.write_text(step_rows(range(1, 4)))
    assert reader.read().progress.rows == 3
    replacement = run / "metrics.new"
    replacement.write_text(step_rows(range(1, 6)))
    replacement.replace(metrics)
    assert reader.read().progress.rows == 5


def test_a_fifo_in_place_of_a_run_file_is_left_alone_not_waited_on(tmp_path, capsys):
    run = tmp_path / "run"
    heartbeat(run, 0, time.time())
    names = ("run.json", "metrics.jsonl", "samples.jsonl", "diagnostics/report.txt", "diagnostics/live/rank-1.json")
    for name in names:
        os.mkfifo(run / name)  # opening one to read waits for a writer that never comes
    status: list[int] = []
    viewer = threading.Thread(target=lambda: status.append(main(["watch", str(run), "--once"])), daemon=True)
    viewer.start()
    viewer.join(20)
    assert status == [0] and "│ 0    │ h    │ train │ 3/9  │" in capsys.readouterr().out
