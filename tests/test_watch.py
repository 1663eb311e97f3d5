"""`tuneforge watch` on the work dir of a real 2-rank run, rendered while it trains (from another process, as
a user's second terminal would) and after it ended; and the diagnosis shown the moment one is written."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest
from rich.console import Console

from tuneforge.cli import main
from tuneforge.config import load_config
from tuneforge.model.precision import native_cpu_half_precision
from tuneforge.watch import read_run, render, seconds_per_step, sparkline

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
            return view is not None and len(view.ranks) == 2 and bool(view.metrics) and view.metrics[-1]["step"] >= 3

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
    assert main(["watch", str(tmp_path / "nothing")]) == 2
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


def heartbeat(run, rank: int, updated: float, **fields) -> None:
    beat = {"rank": rank, "host": "h", "phase": "train", "step": 3, "total_steps": 9, "updated": updated,
            "limit_s": 30, **fields}  # fmt: skip
    (run / "diagnostics" / "live").mkdir(parents=True, exist_ok=True)
    (run / "diagnostics" / "live" / f"rank-{rank}.json").write_text(json.dumps(beat))


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
    dead = subprocess.Popen(["true"])
    dead.wait()
    hold_lock(killed, dead.pid, now - 60)
    view = read_run(killed)
    assert [rank["rank"] for rank in view.ranks] == [0] and view.over(now)
    assert main(["watch", str(killed), "--once"]) == 1


def test_the_eta_follows_the_latest_attempts_recent_pace():
    first = [{"step": s, "elapsed_s": 10.0 * s} for s in range(1, 11)]  # 10 s a step, then killed
    resumed = [{"step": s, "elapsed_s": 30.0 + 2.0 * (s - 11)} for s in range(11, 15)]  # its clock starts again
    assert seconds_per_step(first) == 10.0
    assert seconds_per_step(first + resumed) == 2.0
    assert seconds_per_step(first + resumed[:1]) is None  # one step of the new attempt: no pace yet
    assert seconds_per_step(first[:1]) == 10.0
