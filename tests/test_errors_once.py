"""A user error in a launch of several ranks is printed once (issue #42): by rank 0 when it met it, by the
launcher with the ranks that met it otherwise; no torchrun error lines or tracebacks, and exit status 2."""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest

from tuneforge.errors import ERRORS_DIR_ENV, SharedUserError, UserError, say_user_error
from tuneforge.launch import USER_ERROR_EXIT, QuietOnUserError, rank_list, report_user_errors

from conftest import TINY_LLAMA, chat, launch, train_here, write_jsonl

CONFIG = (
    TINY_LLAMA
    + """\
data: {train_files: [train.jsonl], cache_dir: null}
train: {lr: 1.0e-3, micro_batch_size: 2, gradient_accumulation: 1, max_steps: 2, precision: fp32}
checkpoint: {every_steps: 2, save_final: true}
log: {progress: lines}
"""
)

ONE_RANK_ONLY = """\
import os

if os.environ.get("RANK") == "1":
    import tuneforge.data.pipeline
    from tuneforge.errors import UserError

    def refuse(*args, **kwargs):
        raise UserError("train.jsonl: only rank 1 meets this")

    tuneforge.data.pipeline.prepare_data = refuse
"""
"""A `sitecustomize` that makes rank 1 alone refuse its data, after the ranks joined their process group."""


def write_job(directory):
    write_jsonl(directory / "train.jsonl", [chat(f"question {i}", f"answer {i * 7}") for i in range(16)])
    (directory / "cfg.yaml").write_text(CONFIG)


def assert_said_once(result, line: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == USER_ERROR_EXIT, output[-3000:]
    errors = [text for text in result.stderr.splitlines() if text.startswith("error: ")]
    assert errors == [line], output[-3000:]
    assert output.count(line.removeprefix("error: ")) == 1, output[-3000:]
    for noise in ("Traceback", "ChildFailedError", "torch/distributed/elastic", "exitcode", "failed first"):
        assert noise not in output, output[-3000:]


@pytest.mark.slow
def test_resuming_a_finished_run_on_two_ranks_refuses_once(tmp_path):
    write_job(tmp_path)
    run = tmp_path / "run"
    assert train_here(tmp_path / "cfg.yaml", run).returncode == 0
    result = launch(tmp_path / "cfg.yaml", run, "--resume", "auto", ranks=2)
    assert_said_once(result, f"error: --resume {run / 'checkpoints' / 'step-2'}: step 2 is already the last of 2")


@pytest.mark.slow
def test_an_error_only_one_rank_meets_is_said_once_with_its_rank(tmp_path, monkeypatch):
    write_job(tmp_path)
    (tmp_path / "shim").mkdir()
    (tmp_path / "shim" / "sitecustomize.py").write_text(ONE_RANK_ONLY)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path / "shim"), os.environ.get("PYTHONPATH")]))
    )
    result = launch(tmp_path / "cfg.yaml", tmp_path / "run", ranks=2)
    assert_said_once(result, "error: rank 1: train.jsonl: only rank 1 meets this")
    assert "stopped by SIGTERM" not in result.stderr  # rank 0's stop follows from rank 1's error: no resume hint


def leave(tmp_path, monkeypatch, rank: int, error: UserError, capsys) -> str:
    """What `say_user_error` prints on `rank` of 4 under the launcher."""
    monkeypatch.setenv(ERRORS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "4")
    say_user_error(error)
    return capsys.readouterr().err


def test_the_launcher_says_what_rank_0_did_not(tmp_path, monkeypatch, capsys):
    assert leave(tmp_path, monkeypatch, 0, UserError("bad data"), capsys) == "error: bad data\n"
    assert leave(tmp_path, monkeypatch, 1, UserError("bad data"), capsys) == ""  # left for the launcher
    assert leave(tmp_path, monkeypatch, 2, UserError("no room"), capsys) == ""
    assert leave(tmp_path, monkeypatch, 3, UserError("no room"), capsys) == ""
    assert report_user_errors(tmp_path)
    assert capsys.readouterr().err == "error: ranks 2, 3: no room\n"


def test_a_shared_error_is_said_by_rank_0_alone(tmp_path, monkeypatch, capsys):
    assert leave(tmp_path, monkeypatch, 1, SharedUserError("doctor: no"), capsys) == ""
    assert leave(tmp_path, monkeypatch, 0, SharedUserError("doctor: no"), capsys) == "error: doctor: no\n"
    assert leave(tmp_path, monkeypatch, 2, SharedUserError("doctor: no"), capsys) == ""
    assert report_user_errors(tmp_path) and capsys.readouterr().err == ""


def test_a_shared_error_rank_0_said_before_is_not_said_again(tmp_path, monkeypatch, capsys):
    for rank in (0, 1):
        assert leave(tmp_path, monkeypatch, rank, SharedUserError("disk full", said=True), capsys) == ""
    (tmp_path / "error-rank-0.json").unlink()  # and even without rank 0's record
    assert report_user_errors(tmp_path) and capsys.readouterr().err == ""


def test_without_rank_0_the_launcher_says_each_error_once(tmp_path, monkeypatch, capsys):
    """Rank 0 killed (or on another node): the shared error is said without ranks, the others with theirs."""
    for rank in (1, 2, 3):
        leave(tmp_path, monkeypatch, rank, SharedUserError("doctor: no"), capsys)
    (tmp_path / "error-rank-5.json").write_text(
        json.dumps({"rank": 5, "message": "bad data", "shared": False, "said": False})
    )
    (tmp_path / "error-rank-6.json").write_text("{cut off")
    assert report_user_errors(tmp_path)
    assert capsys.readouterr().err == "error: doctor: no\nerror: rank 5: bad data\n"


def test_a_rank_that_cannot_leave_its_error_prints_it(tmp_path, monkeypatch, capsys):
    assert leave(tmp_path / "gone", monkeypatch, 1, UserError("bad data"), capsys) == "error: bad data\n"
    assert not report_user_errors(tmp_path)  # nothing left: the launcher says which rank failed first instead


def test_alone_or_under_another_launcher_every_rank_prints_its_own(monkeypatch, capsys):
    monkeypatch.delenv(ERRORS_DIR_ENV, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    say_user_error(UserError("bad data"))
    say_user_error(SharedUserError("doctor: no"))
    assert capsys.readouterr().err == "error: bad data\n"


def test_rank_lists():
    assert rank_list([3]) == "rank 3"
    assert rank_list([3, 1]) == "ranks 1, 3"
    assert rank_list([9, 1, 2, 3, 4, 5, 6, 7]) == "ranks 1-7, 9"


def test_torchruns_lines_about_the_ends_go_only_for_a_user_error(tmp_path):
    quiet = QuietOnUserError(tmp_path)

    def kept(message: str, *args) -> bool:
        return quiet.filter(logging.LogRecord("torch", logging.ERROR, __file__, 1, message, args, None))

    failed = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
    closing = "Sending process %s closing signal %s"
    assert not kept(failed, 2, 0, 123, sys.executable)
    assert kept(failed, 1, 0, 123, sys.executable) and kept(failed, -9, 0, 123, sys.executable)
    assert kept(closing, 123, "SIGTERM") and kept("Received %s death signal, shutting down workers", "SIGINT")
    (tmp_path / "error-rank-1.json").write_text("{}")
    assert not kept(closing, 123, "SIGTERM")
