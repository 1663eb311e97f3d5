"""Hard faults through the real launcher with 2 ranks: a launcher killed with its process group, a disk that fills
during a checkpoint. Each ends every process, keeps the last complete checkpoint, and lets a resume continue."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tuneforge.checkpoint_records import checkpoint_problems
from tuneforge.stop_requests import SAME_STOP_S

from conftest import ENGINES, TINY_LLAMA, TUNEFORGE, chat, free_port, launch, metrics, write_jsonl

CONFIG = (
    TINY_LLAMA
    + """\
data: {train_files: [train.jsonl], cache_dir: null}
train: {lr: 3.0e-3, micro_batch_size: 2, gradient_accumulation: 1, max_steps: 8, precision: fp32}
checkpoint: {every_steps: 2, keep_last: 2, save_final: false}
watchdog: {startup_timeout_s: 120, stall_timeout_s: 30}
log: {progress: lines}
"""
)


def write_job(directory) -> None:
    write_jsonl(directory / "train.jsonl", [chat(f"question {i}", f"answer {i * 7}") for i in range(40)])
    (directory / "cfg.yaml").write_text(CONFIG)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead but still listed until its parent (init, here) reaps it.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def start_two_ranks(directory, fault: str, **popen) -> subprocess.Popen:
    """`tuneforge train` of the job in `directory` on 2 ranks in the background, with `fault` injected."""
    command = [TUNEFORGE, "train", str(directory / "cfg.yaml"), "--work-dir", str(directory / "run")]
    command += ["--nproc-per-node", "2", "--master-port", str(free_port())]
    env = {**os.environ, "TUNEFORGE_INJECT_FAULT": fault}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **popen)


def heartbeats(run) -> list[dict]:
    """The ranks' live heartbeats ([] while one is missing or being replaced)."""
    with contextlib.suppress(OSError, ValueError):
        return [json.loads(p.read_text()) for p in sorted((run / "diagnostics" / "live").glob("rank-*.json"))]
    return []


def wait_until(ready, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, "never ready"
        time.sleep(0.1)


def all_gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(pid) for pid in pids)


@pytest.mark.slow
def test_workers_end_with_a_launcher_killed_with_its_process_group_and_a_resume_right_after_works(tmp_path):
    write_job(tmp_path)
    run = tmp_path / "run"
    # Rank 1 is slowed after step 3 (when step-2 is committed), so the kill lands mid-run.
    job = start_two_ranks(tmp_path, "sleep_data:1:4:60", start_new_session=True)
    step_2 = run / "checkpoints" / "step-2"
    wait_until(lambda: len(b := heartbeats(run)) == 2 and all(x["step"] >= 4 for x in b) and step_2.exists())
    pids = [beat["pid"] for beat in heartbeats(run)]
    os.killpg(job.pid, signal.SIGKILL)  # what the OOM killer or `kill -9 -- -PGID` does
    job.communicate(timeout=30)
    assert all_gone(pids, within_s=10), "workers outlived their launcher"
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.startswith(".")) == ["step-2"]

    resumed = launch(tmp_path / "cfg.yaml", run, "--resume", "auto", ranks=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step-2'}: step 2" in resumed.stdout
    assert [r["step"] for r in metrics(run)] == list(range(1, 9))


@contextlib.contextmanager
def small_filesystem(directory, size: str):
    """A tmpfs of `size` at `directory`, for a disk that really fills; where mounting is not allowed (not root),
    the test is skipped (the file-size limit test below covers the same path without privileges)."""
    directory.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def assert_stopped_with_one_message(result, head: str) -> str:
    """Every rank stopped with status 2 and one `error:` line starting with `head`, no traceback, and the
    launcher's own exit clean. Returns the message."""
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {head}"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors[0]


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "size"), [("ddp", "1000k"), ("zero3_offload", "1400k")])
def test_a_disk_that_fills_during_a_checkpoint_stops_every_rank_and_keeps_the_previous_one(tmp_path, engine, size):
    """The work dir on a file system that holds step-2 (about 650 KiB under DDP, 700 KiB under the report's
    ZeRO-3 with offload) but not step-4 too. torch.save reports the full disk without its errno; the run still
    says why, removes the half-written directory, and continues once there is room."""
    write_job(tmp_path)
    with small_filesystem(tmp_path / "disk", size) as disk:
        run = disk / "run"
        result = launch(tmp_path / "cfg.yaml", run, *ENGINES[engine], ranks=2)
        checkpoints = run / "checkpoints"
        message = assert_stopped_with_one_message(result, f"checkpoint {checkpoints / 'step-4'} not written: no space")
        assert f"free on the disk of {checkpoints}; a checkpoint of this run takes about " in message
        assert f"the previous checkpoint {checkpoints / 'step-2'} is intact" in message
        assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2"]
        assert checkpoint_problems(checkpoints / "step-2") == []

        subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)
        resumed = launch(tmp_path / "cfg.yaml", run, *ENGINES[engine], "--resume", "auto", ranks=2)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert [r["step"] for r in metrics(run)] == list(range(1, 9))


@pytest.mark.slow
def test_a_file_size_limit_at_the_first_checkpoint_stops_every_rank_with_the_limit_named(tmp_path):
    """`ulimit -f` of 300 KiB for the launcher and its workers: the optimizer state (about 460 KiB) cannot be
    written. Nothing is left in checkpoints/, and the message names the limit."""
    write_job(tmp_path)
    run = tmp_path / "run"

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (300 * 1024, 300 * 1024))

    job = start_two_ranks(tmp_path, "", preexec_fn=limit_file_size)
    out, err = job.communicate(timeout=300)
    result = subprocess.CompletedProcess(job.args, job.returncode, out, err)
    message = assert_stopped_with_one_message(
        result, f"checkpoint {run / 'checkpoints' / 'step-2'} not written: a file reached the process's file-size "
    )
    assert "(307,200 bytes, `ulimit -f`" in message and "no earlier checkpoint exists" in message
    assert list((run / "checkpoints").iterdir()) == []


@pytest.mark.slow
def test_a_checkpoint_directory_unwritable_on_one_rank_stops_both_with_one_message(tmp_path):
    write_job(tmp_path)
    result = launch(tmp_path / "cfg.yaml", tmp_path / "run", ranks=2, fault="unwritable_in_save:1:4")
    checkpoints = tmp_path / "run" / "checkpoints"
    message = assert_stopped_with_one_message(result, f"checkpoint {checkpoints / 'step-4'} not written: ")
    assert f"{checkpoints} is not writable ([Errno 13] Permission denied" not in message  # said on rank 1 only
    assert f"{checkpoints} is not writable" in message and "Make it writable again" in message
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2"]


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_a_full_disk_on_one_rank_inside_deepspeeds_own_save_stops_both_with_one_message(tmp_path, rank):
    """One rank's writes inside DeepSpeed's save_checkpoint fail (ZeRO-3 with offload: each rank writes its own
    partition), the other's succeed. DeepSpeed's own barriers still pair up, so the vote after the save stops both
    ranks with the no-space message instead of leaving one waiting in a barrier until the stall timeout. Rank 0
    also copies DeepSpeed's recovery scripts, outside its checkpoint engine: that error is held too."""
    write_job(tmp_path)
    result = launch(
        tmp_path / "cfg.yaml",
        tmp_path / "run",
        *ENGINES["zero3_offload"],
        ranks=2,
        fault=f"disk_full_in_engine_save:{rank}:4",
    )
    checkpoints = tmp_path / "run" / "checkpoints"
    assert_stopped_with_one_message(result, f"checkpoint {checkpoints / 'step-4'} not written: no space")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2"]
    assert checkpoint_problems(checkpoints / "step-2") == []


@pytest.mark.slow
def test_a_second_ctrl_c_during_the_stop_checkpoint_stops_every_process_at_once(tmp_path):
    """The first Ctrl-C makes the ranks finish the step and save it (rank 0's save is made 30 s slow); the second
    stops at once, as the first one's message promises: the ranks used to ignore it while saving for the stop,
    and the launcher waited for them. Nothing half-written is committed."""
    write_job(tmp_path)
    (tmp_path / "cfg.yaml").write_text(CONFIG.replace("every_steps: 2", "every_steps: 0").replace("8,", "400,"))
    run = tmp_path / "run"
    job = start_two_ranks(tmp_path, "slow_stop_save:0:0:90")
    wait_until(lambda: len(b := heartbeats(run)) == 2 and all(x["step"] >= 3 for x in b))
    job.send_signal(signal.SIGINT)
    wait_until(lambda: any(x["phase"] == "save" and x["rank"] == 0 for x in heartbeats(run)))
    pids = [beat["pid"] for beat in heartbeats(run)]
    # A wait on the clock itself, not on an event: each rank opens the window in which a signal counts as the first
    # one delivered twice when it takes that first one, which happened before its save phase showed; a second past
    # the window's end from there.
    time.sleep(SAME_STOP_S + 1)
    second = time.monotonic()
    job.send_signal(signal.SIGINT)
    _, err = job.communicate(timeout=120)
    # Far sooner than the 90 s save it cut short, with room for a loaded machine (28 s seen on 2 busy cores).
    assert time.monotonic() - second < 45, err[-3000:]
    assert all_gone(pids, within_s=5), err[-3000:]
    assert "a second time, while saving for the stop: stopping at once" in err
    assert not (run / "checkpoints").exists() or not [p for p in (run / "checkpoints").iterdir() if p.name[0] != "."]


@pytest.mark.slow
def test_quick_repeated_ctrl_c_are_one_request_and_the_launcher_waits_for_the_stop_checkpoint(tmp_path):
    """Three Ctrl-C 0.3 s apart (an impatient hand, or a terminal and a wrapper both passing it on): torchrun ends
    its wait for the ranks at the third, and the launcher returned while they still saved their stop checkpoint,
    out of reach of the terminal (the ranks, orphaned, then stopped without it). Now the launcher passes it on and
    waits: the ranks take it for the same request, the checkpoint is committed, and no process outlives the
    launcher."""
    write_job(tmp_path)
    (tmp_path / "cfg.yaml").write_text(CONFIG.replace("every_steps: 2", "every_steps: 0").replace("8,", "400,"))
    run = tmp_path / "run"
    job = start_two_ranks(tmp_path, "slow_stop_save:0:0:6")
    wait_until(lambda: len(b := heartbeats(run)) == 2 and all(x["step"] >= 3 for x in b))
    pids = [beat["pid"] for beat in heartbeats(run)]
    for _ in range(3):
        job.send_signal(signal.SIGINT)
        time.sleep(0.3)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 128 + signal.SIGINT, err[-3000:]
    assert not any(alive(pid) for pid in pids), err[-3000:]  # none outlived the launcher
    saved = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-")]
    assert len(saved) == 1, (saved, err[-3000:])
    assert (run / "checkpoints" / saved[0] / "manifest.json").exists()
    assert "stopping at once" not in err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_metrics_write_on_a_full_disk_warns_once_and_training_goes_on(capsys):
    from tuneforge.train.metrics import MetricsLog

    log = MetricsLog(Path("/dev/full"))  # every write fails with ENOSPC
    for step in (1, 2):
        log.write({"step": step, "loss": 1.0})
    log.close()
    err = capsys.readouterr().err
    assert err.count("warning: /dev/full: step 1 not written (No space left on device)") == 1
    assert "step 2" not in err


def test_a_resume_drops_a_metrics_line_cut_off_by_a_crash(tmp_path):
    from tuneforge.train.resume import truncate_log

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo\n{"step": 4}\n')
    assert truncate_log(path, 2) == 1
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_a_full_disk_while_a_resume_cuts_the_log_back_leaves_the_whole_log(tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    from tuneforge.train.resume import truncate_log

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')

    def no_space(self, *args, **kwargs):  # as on a full disk: the file opened (emptied), nothing written
        self.open("w").close()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", no_space)
    with pytest.raises(OSError):
        truncate_log(path, 1)
    monkeypatch.undo()
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_write_faults_are_read_from_the_errors_writers_wrap_them_in(tmp_path):
    import errno

    from tuneforge.train.write_faults import WriteFault, classify

    safetensors = RuntimeError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
    )
    wrapped = RuntimeError("checkpoint write failed")
    wrapped.__cause__ = OSError(errno.EFBIG, "File too large")
    cases = {
        OSError(errno.ENOSPC, "No space left on device"): WriteFault.NO_SPACE,
        OSError(errno.EDQUOT, "Disk quota exceeded"): WriteFault.NO_SPACE,
        safetensors: WriteFault.NO_SPACE,
        wrapped: WriteFault.FILE_TOO_LARGE,
        PermissionError(errno.EACCES, "Permission denied"): WriteFault.NOT_WRITABLE,
        OSError(errno.EROFS, "Read-only file system"): WriteFault.NOT_WRITABLE,
        # No errno anywhere, and a write into the directory works: not a fault of the disk.
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 300416 vs 300368"): WriteFault.OTHER,
        KeyError("a bug"): WriteFault.OTHER,
    }
    for exc, fault in cases.items():
        assert classify(exc, tmp_path) == fault, exc


@pytest.mark.slow
def test_a_master_port_in_use_is_named_before_the_workers_start(tmp_path):
    import socket

    write_job(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [TUNEFORGE, "train", str(tmp_path / "cfg.yaml"), "--work-dir", str(tmp_path / "run")]
        result = subprocess.run(
            [*command, "--nproc-per-node", "2", "--master-port", str(port)], capture_output=True, text=True, timeout=120
        )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"error: --master-port {port}: in use on this machine" in result.stderr


def test_a_node_that_never_joins_the_rendezvous_gets_one_message_naming_the_settings(tmp_path, monkeypatch):
    """torchrun's store times out when a node never joins (not started, or started with another port): the
    launcher says which settings every node must share instead of a DistStoreError traceback."""
    from torch.distributed import DistStoreError

    import tuneforge.launch as launch_module
    from tuneforge.errors import UserError

    def never_joined(args):
        raise DistStoreError("Timed out after 601 seconds waiting for clients. 1/2 clients joined.")

    monkeypatch.setattr(launch_module, "elastic_run", never_joined)
    port = free_port()
    with pytest.raises(UserError) as info:
        launch_module.launch_workers(["train", "x.yaml"], 1, 2, 0, "127.0.0.1", port, tmp_path)
    message = str(info.value)
    assert message.startswith(f"the launcher's rendezvous on 127.0.0.1:{port} did not complete (Timed out after 601")
    assert "start all 2 node(s) with the same --nnodes, --master-addr and --master-port" in message


def test_workers_tell_a_launcher_that_is_process_one_from_init(monkeypatch):
    """In a container whose command is the launcher, the workers' parent is process 1: that is the launcher
    alive, not init adopting orphans."""
    from tuneforge.launcher_watch import LAUNCHER_PID, launcher_is_process_one

    monkeypatch.setenv(LAUNCHER_PID, "1")
    assert launcher_is_process_one()
    monkeypatch.setenv(LAUNCHER_PID, "4242")  # a launcher of ours elsewhere; process 1 told by its command line
    for command, launcher in ((b"/sbin/init\0", False), (b"python\0-m\0torch.distributed.run\0--nproc-per-node", True)):
        monkeypatch.setattr(Path, "read_bytes", lambda self, command=command: command)
        assert launcher_is_process_one() is launcher, command
