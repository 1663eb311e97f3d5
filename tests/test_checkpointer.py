"""The Checkpointer on its own, without a Trainer: step checkpoints that load where they are, the last
`keep_last` kept, nothing half-written after a failed write, one message for a full disk, and the stop
checkpoint skipped when it would not fit the grace time left."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from tuneforge.errors import SharedUserError
from tuneforge.train.saving import Checkpointer
from tuneforge.train.state import ResumePoint, read_state

from conftest import single_engine, tiny_llama


def point(step: int) -> ResumePoint:
    return ResumePoint(
        step=step, epoch=0, samples_consumed=step * 4, world_size=1, micro_batch_size=2, gradient_accumulation=2,
        engine="single", run_id="run-1", train_data="4:abc",
    )  # fmt: skip


@pytest.fixture
def checkpointer(tmp_path, tokenizer):
    config = tmp_path / "config.yaml"
    config.write_text("model: {architecture: llama}\n")
    lines: list[str] = []
    engine = single_engine(tiny_llama(tokenizer))
    saver = Checkpointer(
        engine, tokenizer, tmp_path / "checkpoints", config, 2, {"template": "x"}, lines.append, lambda: None
    )
    saver.lines = lines
    return saver


def test_step_checkpoints_load_and_only_the_last_ones_are_kept(checkpointer, tmp_path):
    for step in (1, 2, 3):
        checkpointer.save_step(point(step))
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step-2", "step-3"]
    assert read_state(tmp_path / "checkpoints" / "step-3").samples_consumed == 12
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoints" / "step-3")
    for name, tensor in checkpointer.engine.unwrapped.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, msg=name)
    final = checkpointer.save_model("final", 3)
    assert not (final / "training_state").exists() and (final / "model.safetensors").exists()


def test_a_full_disk_leaves_nothing_half_written_and_says_what_a_checkpoint_takes(checkpointer, tmp_path, monkeypatch):
    checkpointer.save_step(point(1))

    def full(directory):
        (directory / "engine.pt").write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "engine.pt"))

    monkeypatch.setattr(checkpointer.engine, "save_state", full)
    with pytest.raises(SharedUserError) as failed:
        checkpointer.save_step(point(2))
    message = str(failed.value)
    assert "step-2 not written: no space left" in message and "the previous checkpoint" in message
    assert "step-1 is intact" in message and "--resume auto" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]


def test_the_stop_checkpoint_is_skipped_when_it_would_not_fit_the_grace_time(checkpointer, tmp_path):
    assert checkpointer.save_before_stop(point(1), grace_left_s=30) == tmp_path / "checkpoints" / "step-1"
    checkpointer.last_state_save_s = 40.0  # as if the last one had taken 40 s
    assert checkpointer.save_before_stop(point(2), grace_left_s=25) is None
    assert "no checkpoint at step 2: the last one took 40s and 25s of watchdog.stop_grace_s" in checkpointer.lines[-1]
    assert not (tmp_path / "checkpoints" / "step-2").exists()


def test_a_runs_start_clears_what_a_run_killed_while_saving_left(tmp_path):
    """A half-written `.tmp-step-37` (a stop's save killed: the resumed run never saves step 37 again) is
    removed; `.old-final`, where the kill came between a replacement's two renames, is put back as `final`; an
    `.old-best` whose `best` was committed is removed."""
    from tuneforge.train.checkpoint import tidy_checkpoints

    checkpoints = tmp_path / "checkpoints"
    for name in (".tmp-step-37", ".old-final", ".old-best", "best", "step-30"):
        (checkpoints / name).mkdir(parents=True)
        (checkpoints / name / "model.safetensors").write_text(name)
    lines = tidy_checkpoints(checkpoints)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best", "final", "step-30"]
    assert (checkpoints / "final" / "model.safetensors").read_text() == ".old-final"
    assert (checkpoints / "best" / "model.safetensors").read_text() == "best"
    assert lines == [
        f"checkpoints: removed {checkpoints / '.old-best'}, the copy {checkpoints / 'best'} replaced",
        f"checkpoints: {checkpoints / 'final'} put back from {checkpoints / '.old-final'}: a run stopped while "
        "replacing it",
        f"checkpoints: removed {checkpoints / '.tmp-step-37'}, half-written when an earlier run stopped",
    ]
    assert tidy_checkpoints(checkpoints) == [] and tidy_checkpoints(tmp_path / "none") == []


def test_a_replaced_checkpoints_old_copy_that_cannot_be_removed_does_not_fail_the_save(tmp_path, monkeypatch):
    import shutil

    from tuneforge.train.checkpoint import commit_checkpoint

    final, tmp = tmp_path / "final", tmp_path / ".tmp-final"
    for directory, text in ((final, "old"), (tmp, "new")):
        directory.mkdir()
        (directory / "model.safetensors").write_text(text)
    real = shutil.rmtree

    def held_open(path, ignore_errors=False, **kwargs):  # NFS keeps a file another process holds open
        if str(path).endswith(".old-final"):
            if not ignore_errors:
                raise OSError(errno.EBUSY, "Device or resource busy", str(path))
            return
        real(path, ignore_errors=ignore_errors, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", held_open)
    assert commit_checkpoint(tmp, final) == final
    assert (final / "model.safetensors").read_text() == "new" and (tmp_path / ".old-final").exists()
