"""Damaged checkpoints and a full disk: resume passes over a checkpoint truncated since it was written and says
so, refuses one whose state cannot be read naming an older one, and a save that finds the disk full keeps the
previous checkpoint and says how much room one takes. One process, in this one."""

from __future__ import annotations

import json
import re

import pytest

from tuneforge.config import load_config
from tuneforge.errors import UserError
from tuneforge.train.run import run_training
from tuneforge.train.state import read_state

from conftest import TINY_LLAMA, chat, write_jsonl

CONFIG = (
    TINY_LLAMA
    + """\
data: {train_files: [train.jsonl], cache_dir: null}
train: {lr: 3.0e-3, micro_batch_size: 2, gradient_accumulation: 2, max_steps: 4, precision: fp32}
checkpoint: {every_steps: 2, keep_last: 3, save_final: false}
log: {progress: lines, plot: false}
"""
)


def train(tmp_path, *overrides: str, resume: str | None = None) -> dict:
    return run_training(load_config(tmp_path / "cfg.yaml", list(overrides)), tmp_path / "run", resume)


@pytest.fixture
def two_checkpoints(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [chat(f"question {i}", f"answer {i * 7}") for i in range(20)])
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    train(tmp_path)
    return tmp_path / "run" / "checkpoints"


@pytest.mark.slow
def test_resume_passes_over_a_truncated_checkpoint_and_refuses_one_that_cannot_be_read(
    tmp_path, two_checkpoints, capsys
):
    state = two_checkpoints / "step-4" / "training_state" / "engine.pt"
    size = state.stat().st_size
    state.write_bytes(state.read_bytes()[: size // 2])
    # Named explicitly, the damaged one is refused with what is wrong with it.
    with pytest.raises(UserError, match=r"--resume .*step-4: damaged since it was written: .*engine\.pt has"):
        train(tmp_path, "train.max_steps=6", resume=str(two_checkpoints / "step-4"))

    capsys.readouterr()
    train(tmp_path, "train.max_steps=6", resume="auto")
    out = capsys.readouterr().out
    assert f"resume: passing over {two_checkpoints / 'step-4'}: {state} has {size // 2:,} bytes, {size:,} " in out
    assert f"resumed from {two_checkpoints / 'step-2'}: step 2 of 6" in out

    # The same size but unreadable content: refused naming the older checkpoint to take instead.
    state = two_checkpoints / "step-6" / "training_state" / "engine.pt"
    state.write_bytes(b"\0" * state.stat().st_size)
    with pytest.raises(UserError) as info:
        train(tmp_path, "train.max_steps=7", resume="auto")
    assert str(info.value).startswith(f"--resume {two_checkpoints / 'step-6'}: its training state cannot be read (")
    assert str(info.value).endswith(f"; an older one: --resume {two_checkpoints / 'step-4'}")


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["same size", "missing"])
def test_resume_auto_passes_over_a_checkpoint_whose_state_record_is_unreadable(
    tmp_path, two_checkpoints, capsys, damage
):
    """The newest checkpoint's state.json overwritten with bytes of its own size (which the manifest's sizes do not
    catch), or gone: `--resume auto` passes over it with a line, as over any damaged one, and takes the older."""
    record = two_checkpoints / "step-4" / "training_state" / "state.json"
    if damage == "missing":
        (two_checkpoints / "step-4" / "manifest.json").unlink()  # as in a checkpoint written before manifests
        record.unlink()
    else:
        record.write_bytes(b"x" * record.stat().st_size)
    capsys.readouterr()
    train(tmp_path, "train.max_steps=5", resume="auto")
    out = capsys.readouterr().out
    assert f"resume: passing over {two_checkpoints / 'step-4'}: " in out
    assert f"resumed from {two_checkpoints / 'step-2'}: step 2 of 5" in out


@pytest.mark.slow
def test_a_resume_from_an_older_checkpoint_sets_the_newer_ones_aside_so_keep_last_keeps_its_own(
    tmp_path, two_checkpoints, capsys
):
    """Resumed from step 2 while step-4 exists (step 3 onwards went wrong), keeping 1 checkpoint saved every 3
    steps: the old step-4 is moved to checkpoints/abandoned, so pruning keeps this run's newest checkpoint
    instead of deleting it for the abandoned one, and `--resume auto` can never go back to that one."""
    capsys.readouterr()
    overrides = ("train.max_steps=5", "checkpoint.every_steps=3", "checkpoint.keep_last=1")
    train(tmp_path, *overrides, resume=str(two_checkpoints / "step-2"))
    out = capsys.readouterr().out
    abandoned = two_checkpoints / "abandoned" / "step-4"
    assert f"resume: {two_checkpoints / 'step-4'} is newer than step 2, which this run goes on from: moved to " in out
    assert abandoned.is_dir() and read_state(abandoned).step == 4
    steps = sorted(p.name for p in two_checkpoints.iterdir() if p.name.startswith("step-"))
    assert steps in (["step-3"], ["step-5"]), steps


@pytest.mark.slow
def test_when_every_checkpoint_is_damaged_resume_auto_refuses_instead_of_starting_over(tmp_path, two_checkpoints):
    for name in ("step-2", "step-4"):
        (two_checkpoints / name / "model.safetensors").unlink()
    with pytest.raises(UserError) as info:
        train(tmp_path, "train.max_steps=5", resume="auto")
    lines = str(info.value).splitlines()
    assert lines[0] == f"resume: passing over {two_checkpoints / 'step-4'}: {two_checkpoints / 'step-4'}/" + (
        "model.safetensors is missing"
    )
    assert lines[-1].startswith("every step checkpoint of this run is damaged: restore one (--resume PATH)")


@pytest.mark.slow
def test_a_full_disk_at_save_keeps_the_previous_checkpoint_and_says_what_one_takes(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "train.jsonl", [chat(f"question {i}", f"answer {i * 7}") for i in range(20)])
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    monkeypatch.setenv("TUNEFORGE_INJECT_FAULT", "disk_full_in_save:0:4")
    with pytest.raises(UserError) as info:
        train(tmp_path)
    checkpoints = tmp_path / "run" / "checkpoints"
    message = str(info.value)
    assert message.startswith(f"checkpoint {checkpoints / 'step-4'} not written: no space left (")
    assert re.search(r"a checkpoint of this run takes about [0-9.]+ KiB \(the size of step-2\)", message), message
    assert f"the previous checkpoint {checkpoints / 'step-2'} is intact" in message
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2"]  # the half-written one is gone


@pytest.mark.slow
def test_chat_and_export_of_a_damaged_checkpoint_or_to_an_unusable_out_say_so(tmp_path, two_checkpoints, capsys):
    from tuneforge.cli import main

    step_2, step_4 = two_checkpoints / "step-2", two_checkpoints / "step-4"
    (tmp_path / "a-file").write_text("")
    assert main(["export", str(step_4), "--out", str(tmp_path / "a-file" / "out")]) == 2
    assert capsys.readouterr().err == (
        f"error: --out {tmp_path / 'a-file' / 'out'}: {tmp_path / 'a-file'} is a file, not a directory; choose "
        "another path\n"
    )
    (step_2 / "model.safetensors").unlink()
    assert main(["chat", str(step_2), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == (
        f"error: {step_2}: damaged since it was written: {step_2 / 'model.safetensors'} is missing\n"
    )
    # Without a manifest (a directory from elsewhere), a truncated file is found by reading its header.
    (step_4 / "manifest.json").unlink()
    weights = step_4 / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["export", str(step_4), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {weights}: not readable (")


@pytest.mark.slow
def test_a_resume_on_training_data_that_changed_says_what_it_will_do(tmp_path, two_checkpoints, capsys):
    write_jsonl(tmp_path / "train.jsonl", [chat(f"question {i}", f"answer {i * 7}") for i in range(10)])
    capsys.readouterr()
    train(tmp_path, "train.max_steps=6", resume=str(two_checkpoints / "step-4"))
    out = capsys.readouterr().out
    assert (
        f"resume: the training data changed since {two_checkpoints / 'step-4'} was written (20 samples then, 10 now"
    ) in out
    assert "at epoch 1, step 2 of 3 in it" in out  # 10 samples in micro-batches of 2, accumulation 2: 3 steps


@pytest.mark.slow
def test_an_unchanged_resume_says_nothing_of_the_data_and_a_mangled_state_file_is_refused(
    tmp_path, two_checkpoints, capsys
):
    capsys.readouterr()
    train(tmp_path, "train.max_steps=5", resume=str(two_checkpoints / "step-4"))
    assert "training data changed" not in capsys.readouterr().out
    state = two_checkpoints / "step-2" / "training_state" / "state.json"
    state.write_text('["not", "a", "record"]')
    with pytest.raises(UserError, match=r"--resume .*step-2: .*state\.json is not readable"):
        train(tmp_path, "train.max_steps=5", resume=str(two_checkpoints / "step-2"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "state",
    [{"step": "4"}, {"step": -2}, {"micro_batch_size": 0}, {"engine": 3}, {"best_val_loss": "low"}],
    ids=["text-step", "negative-step", "zero-batch", "number-engine", "text-loss"],
)
def test_a_hand_edited_state_file_is_refused_with_the_field_named(tmp_path, two_checkpoints, state):
    path = two_checkpoints / "step-4" / "training_state" / "state.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **state}))
    (field,) = state
    with pytest.raises(UserError, match=rf"--resume .*step-4: .*state\.json is not readable \({field} is "):
        train(tmp_path, "train.max_steps=6", resume=str(two_checkpoints / "step-4"))


@pytest.mark.slow
def test_a_manifest_naming_files_outside_its_checkpoint_is_never_followed(tmp_path, two_checkpoints):
    manifest = two_checkpoints / "step-4" / "manifest.json"
    outside = tmp_path / "secret.txt"
    outside.write_text("1234567")
    for files in ({"../../../secret.txt": 3}, {str(outside): 3}, {"model.safetensors": -1}):
        manifest.write_text(json.dumps({"files": files}))
        with pytest.raises(UserError) as info:
            train(tmp_path, "train.max_steps=6", resume=str(two_checkpoints / "step-4"))
        assert "not a file of this checkpoint: it was not written by tuneforge" in str(info.value)
        assert "7 bytes" not in str(info.value)
