"""fp16 with dynamic loss scaling: overflowing steps are skipped and counted, the scale adapts, gradients are
unscaled before clipping, and the scaler's state survives a resume."""

from __future__ import annotations

import math
import subprocess

import pytest
import torch

from tuneforge.engines.loss_scale import LossScaler

from conftest import TINY_LLAMA, chat, launch, metrics, train_here, write_jsonl

CONFIG = (
    TINY_LLAMA
    + """\
data: {train_files: [train.jsonl], cache_dir: null}
train: {lr: 3.0e-3, micro_batch_size: 2, gradient_accumulation: 2, max_steps: 8, precision: fp16}
checkpoint: {every_steps: 0, save_final: false}
log: {progress: lines}
"""
)


def train(
    tmp_path, name: str, *overrides: str, ranks: int = 1, fault: str = "", here: bool = False
) -> subprocess.CompletedProcess:
    """Through the launcher; `here`: in this process (runs compared only with runs made the same way)."""
    if here:
        return train_here(tmp_path / "cfg.yaml", tmp_path / name, *overrides, fault=fault)
    return launch(tmp_path / "cfg.yaml", tmp_path / name, *overrides, ranks=ranks, fault=fault)


@pytest.fixture
def job(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [chat(f"question {i}", f"answer {i * 7}") for i in range(24)])
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    return tmp_path


def test_scaler_halves_on_overflow_and_doubles_after_a_clean_window():
    scaler = LossScaler(initial=1024, window=2)
    scaler.update(finite=False)
    assert scaler.scale == 512 and scaler.overflows == 1
    scaler.update(finite=True)
    assert scaler.scale == 512
    scaler.update(finite=True)
    assert scaler.scale == 1024 and scaler.clean_steps == 0
    fixed = LossScaler(initial=8, dynamic=False)
    fixed.update(finite=False)
    assert fixed.scale == 8 and fixed.overflows == 1
    parameter = torch.nn.Parameter(torch.ones(2))
    parameter.grad = torch.full((2,), 2048.0)
    scaler.unscale_([parameter])
    assert parameter.grad.tolist() == [2.0, 2.0]


@pytest.mark.slow
def test_overflowing_steps_are_skipped_counted_and_the_scale_found(job):
    # 2^24 overflows this model's fp16 gradients; each overflow halves the scale until the gradients fit.
    result = train(job, "run", "train.initial_loss_scale=16777216", here=True)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = metrics(job / "run")
    overflowed = [r for r in steps if r.get("overflow")]
    assert overflowed and len(overflowed) < len(steps)
    # The overflows are the first steps, each at half the previous scale, and every one was skipped.
    assert [r["step"] for r in overflowed] == list(range(1, len(overflowed) + 1))
    assert [r["loss_scale"] for r in overflowed] == [2.0 ** (24 - i) for i in range(len(overflowed))]
    assert all(r["skipped"] is True and not math.isfinite(r["grad_norm"]) for r in overflowed)
    clean = steps[len(overflowed) :]
    assert all(math.isfinite(r["grad_norm"]) and "skipped" not in r for r in clean)
    assert clean[0]["loss_scale"] == 2.0 ** (24 - len(overflowed))
    assert f"fp16 overflow steps skipped: {len(overflowed)} of 8" in result.stdout
    assert "fp16 gradients overflowed at loss scale 1.67772e+07; the step was skipped" in result.stdout


@pytest.mark.slow
def test_gradients_are_unscaled_before_the_norm(job):
    """The reported norm (and so clipping) is that of the true gradients: fp16 matches fp32 closely."""
    assert train(job, "fp32", "train.precision=fp32", "train.max_steps=3", here=True).returncode == 0
    result = train(job, "fp16", "train.max_steps=3", here=True)
    assert result.returncode == 0, result.stderr[-3000:]
    reference, half = metrics(job / "fp32"), metrics(job / "fp16")
    assert all("overflow" not in r for r in half)
    for ours, theirs in zip(half, reference, strict=True):
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=0.03)
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=0.01)


@pytest.mark.slow
def test_resume_restores_the_loss_scale(job):
    """Overflow before the checkpoint and growth after it: the resumed run's scales and losses are the same."""
    overrides = ["train.initial_loss_scale=16777216", "train.loss_scale_window=2", "checkpoint.every_steps=3"]
    assert train(job, "whole", *overrides, "train.max_steps=12", here=True).returncode == 0
    killed = train(job, "run", *overrides, "train.max_steps=12", fault="kill:0:8")
    assert killed.returncode != 0
    resumed = train(job, "run", *overrides, "train.max_steps=12", "--resume", "auto", here=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole, run = metrics(job / "whole"), metrics(job / "run")

    def trace(steps: list[dict]) -> list[tuple]:
        return [(r["step"], r["loss_scale"], r["loss"]) for r in steps]

    assert trace(run) == trace(whole)
    scales = [r["loss_scale"] for r in whole]
    grew = [i for i in range(7, len(scales)) if scales[i] > scales[i - 1]]
    assert min(scales[:6]) < scales[0] and grew  # fell before the checkpoint of step 6, grew after it


def deepspeed_has_fp16() -> bool:
    """DeepSpeed's CPU accelerator offers fp16 only where oneDNN does (AVX512-FP16 or AMX CPUs)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().is_fp16_supported()


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
def test_sharded_engines_skip_overflow_on_two_ranks(job, engine):
    """FSDP2 unscales sharded gradients itself; DeepSpeed gets the same settings for its own scaler, or, on a
    machine where its accelerator has no fp16, refuses with a message saying what to use."""
    result = train(
        job,
        engine,
        f"parallel.engine={engine}",
        "parallel.zero_stage=2",
        "train.initial_loss_scale=16777216",
        "train.max_steps=8",
        ranks=2,
    )
    if engine == "deepspeed" and not deepspeed_has_fp16():
        assert result.returncode == 2 and "DeepSpeed's cpu accelerator has no fp16 on this machine" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-3000:]
    steps = metrics(job / engine)
    overflowed = [r for r in steps if r.get("overflow")]
    assert overflowed and [r["step"] for r in overflowed] == list(range(1, len(overflowed) + 1))
    assert [r["loss_scale"] for r in overflowed] == [2.0 ** (24 - i) for i in range(len(overflowed))]
    assert all(r["skipped"] is True for r in overflowed)
    assert all(math.isfinite(r["grad_norm"]) for r in steps[len(overflowed) :])
