"""Hang injection through the real launcher (2 gloo ranks, a 4 s stall limit): every stall or divergence ends
in a report that names the rank, the collective or module, and the cause, and in a non-zero exit within the
limit plus a bounded slack. (The legacy-MoE case lives in test_moe_legacy.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time

import pytest

from conftest import TINY_LLAMA, TUNEFORGE, chat, free_port, launch, write_jsonl

CONFIG = (
    TINY_LLAMA.replace("{", "{{").replace("}", "}}")
    + """\
data: {{train_files: [train.jsonl], cache_dir: null}}
train: {{lr: 1.0e-3, micro_batch_size: 2, gradient_accumulation: 2, max_steps: 4, precision: fp32}}
checkpoint: {{every_steps: 0, save_final: false}}
parallel: {{engine: {engine}}}
watchdog: {{startup_timeout_s: 120, stall_timeout_s: 4, report_grace_s: 3}}
log: {{progress: lines}}
"""
)
SLACK_S = 45
"""Start-up of two workers (about 10 s here), the 4 s limit, the 3 s grace for dumps, and the launcher's exit."""


def run_with_fault(tmp_path, fault: str, engine: str = "ddp") -> tuple[subprocess.CompletedProcess, str, float]:
    write_jsonl(tmp_path / "train.jsonl", [chat(f"question {i}", f"answer {i * 7}") for i in range(16)])
    (tmp_path / "cfg.yaml").write_text(CONFIG.format(engine=engine))
    started = time.monotonic()
    result = launch(tmp_path / "cfg.yaml", tmp_path / "run", ranks=2, fault=fault, timeout=180)
    seconds = time.monotonic() - started
    report_file = tmp_path / "run" / "diagnostics" / "report.txt"
    report = report_file.read_text() if report_file.exists() else ""
    return result, report, seconds


def assert_failed_with(result, report: str, seconds: float, cause: str) -> None:
    assert result.returncode != 0, result.stdout[-2000:]
    assert "step 4/4" not in result.stdout
    assert report.startswith("tuneforge diagnosis:"), result.stderr[-3000:]
    assert f"({cause})" in report.splitlines()[0], report
    assert "tuneforge diagnosis:" in result.stderr  # printed, not only written
    assert seconds < SLACK_S, seconds


@pytest.mark.slow
def test_a_rank_that_skips_an_all_reduce(tmp_path):
    result, report, seconds = run_with_fault(tmp_path, "skip_all_reduce:1:2")
    assert_failed_with(result, report, seconds, "skipped_collective")
    assert "rank 1: nothing (never issued it)" in report
    assert "rank(s) 0 issued all_reduce" in report and "diverged: rank(s) 1" in report


@pytest.mark.slow
def test_a_collective_issued_on_rank_0_only(tmp_path):
    result, report, seconds = run_with_fault(tmp_path, "rank_only_collective:0:2")
    assert_failed_with(result, report, seconds, "rank_only_path")
    assert "rank 0 (" in report and "phase eval" in report
    assert "diverged: rank(s) 0" in report
    assert "likely cause: a code path taken by some ranks only" in report


@pytest.mark.slow
def test_a_collective_mismatch_that_aborts_a_rank_is_named_with_its_line(tmp_path):
    """Model code that issues an all-reduce on rank 0 only, in a forward: gloo pairs it with rank 1's gradient
    all-reduce of another size and aborts a rank (SIGABRT, no Python exception, no dump). The report still
    names the mismatch, both collectives and the line that issued the extra one, from the dead rank's
    faulthandler stacks and the collective it had in flight."""
    result, report, seconds = run_with_fault(tmp_path, "extra_collective:0:2")
    assert result.returncode != 0, result.stdout[-2000:]
    assert report.startswith("tuneforge diagnosis: FAILURE (mismatch)"), report + result.stderr[-3000:]
    assert "first disagreement at collective #" in report
    assert re.search(r"rank 0: all_reduce\(\(1,\) float32\) in .* from \S*faults\.py:\d+ in _extra_collective", report)
    assert re.search(r"rank 1: all_reduce\(\(\d+,\) float32\) in DDP gradient bucket", report), report
    assert re.search(
        r"rank 0 issued all_reduce #\d+ from \S*faults\.py:\d+ in _extra_collective, a line no other", report
    )
    assert "diverged: rank(s) 0" in report
    assert "died of a fatal signal (Fatal Python error: Aborted)" in report or "died of SIGABRT" in report, report
    assert "OOM killer" not in report
    assert seconds < SLACK_S, seconds


@pytest.mark.slow
def test_one_rank_with_one_more_batch(tmp_path):
    result, report, seconds = run_with_fault(tmp_path, "extra_batch:1:3", engine="fsdp")
    assert_failed_with(result, report, seconds, "uneven_data")
    assert "micro-step 3/2" in report and "diverged: rank(s) 1" in report
    assert "all_gather" in report


@pytest.mark.slow
def test_a_straggler_in_data_loading_is_slow_not_hung(tmp_path):
    # Step 3: DDP's first synchronised step (step 2) rebuilds its buckets with a broadcast made in C++, which
    # no recorder sees; from then on the wait is in the recorded gradient all-reduce.
    result, report, _ = run_with_fault(tmp_path, "sleep_data:1:3:3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 4/4" in result.stdout and report == ""
    slow = [line for line in result.stderr.splitlines() if "slow, not hung" in line]
    assert slow, result.stderr[-3000:]
    assert "for rank 1, which is busy in phase 'data' at step 3" in slow[0] and "straggler: rank 1" in slow[0]


@pytest.mark.slow
def test_a_rank_killed_with_sigkill_then_diagnose_prints_the_report_again_and_dumps_a_live_job(tmp_path):
    (tmp_path / "failed").mkdir()
    (tmp_path / "live").mkdir()
    result, report, seconds = run_with_fault(tmp_path / "failed", "kill:1:2")
    assert_failed_with(result, report, seconds, "killed")
    assert "rank 1 killed by SIGKILL" in report and "died: rank(s) 1" in report
    assert "OOM killer" in report
    again = subprocess.run([TUNEFORGE, "diagnose", str(tmp_path / "failed" / "run")], capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout.strip() == report.strip()

    # A live job: rank 1 sleeps 8 s loading data at step 3 (under the 20 s limit); rank 0 waits in an all-reduce.
    live = tmp_path / "live"
    job = start_with_a_straggler(live, stall_timeout_s=20, sleep_s=8)
    # Ask once rank 1's heartbeat says it loads step 3 and rank 0's that it waits in a collective of step 3.
    heartbeats = live / "run" / "diagnostics" / "live"
    wait_for_heartbeat(heartbeats / "rank-1.json", lambda beat: beat["step"] == 3 and beat["phase"] == "data")
    wait_for_heartbeat(heartbeats / "rank-0.json", lambda beat: beat["step"] == 3 and beat["in_flight"] is not None)
    dump = subprocess.run([TUNEFORGE, "diagnose", "--live", str(live / "run")], capture_output=True, text=True)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 0, err[-3000:]  # the live dump did not stop the job
    assert "(2/2 ranks answered)" in dump.stdout, dump.stdout + dump.stderr
    assert "rank 1: phase data, step 3" in dump.stdout and "in _inject_data_fault" in dump.stdout
    assert "rank 0: phase forward/backward, step 3" in dump.stdout and "waiting in #" in dump.stdout


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_rank_at_a_step_end_with_a_checkpoint(tmp_path):
    """How SLURM and Kubernetes stop a job: SIGTERM to the launcher, which passes it on to the ranks. Rank 1 is
    loading step 3's data (slowly), rank 0 waits for it in a collective: neither is stuck, so both finish step 3,
    save it and exit with 143 and the resume command; no hang is diagnosed."""
    job = start_with_a_straggler(tmp_path, stall_timeout_s=30, sleep_s=6)
    heartbeats = tmp_path / "run" / "diagnostics" / "live"
    wait_for_heartbeat(heartbeats / "rank-1.json", lambda beat: beat["step"] == 3 and beat["phase"] == "data")
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 143, err[-3000:]
    assert "stopping after step 3: SIGTERM received by 2 of 2 rank(s)" in out
    assert "tuneforge: stopped by SIGTERM after step 3 of 4; checkpoint " in err and "--resume auto" in err
    assert (tmp_path / "run" / "checkpoints" / "step-3" / "model.safetensors").exists()
    assert not (tmp_path / "run" / "diagnostics" / "report.txt").exists() and "diagnosis" not in err


def start_with_a_straggler(directory, stall_timeout_s: float, sleep_s: float) -> subprocess.Popen:
    """A 2-rank DDP job in the background whose rank 1 sleeps `sleep_s` loading step 3's data (from step 3 on, DDP's
    wait is in its recorded gradient all-reduce: step 2 rebuilds its buckets with a broadcast made in C++)."""
    write_jsonl(directory / "train.jsonl", [chat(f"question {i}", f"answer {i * 7}") for i in range(16)])
    config = CONFIG.format(engine="ddp").replace("stall_timeout_s: 4", f"stall_timeout_s: {stall_timeout_s:g}")
    (directory / "cfg.yaml").write_text(config)
    command = [TUNEFORGE, "train", str(directory / "cfg.yaml"), "--work-dir", str(directory / "run")]
    command += ["--nproc-per-node", "2", "--master-port", str(free_port())]
    env = {**os.environ, "TUNEFORGE_INJECT_FAULT": f"sleep_data:1:3:{sleep_s:g}"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for_heartbeat(path, ready, timeout_s: float = 60) -> None:
    """Poll a rank's heartbeat file (rewritten every second) until `ready` holds for its content."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):  # not written yet, or caught mid-replace
            if ready(json.loads(path.read_text())):
                return
        time.sleep(0.1)
    raise AssertionError(f"{path} never became ready: {path.read_text() if path.exists() else 'missing'}")


def test_collectives_in_backward_name_the_module_whose_backward_runs(tmp_path):
    """A collective issued in a module's backward (as FSDP2 and ZeRO-3 do per layer) is recorded with that
    module; one issued in forward with the module being run. One gloo rank in this process."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from tuneforge.diagnostics.recorder import CollectiveRecorder

    class ReduceGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            dist.all_reduce(grad)
            return grad

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            dist.barrier()  # a forward collective
            return ReduceGradient.apply(self.linear(x))

    model = nn.Sequential(Block(), Block())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    recorder = CollectiveRecorder()
    try:
        recorder.install()
        recorder.track_modules(model)
        recorder.phase = "forward/backward"
        model(torch.ones(2, 4)).sum().backward()
    finally:
        recorder.uninstall()
        dist.destroy_process_group()
    issued = [(r["op"], r["module"]) for r in recorder.snapshot()]
    # Forward runs block 0 then 1; backward runs block 1 then 0.
    assert issued == [("barrier", "0"), ("barrier", "1"), ("all_reduce", "1"), ("all_reduce", "0")], issued


FREEZE_CASES = {
    # phase: (the step it freezes at, the config's changes that make the run enter that phase)
    "data": (3, {}),
    "forward/backward": (3, {}),
    "optimizer": (3, {}),
    "save": (2, {"checkpoint: {every_steps: 0, save_final: false}": "checkpoint: {every_steps: 1, keep_last: 1}"}),
    "eval": (
        2,
        {
            "train.jsonl], cache_dir: null}": "train.jsonl], cache_dir: null, validation_fraction: 0.25}",
            "log: {progress: lines}": "log: {progress: lines}\neval: {every_steps: 1}",
        },
    ),
    "generation": (
        2,
        {
            "log: {progress: lines}": "log: {progress: lines}\neval: {sample_prompts: [hi], sample_every_steps: 1, "
            "sample_max_new_tokens: 4}"
        },
    ),
    # A GRPO rollout: the generation phase at the start of every step.
    "rollout": (
        2,
        {
            "train.jsonl]": "prompts.jsonl]",
            "max_steps: 6,": "max_steps: 6, objective: grpo,",
            "log: {progress: lines}": "log: {progress: lines}\nrl: {generations: 2, max_completion_tokens: 4}",
        },
    ),
    # DPO with full fine-tuning precomputes its reference in one pass before the first step (phase "model").
    "model": (
        0,
        {
            "train.jsonl]": "pairs.jsonl]",
            "max_steps: 6,": "max_steps: 6, objective: dpo,",
        },
    ),
}


PHASE_OF = {"rollout": "generation"}
"""The watchdog's phase of each case not named after it."""


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FREEZE_CASES), ids=lambda case: case.replace("/", "-"))
def test_a_rank_frozen_in_any_phase_is_named_within_the_stall_limit(tmp_path, case):
    """SIGSTOP on rank 1 (what Ctrl-Z, a debugger or a swapping machine does) as it enters each phase: rank 0 waits
    for it in a collective. Slow phases (a checkpoint save, the reference pass) allow rank 0 the start-up limit for
    itself, but a peer whose heartbeat stops is stalled whatever the phase: the report names the frozen rank as the
    cause, the frozen worker is ended (the launcher would wait 30 s on it), and the job exits with the stall status
    3 within the stall limit (at least 10 s of missed beats) plus the grace, every time."""
    from test_preference import pair

    step, changes = FREEZE_CASES[case]
    phase = PHASE_OF.get(case, case)
    write_jsonl(tmp_path / "train.jsonl", [chat(f"question {i}", f"answer {i * 7}") for i in range(16)])
    write_jsonl(tmp_path / "pairs.jsonl", [pair(i) for i in range(16)])
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"question {i}", "answer": str(i * 7)} for i in range(16)])
    config = CONFIG.format(engine="ddp").replace("max_steps: 4", "max_steps: 6")
    for old, new in changes.items():
        assert old in config, old
        config = config.replace(old, new)
    (tmp_path / "cfg.yaml").write_text(config)
    command = [TUNEFORGE, "train", str(tmp_path / "cfg.yaml"), "--work-dir", str(tmp_path / "run")]
    command += ["--nproc-per-node", "2", "--master-port", str(free_port())]
    env = {**os.environ, "TUNEFORGE_INJECT_FAULT": f"freeze:1:{step}:{phase}"}
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    heartbeat = tmp_path / "run" / "diagnostics" / "live" / "rank-1.json"
    wait_for_heartbeat(heartbeat, lambda beat: beat["phase"] == phase and beat["step"] >= step)
    frozen = json.loads(heartbeat.read_text())
    stopped = time.monotonic()
    try:
        _, err = job.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen["pid"], signal.SIGKILL)
    report_file = tmp_path / "run" / "diagnostics" / "report.txt"
    report = report_file.read_text() if report_file.exists() else ""
    assert job.returncode == 3, err[-3000:]
    assert report.startswith("tuneforge diagnosis: HANG (frozen)"), report + err[-3000:]
    assert "frozen: rank(s) 1" in report and f"rank 1 (process {frozen['pid']}) was not running: killed" in report
    # 10 s of silence, the 3 s grace for dumps, the launcher's exit; the start-up limit here is 120 s.
    assert time.monotonic() - stopped < 30, err[-3000:]


@pytest.mark.slow
def test_a_stop_signal_between_read_steps_stops_every_rank_at_one_step_with_every_row_written(tmp_path):
    """With log.every_steps above 1 the loop reads a step's numbers (the stop votes among them) only every few
    steps: SIGTERM between two reads still stops both ranks at the same step, within the grace, with its
    checkpoint, and metrics.jsonl holds a row for every step up to it."""
    write_jsonl(tmp_path / "train.jsonl", [chat(f"question {i}", f"answer {i * 7}") for i in range(16)])
    config = CONFIG.format(engine="ddp").replace("max_steps: 4", "max_steps: 100000")
    config = config.replace("stall_timeout_s: 4", "stall_timeout_s: 30").replace(
        "log: {progress: lines}", "log: {progress: lines, every_steps: 7}"
    )
    (tmp_path / "cfg.yaml").write_text(config)
    command = [TUNEFORGE, "train", str(tmp_path / "cfg.yaml"), "--work-dir", str(tmp_path / "run")]
    command += ["--nproc-per-node", "2", "--master-port", str(free_port())]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_heartbeat(tmp_path / "run" / "diagnostics" / "live" / "rank-1.json", lambda beat: beat["step"] >= 10)
    signalled = time.monotonic()
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 143, err[-3000:]
    assert time.monotonic() - signalled < 25 + 15, err[-3000:]  # watchdog.stop_grace_s and the save
    stopped = re.search(r"stopping after step (\d+): SIGTERM received by 2 of 2 rank\(s\)", out)
    assert stopped, out[-3000:]
    step = int(stopped.group(1))
    assert (tmp_path / "run" / "checkpoints" / f"step-{step}" / "model.safetensors").exists()
    rows = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, step + 1))
