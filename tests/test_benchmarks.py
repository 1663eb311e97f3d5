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


VLM_BENCHMARK = BENCHMARK.parent / "compare_trl_vlm.py"


def test_the_vlm_benchmark_gives_trl_the_processors_template_with_the_reply_marked():
    """TRL's copy of the LLaVA template renders what the processor's renders (TRL's content-part lists), and its
    {% generation %} markers cover each reply and its end-of-turn token (tuneforge trains the newline after it too:
    one token per reply more)."""
    from tuneforge.data.byte_tokenizer import build_byte_tokenizer
    from tuneforge.model.fresh_vision import vision_chat_template, vision_tokenizer

    sys.path.insert(0, str(VLM_BENCHMARK.parent))
    try:
        from compare_trl_vlm import trl_template
    finally:
        sys.path.remove(str(VLM_BENCHMARK.parent))
    tokenizer = vision_tokenizer(build_byte_tokenizer(), "llava")
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A red square."}]},
        {"role": "user", "content": [{"type": "text", "text": "And?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]},
    ]
    ours = tokenizer.apply_chat_template(messages, chat_template=vision_chat_template("llava"), tokenize=False)
    assert tokenizer.apply_chat_template(messages, chat_template=trl_template(), tokenize=False) == ours
    marked = tokenizer.apply_chat_template(
        messages, chat_template=trl_template(), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = marked["input_ids"]
    trained = [i for i, m in zip(ids, marked["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(trained) == f"A red square.{tokenizer.eos_token}Blue.{tokenizer.eos_token}"


@pytest.mark.slow
def test_the_vlm_benchmark_runs_its_tuneforge_contenders_on_a_tiny_llava(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(VLM_BENCHMARK),
            "--preset",
            "smoke",
            "--workspace",
            str(tmp_path),
            "--contenders",
            "tuneforge-unpacked,tuneforge-packed",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("tuneforge-") and " / " not in line]
    assert [row[0] for row in rows] == ["tuneforge-unpacked", "tuneforge-packed"], done.stdout
    assert rows[0][2] == rows[1][2]  # one epoch each: the same real tokens
    assert "tuneforge-packed / tuneforge-unpacked: tokens/s" in done.stdout
