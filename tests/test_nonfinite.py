"""Non-finite steps are skipped and reported with their samples; too many in a row stop the run clearly."""

from __future__ import annotations

import math
import subprocess

import pytest

from conftest import TINY_LLAMA, chat, launch, metrics, train_here, write_jsonl

CONFIG = (
    TINY_LLAMA
    + """\
data: {train_files: [train.jsonl], cache_dir: null}
train: {lr: 3.0e-3, micro_batch_size: 2, max_steps: 5, precision: fp32}
checkpoint: {every_steps: 0, save_final: false}
log: {progress: lines}
"""
)


def run(tmp_path, name: str, fault: str, *extra: str, ranks: int = 1) -> subprocess.CompletedProcess:
    write_jsonl(tmp_path / "train.jsonl", [chat(f"question {i}", f"answer {i * 7}") for i in range(12)])
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    engine = ["parallel.engine=ddp"] if ranks > 1 else []
    if ranks == 1:
        return train_here(tmp_path / "cfg.yaml", tmp_path / name, *extra, fault=fault)
    return launch(tmp_path / "cfg.yaml", tmp_path / name, *extra, *engine, ranks=ranks, fault=fault)


@pytest.mark.slow
def test_a_nan_step_is_skipped_and_its_samples_named(tmp_path):
    clean = run(tmp_path, "clean", "")
    poisoned = run(tmp_path, "nan", "nan_loss:0:3")
    assert clean.returncode == 0 and poisoned.returncode == 0, poisoned.stderr[-2000:]
    steps = metrics(tmp_path / "nan")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert math.isnan(steps[2]["loss"]) and steps[2]["skipped"] is True
    assert all(math.isfinite(r["loss"]) and "skipped" not in r for r in steps[:2] + steps[3:])
    # Steps before the bad one are untouched; the skipped step changed no weight, so the run goes on sanely.
    assert [r["loss"] for r in steps[:2]] == [r["loss"] for r in metrics(tmp_path / "clean")[:2]]
    line = next(line for line in poisoned.stdout.splitlines() if "is not finite" in line)
    assert "step 3: loss nan" in line and "the step was skipped; its samples: " in line
    assert line.count("train.jsonl:") == 2  # the micro-batch of 2 samples, by file:line


@pytest.mark.slow
def test_too_many_in_a_row_stop_with_a_clear_message(tmp_path):
    result = run(tmp_path, "stop", "nan_loss:0:2", "train.max_nonfinite_steps=1")
    assert result.returncode == 2
    assert "error: training stopped at step 2: 1 non-finite step(s) in a row" in result.stderr
    assert "--resume auto" in result.stderr


@pytest.mark.slow
def test_two_ranks_skip_together_and_name_the_samples_of_both(tmp_path):
    result = run(tmp_path, "ddp", "nan_loss:1:3", ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = metrics(tmp_path / "ddp")
    assert steps[2]["skipped"] is True and len(steps) == 5
    line = next(line for line in result.stdout.splitlines() if "is not finite" in line)
    assert line.count("train.jsonl:") == 4  # 2 samples per rank, from both ranks
