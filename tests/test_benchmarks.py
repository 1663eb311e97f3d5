"""The GPU benchmark runs where a GPU is lent only for minutes: its code is checked here first, on tiny shapes
on the CPU (the figures it prints here mean nothing and are not read)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_lora.py"


def run_benchmark(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--device", "cpu", "--smoke", "--steps", "1", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_the_gpu_benchmark_compares_both_contenders_and_the_doctor_on_tiny_shapes():
    out = run_benchmark("--models", "deepseek_v2_lite")
    table = [line.split() for line in out.splitlines() if line.endswith(("of 16", "rows of 2048"))]
    rows = [words[0] for words in table]
    assert rows == ["tuneforge", "transformers"]  # the row that matters first
    assert "padded, 1 micro-batch of 16" in out and "rows of 2048" in out
    assert "tuneforge / transformers: trained tokens/s" in out
    assert re.search(r"doctor's estimate on H200 141GB for \d+ rows of 2048 per step", out), out


@pytest.mark.slow
def test_the_gpu_benchmark_runs_tuneforge_train_beside_its_step_on_tiny_shapes():
    out = run_benchmark("--models", "deepseek_v2_lite", "--train-run")
    assert "tuneforge train failed" not in out, out
    assert "step alone:" in out and "over steps 3-3 (3 rows of 2048 per step)" in out
    assert "train / step alone:" in out and "s in 3 steps" in out
    assert "doctor's estimate on H200 141GB for this job" in out


def test_the_gpu_busy_time_counts_overlapping_kernels_once():
    sys.path.insert(0, str(BENCHMARK.parent))
    try:
        from gpu_lora import covered
    finally:
        sys.path.remove(str(BENCHMARK.parent))
    assert covered([]) == 0
    assert covered([(5, 7), (0, 2)]) == 4
    assert covered([(0, 4), (1, 2), (3, 6), (8, 9)]) == 7  # nested, overlapping, then apart
