"""A work dir belongs to one run: a lock while it trains, a refusal (or an archive) for a fresh run into another
run's outputs, resume only of its own run's checkpoints, and no file touched by a refused run."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tuneforge.config import load_config
from tuneforge.errors import UserError
from tuneforge.train.run import run_training
from tuneforge.train.workdir import LOCK_FILE, release_lock, take_lock

from conftest import TINY_LLAMA, chat, write_jsonl

CONFIG = (
    TINY_LLAMA
    + """\
data: {train_files: [train.jsonl], cache_dir: null}
train: {lr: 1.0e-3, micro_batch_size: 2, max_steps: 3, precision: fp32}
checkpoint: {every_steps: 1, keep_last: 3, save_final: false}
log: {progress: lines}
"""
)


@pytest.fixture
def config(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [chat(f"question {i}", f"answer {i}") for i in range(8)])
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    return load_config(tmp_path / "cfg.yaml")


def snapshot(directory) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_live_holder_keeps_the_lock_and_a_dead_one_is_taken_over(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = tmp_path / LOCK_FILE
        # Taken after the process started, as a run takes it (a lock older than the process is another's).
        lock.write_text(json.dumps({"pid": other.pid, "host": socket.gethostname(), "started": time.time() + 1}))
        with pytest.raises(UserError, match=rf"is in use by process {other.pid} on .*use another --work-dir"):
            take_lock(tmp_path)
    finally:
        other.kill()
        other.wait()
    note = take_lock(tmp_path)
    assert note.startswith(f"work dir: took over the lock {lock} left by process {other.pid} on {socket.gethostname()}")
    assert note.endswith(", which is no longer running")  # the start time between prints in local time
    assert json.loads(lock.read_text())["pid"] != other.pid
    release_lock(tmp_path)
    assert not lock.exists()


@pytest.mark.slow
def test_a_fresh_run_into_another_runs_outputs_is_refused_unchanged_or_archives_them(config, tmp_path, capsys):
    work_dir = tmp_path / "wd"
    run_training(config, work_dir)
    assert not (work_dir / LOCK_FILE).exists()  # released at the end
    before = snapshot(work_dir)
    with pytest.raises(
        UserError, match=r"holds another run's checkpoints, metrics.jsonl, plot.png; continue it with --resume auto"
    ):
        run_training(config, work_dir)
    assert snapshot(work_dir) == before
    capsys.readouterr()
    run_training(config, work_dir, archive_previous=True)
    out = capsys.readouterr().out
    (archived,) = (work_dir / "previous-runs").iterdir()
    assert f"moved to {archived}" in out
    assert {k: v for k, v in snapshot(archived).items() if not k.startswith("diagnostics")} == {
        k: v for k, v in before.items() if k not in ("config.yaml",) and not k.startswith("diagnostics")
    }
    assert [json.loads(line)["step"] for line in (work_dir / "metrics.jsonl").open()] == [1, 2, 3]


@pytest.mark.slow
def test_resume_auto_continues_only_this_runs_checkpoints_and_a_refused_resume_writes_nothing(config, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    run_training(config.model_copy(update={"train": config.train.model_copy(update={"max_steps": 2})}), first)
    run_training(config.model_copy(update={"train": config.train.model_copy(update={"max_steps": 1})}), second)
    # A step checkpoint of another run, copied in: `--resume auto` does not take it for this run's.
    shutil.copytree(first / "checkpoints" / "step-2", second / "checkpoints" / "step-2")
    before = snapshot(second)
    smaller = config.model_copy(update={"train": config.train.model_copy(update={"micro_batch_size": 1})})
    with pytest.raises(UserError, match=r"--resume .*step-1: written by 1 process\(es\) .* micro-batch 2"):
        run_training(smaller, second, resume="auto")
    assert snapshot(second) == before
    run_training(config, second, resume="auto")
    records = [json.loads(line) for line in (second / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2, 3]  # continued from its own step-1, not first's step-2


@pytest.mark.slow
def test_diagnose_says_a_finished_run_did_not_hang(config, tmp_path):
    from tuneforge.diagnose import last_report

    run_training(config, tmp_path / "wd")
    report = last_report(tmp_path / "wd")
    newest = tmp_path / "wd" / "checkpoints" / "step-3"
    assert report == (
        "tuneforge diagnosis: no hang: the run finished all 3 steps; no final checkpoint was saved; the newest step "
        f"checkpoint is {newest}"
    )


@pytest.mark.slow
def test_a_group_shared_run_gets_checkpoints_the_group_can_read_and_hints_that_paste(tmp_path, capsys):
    """umask 002 (a group-shared project directory) and a work dir with spaces: every file of a checkpoint is
    group-readable (safetensors alone writes 0600), and the closing hints run as printed."""
    import os
    import shlex

    from tuneforge.cli import main

    write_jsonl(tmp_path / "train.jsonl", [chat(f"question {i}", f"answer {i}") for i in range(8)])
    (tmp_path / "cfg.yaml").write_text(CONFIG.replace("save_final: false", "save_final: true"))
    work_dir = tmp_path / "team runs" / "first try"
    previous = os.umask(0o002)
    try:
        assert main(["train", str(tmp_path / "cfg.yaml"), "--work-dir", str(work_dir)]) == 0
    finally:
        os.umask(previous)
    final = work_dir / "checkpoints" / "final"
    modes = {p.name: p.stat().st_mode & 0o777 for p in final.rglob("*")}
    assert modes["model.safetensors"] == 0o664 and set(modes.values()) == {0o664}, modes
    assert final.stat().st_mode & 0o777 == 0o775
    out = capsys.readouterr().out
    chat_line = next(line for line in out.splitlines() if line.startswith("chat with it:"))
    assert shlex.split(chat_line.split(":", 1)[1]) == ["tuneforge", "chat", str(final)]


@pytest.mark.parametrize("holder", ['{"pid": "1", "host": "x", "started": 0}', "[1, 2]", '{"pid": true}'])
def test_a_lock_file_edited_into_nonsense_is_taken_over_as_nobody_s(tmp_path, holder):
    (tmp_path / LOCK_FILE).write_text(holder)
    assert take_lock(tmp_path) == (
        f"work dir: took over the lock {tmp_path / LOCK_FILE}, which names no running process (left by a process "
        "that died while taking it, or edited)"
    )
    release_lock(tmp_path)
