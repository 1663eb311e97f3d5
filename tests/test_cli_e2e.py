"""The demo config through the real CLI with a tiny budget: files written, loss falls, chat answers."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tuneforge.config import load_config

from conftest import REPO, TUNEFORGE

OVERRIDES = [
    "train.max_steps=40",
    "train.micro_batch_size=16",  # a quarter of the demo's batch: the loss still halves, in a quarter of the time
    "train.warmup_steps=5",
    "train.precision=fp32",
    "checkpoint.every_steps=20",
    "eval.sample_every_steps=20",
]
PROMPT = "#ff8800"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    work_dir = tmp_path_factory.mktemp("demo")
    overrides = [*OVERRIDES, f"data.cache_dir={work_dir / 'cache'}"]
    result = subprocess.run(
        [TUNEFORGE, "train", str(REPO / "configs" / "demo.yaml"), *overrides, "--work-dir", str(work_dir)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return work_dir, result.stdout, overrides


@pytest.mark.slow
def test_resolved_config_is_written(demo_run):
    work_dir, _, overrides = demo_run
    assert load_config(work_dir / "config.yaml") == load_config(REPO / "configs" / "demo.yaml", overrides)


@pytest.mark.slow
def test_metrics_have_one_record_per_step_and_the_loss_falls(demo_run):
    work_dir, _, _ = demo_run
    records = [json.loads(line) for line in (work_dir / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == list(range(1, 41))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"):
        assert all(isinstance(r[key], float) for r in records), key
    first = sum(r["loss"] for r in records[:5]) / 5
    last = sum(r["loss"] for r in records[-5:]) / 5
    assert last < 0.5 * first


@pytest.mark.slow
def test_checkpoints_are_hugging_face_directories(demo_run):
    work_dir, _, _ = demo_run
    names = sorted(p.name for p in (work_dir / "checkpoints").iterdir())
    assert names == ["final", "step-20", "step-40"]
    for name in names:
        for file in ("model.safetensors", "config.json", "tokenizer.json", "tuneforge.json"):
            assert (work_dir / "checkpoints" / name / file).exists(), (name, file)


@pytest.mark.slow
def test_samples_and_accuracy_are_reported(demo_run):
    work_dir, stdout, _ = demo_run
    samples = [json.loads(line) for line in (work_dir / "samples.jsonl").open()]
    assert sorted({s["step"] for s in samples}) == [20, 40]
    result = json.loads((work_dir / "eval.json").read_text())
    assert result["label"] == "demo" and result["total"] == 200
    printed = re.search(r"^demo accuracy: ([0-9.]+)$", stdout, re.MULTILINE)
    assert printed and float(printed.group(1)) == pytest.approx(result["accuracy"], abs=5e-4)


@pytest.mark.slow
def test_chat_answers_from_the_checkpoint_like_the_final_sample(demo_run, capsys):
    from tuneforge.cli import main

    work_dir, _, _ = demo_run
    final = str(work_dir / "checkpoints" / "final")
    assert main(["chat", final, "--prompt", PROMPT, "--max-new-tokens", "24"]) == 0
    reply = capsys.readouterr().out.strip()
    final_sample = next(
        s for s in map(json.loads, (work_dir / "samples.jsonl").open()) if s["step"] == 40 and s["prompt"] == PROMPT
    )
    assert reply == final_sample["reply"].strip()
    assert reply


def test_chat_on_a_directory_without_a_model_says_so(tmp_path, capsys):
    from tuneforge.cli import main

    assert main(["chat", str(tmp_path), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {tmp_path}: not a model checkpoint")
