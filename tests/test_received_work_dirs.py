"""Work dirs, checkpoints and export targets someone handed over: nothing in them runs code, makes tuneforge write
outside where the user asked, or ends in a traceback. Links in `checkpoints/` are never followed (a `.tmp-`/`.old-`
link is unlinked, a `step-N` link refused), a checkpoint's state holding a pickle with code is refused naming the
file, a linked `--out` is refused before the export runs, and a damaged `run.json`, a lock naming an impossible or
reused pid, or a folder of someone else's files as `--work-dir` each get one line."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time

import pytest

from tuneforge.train.checkpoint import prune_checkpoints, set_aside_newer, tidy_checkpoints
from tuneforge.train.saving import Checkpointer
from tuneforge.train.workdir import LOCK_FILE, release_lock, take_lock

from conftest import TINY_LLAMA, chat, train_here, tuneforge_here, write_jsonl

CONFIG = (
    TINY_LLAMA
    + """\
data: {train_files: [train.jsonl], cache_dir: null}
train: {lr: 3.0e-3, micro_batch_size: 2, max_steps: 4, precision: fp32}
checkpoint: {every_steps: 2, keep_last: 3, save_final: false}
log: {progress: lines, plot: false}
"""
)


def outside_dir(tmp_path, name: str = "outside"):
    """A folder outside the work dir holding someone's file."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    return folder


def listing(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A config and a work dir trained 4 steps (step-2, step-4), copied per test (`received`)."""
    root = tmp_path_factory.mktemp("trained")
    write_jsonl(root / "train.jsonl", [chat(f"question {i}", f"answer {i * 7}") for i in range(12)])
    (root / "cfg.yaml").write_text(CONFIG)
    result = train_here(root / "cfg.yaml", root / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.fixture
def received(trained, tmp_path):
    """This test's copy of the trained work dir, as handed over: (config, work dir)."""
    shutil.copy(trained / "train.jsonl", tmp_path / "train.jsonl")
    shutil.copy(trained / "cfg.yaml", tmp_path / "cfg.yaml")
    shutil.copytree(trained / "run", tmp_path / "run", symlinks=True)
    return tmp_path / "cfg.yaml", tmp_path / "run"


# 1. Links in checkpoints/: never followed.


@pytest.mark.slow
def test_a_linked_tmp_checkpoint_is_unlinked_and_the_save_stays_in_the_work_dir(received, tmp_path):
    config, work_dir = received
    outside = outside_dir(tmp_path)
    checkpoints = work_dir / "checkpoints"
    (checkpoints / ".tmp-step-6").symlink_to(outside)
    (checkpoints / ".old-step-4").symlink_to(outside)
    result = train_here(config, work_dir, "--resume", "auto", "train.max_steps=6")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"checkpoints: removed the link {checkpoints / '.tmp-step-6'} (not followed: {outside}" in result.stdout
    assert f"checkpoints: removed the link {checkpoints / '.old-step-4'} (not followed" in result.stdout
    assert listing(outside) == ["keep.txt"]  # nothing written into, nothing deleted from the folder outside
    step6 = checkpoints / "step-6"
    assert step6.is_dir() and not step6.is_symlink()
    assert (step6 / "training_state" / "engine.pt").is_file()
    assert not os.path.lexists(checkpoints / ".tmp-step-6") and not os.path.lexists(checkpoints / ".old-step-4")


@pytest.mark.slow
def test_a_linked_step_checkpoint_is_refused_by_resume_auto(received, tmp_path):
    config, work_dir = received
    checkpoints = work_dir / "checkpoints"
    outside = tmp_path / "outside"
    shutil.copytree(checkpoints / "step-4", outside)
    before = listing(outside)
    (checkpoints / "step-6").symlink_to(outside)
    result = train_here(config, work_dir, "--resume", "auto", "train.max_steps=8")
    assert result.returncode == 2  # a UserError: one line, no traceback
    assert result.stderr.startswith(
        f"error: {checkpoints / 'step-6'} is a symbolic link (to {outside}), not a checkpoint this run wrote"
    ), result.stderr
    assert "cp -rL" in result.stderr and "Traceback" not in result.stderr
    assert listing(outside) == before
    assert (checkpoints / "step-6").is_symlink()  # refused, left as it was


def test_saving_over_a_linked_tmp_dir_unlinks_it_and_writes_a_fresh_dir(tmp_path):
    outside = outside_dir(tmp_path)
    tmp = tmp_path / "checkpoints" / ".tmp-step-2"
    tmp.parent.mkdir()
    tmp.symlink_to(outside)
    Checkpointer._fresh(tmp)
    assert tmp.is_dir() and not tmp.is_symlink()
    assert listing(tmp) == ["training_state"]
    assert listing(outside) == ["keep.txt"]


def test_pruning_and_setting_aside_move_or_unlink_links_never_their_targets(tmp_path):
    outside = outside_dir(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    for step in (4, 6):
        (checkpoints / f"step-{step}").mkdir(parents=True)
    (checkpoints / "step-2").symlink_to(outside)
    assert [p.name for p in prune_checkpoints(checkpoints, keep_last=2)] == ["step-2"]
    assert not os.path.lexists(checkpoints / "step-2") and listing(outside) == ["keep.txt"]

    (checkpoints / "step-8").symlink_to(outside)
    lines = set_aside_newer(checkpoints, 6)
    moved = checkpoints / "abandoned" / "step-8"
    assert moved.is_symlink() and lines == [
        f"resume: {checkpoints / 'step-8'} is newer than step 6, which this run goes on from: moved to {moved} "
        "(delete it when it is no longer needed)"
    ]
    assert listing(outside) == ["keep.txt"]

    shutil.rmtree(checkpoints / "abandoned")
    (checkpoints / "abandoned").symlink_to(outside)
    (checkpoints / "step-8").mkdir()
    with pytest.raises(Exception, match=r"abandoned is a symbolic link .* never through a link"):
        set_aside_newer(checkpoints, 6)
    assert (checkpoints / "step-8").is_dir() and listing(outside) == ["keep.txt"]


def test_tidying_says_removed_only_for_what_is_gone(tmp_path, monkeypatch):
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / ".tmp-step-3").mkdir(parents=True)

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shutil, "rmtree", refuse)
    assert tidy_checkpoints(checkpoints) == [
        f"checkpoints: warning: could not remove {checkpoints / '.tmp-step-3'} (half-written when an earlier run "
        "stopped); remove it by hand"
    ]


# 2. A checkpoint's training state that would run code.


@pytest.mark.slow
def test_a_training_state_holding_code_is_refused_naming_the_file_without_torchs_unsafe_hint(received, tmp_path):
    import torch

    config, work_dir = received
    marker = tmp_path / "RAN"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))  # unpickled, it would make the folder

    state = work_dir / "checkpoints" / "step-4" / "training_state" / "engine.pt"
    torch.save({"model": {}, "optimizer": Payload()}, state)
    (work_dir / "checkpoints" / "step-4" / "manifest.json").unlink()  # its size changed: as if made before manifests
    result = train_here(config, work_dir, "--resume", "auto", "train.max_steps=6")
    assert result.returncode == 2  # a UserError: one line, no traceback
    assert result.stderr.startswith(
        f"error: --resume: {state} holds more than tensors and plain data (the Python objects it names would run "
        "code when loaded); tuneforge does not load files that could run code."
    ), result.stderr
    assert "take another checkpoint" in result.stderr
    assert "weights_only" not in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists()


# 3 and 7. export: a linked --out, someone's .tmp-<name>, and auto_map naming code not exported.


@pytest.mark.slow
@pytest.mark.parametrize("target", ["dangling", "empty folder"])
def test_export_refuses_a_linked_out_before_exporting(received, tmp_path, target):
    _, work_dir = received
    out = tmp_path / "exported"
    pointed = tmp_path / "elsewhere"
    if target == "empty folder":
        pointed.mkdir()
    out.symlink_to(pointed)
    result = tuneforge_here("export", str(work_dir / "checkpoints" / "step-4"), "--out", str(out))
    assert result.returncode == 2  # a UserError: one line, no traceback
    assert result.stderr == (
        f"error: --out {out}: is a symbolic link (to {pointed}); export writes a new directory at the path given "
        "and never through a link: pass the real path, or another one\n"
    )
    assert not os.path.lexists(tmp_path / ".tmp-exported")
    assert out.is_symlink() and (not pointed.exists() or listing(pointed) == [])


@pytest.mark.slow
def test_export_leaves_someone_elses_tmp_folder_and_replaces_its_own_half_written_one(received, tmp_path):
    _, work_dir = received
    checkpoint = work_dir / "checkpoints" / "step-4"
    out = tmp_path / "exported"
    theirs = tmp_path / ".tmp-exported"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    result = tuneforge_here("export", str(checkpoint), "--out", str(out))
    assert result.returncode == 2  # a UserError: one line, no traceback
    assert f"{theirs} exists and is not a half-written export of tuneforge's" in result.stderr
    assert listing(theirs) == ["notes.txt"] and not out.exists()

    (theirs / ".tuneforge-export").write_text("")  # as an export stopped half-way leaves it
    result = tuneforge_here("export", str(checkpoint), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert not theirs.exists() and (out / "model.safetensors").is_file()
    assert not (out / ".tuneforge-export").exists()


@pytest.mark.slow
def test_export_drops_auto_map_naming_code_it_does_not_copy(received, tmp_path):
    _, work_dir = received
    checkpoint = tmp_path / "received-checkpoint"
    shutil.copytree(work_dir / "checkpoints" / "step-4", checkpoint)
    (checkpoint / "manifest.json").unlink()
    (checkpoint / "evil.py").write_text("raise SystemExit('ran')\n")
    for name, auto_map in (
        ("config.json", {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}),
        ("tokenizer_config.json", {"AutoTokenizer": [None, "evil.EvilTok"]}),
    ):
        data = json.loads((checkpoint / name).read_text())
        (checkpoint / name).write_text(json.dumps({**data, "auto_map": auto_map}))
    out = tmp_path / "exported"
    result = tuneforge_here("export", str(checkpoint), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert not list(out.glob("*.py"))
    for name in ("config.json", "tokenizer_config.json"):
        assert "auto_map" not in json.loads((out / name).read_text()), name


# 4. The lock.


@pytest.mark.slow
def test_a_lock_naming_an_impossible_pid_is_taken_over_with_a_note(received, tmp_path):
    config, _ = received
    work_dir = tmp_path / "fresh"
    work_dir.mkdir()
    lock = work_dir / LOCK_FILE
    lock.write_text(json.dumps({"pid": 99999999999999, "host": socket.gethostname(), "started": 1}))
    result = train_here(config, work_dir, "train.max_steps=1", "checkpoint.every_steps=0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"work dir: took over the lock {lock}, which names no running process (" in result.stdout
    assert not lock.exists()  # released at the end


def test_a_lock_whose_pid_now_names_a_later_process_is_taken_over(tmp_path):
    lock = tmp_path / LOCK_FILE
    # pid 1 runs, but started long after 2001: it is not the process that took this lock.
    lock.write_text(json.dumps({"pid": 1, "host": socket.gethostname(), "started": 1_000_000_000}))
    assert take_lock(tmp_path).startswith(f"work dir: took over the lock {lock} left by process 1 on ")
    release_lock(tmp_path)


def test_a_live_holder_is_refused_naming_the_lock_file(tmp_path):
    lock = tmp_path / LOCK_FILE
    lock.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "started": time.time()}))
    with pytest.raises(Exception, match=rf"in use by process {os.getppid()} .*delete {lock}\)$"):
        take_lock(tmp_path)


# 5 and 6. run.json, and someone else's files as the work dir.


@pytest.mark.parametrize("record", ["[1, 2]", "{not json", '{"run_id": 7}'])
def test_a_run_record_that_is_not_tuneforges_is_one_line(tmp_path, record):
    write_jsonl(tmp_path / "train.jsonl", [chat(f"question {i}", f"answer {i}") for i in range(8)])
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    work_dir = tmp_path / "run"
    work_dir.mkdir()
    (work_dir / "run.json").write_text(record)
    result = train_here(tmp_path / "cfg.yaml", work_dir, "--resume", "auto")
    assert result.returncode == 2  # a UserError: one line, no traceback
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {work_dir / 'run.json'}: not a run record tuneforge wrote")
    assert "Delete it to continue the newest checkpoint in this work dir with --resume auto" in lines[0]


def test_a_folder_holding_only_someone_elses_diagnostics_is_refused_untouched(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [chat(f"question {i}", f"answer {i}") for i in range(8)])
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    work_dir = tmp_path / "mine"
    (work_dir / "diagnostics").mkdir(parents=True)
    (work_dir / "diagnostics" / "notes.txt").write_text("mine")
    result = train_here(tmp_path / "cfg.yaml", work_dir)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: work dir {work_dir} holds diagnostics/, but no tuneforge run")
    assert listing(work_dir) == ["diagnostics", "diagnostics/notes.txt"]


@pytest.mark.parametrize("archive", [[], ["--archive-previous"]])
def test_a_folder_of_someone_elses_files_is_refused_and_never_moved(tmp_path, archive):
    write_jsonl(tmp_path / "train.jsonl", [chat(f"question {i}", f"answer {i}") for i in range(8)])
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    work_dir = tmp_path / "mine"
    for name in ("checkpoints", "diagnostics"):
        (work_dir / name).mkdir(parents=True)
        (work_dir / name / "notes.txt").write_text(name)
    (work_dir / "eval.json").write_text("{}")
    before = listing(work_dir)
    result = train_here(tmp_path / "cfg.yaml", work_dir, *archive)
    assert result.returncode == 2  # a UserError: one line, no traceback
    assert result.stderr == (
        f"error: work dir {work_dir} holds checkpoints/, eval.json, diagnostics/, but no tuneforge run recorded "
        "itself there (no run.json): tuneforge neither writes into nor moves files it did not write. Train into "
        "another --work-dir, or move them away yourself\n"
    )
    assert listing(work_dir) == before


@pytest.mark.slow
def test_archiving_a_previous_run_names_every_path_it_moves(received):
    config, work_dir = received
    result = train_here(config, work_dir, "--archive-previous", "train.max_steps=1", "checkpoint.every_steps=0")
    assert result.returncode == 0, result.stderr[-3000:]
    (archived,) = (work_dir / "previous-runs").iterdir()
    moved = sorted(p.name for p in archived.iterdir())
    line = next(line for line in result.stdout.splitlines() if line.startswith("work dir: the previous run's"))
    for name in moved:
        assert name in line, (name, line)
    assert line.endswith(f"moved to {archived}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["metrics.jsonl", "config.yaml"])
@pytest.mark.parametrize("resume", [False, True])
def test_a_run_file_that_is_a_link_is_refused_and_its_target_left_as_it_was(received, tmp_path, name, resume):
    """A handed-over work dir whose metrics.jsonl (or config.yaml, ...) links to a file elsewhere: the run would
    append to (or replace) that file."""
    config, work_dir = received
    victim = outside_dir(tmp_path) / "keep.txt"
    (work_dir / name).unlink()
    (work_dir / name).symlink_to(victim)
    extra = ["--resume", "auto"] if resume else ["--archive-previous"]
    result = train_here(config, work_dir, "train.max_steps=6", *extra)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"{name} -> {victim}" in result.stderr and "never through a symbolic link" in result.stderr
    assert victim.read_text() == "mine" and (work_dir / name).is_symlink()
