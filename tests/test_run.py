"""Whole runs in-process on a tiny fresh Llama: reproducibility and model-section errors."""

from __future__ import annotations

import pytest

from tuneforge.config import load_config
from tuneforge.errors import UserError
from tuneforge.train.run import run_training

from conftest import chat, metrics, write_jsonl

CONFIG = """\
model:
  architecture: llama
  size: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4}
  tokenizer: bytes
data:
  train_files: [train.jsonl]
  cache_dir: null
train:
  lr: 1.0e-3
  micro_batch_size: 3
  gradient_accumulation: 2
  epochs: 2
  precision: fp32
checkpoint: {every_steps: 0, save_final: false}
log: {progress: lines}
"""


@pytest.fixture
def config_file(tmp_path):
    records = [chat(f"question {i} " + "x" * (i % 7), f"answer {i * i}") for i in range(14)]
    write_jsonl(tmp_path / "train.jsonl", records)
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG)
    return path


def losses(work_dir) -> list[float]:
    return [record["loss"] for record in metrics(work_dir)]


@pytest.mark.slow
def test_same_seed_gives_the_same_losses_and_another_seed_does_not(config_file, tmp_path):
    run_training(load_config(config_file), tmp_path / "a")
    run_training(load_config(config_file), tmp_path / "b")
    run_training(load_config(config_file, ["train.seed=1"]), tmp_path / "c")
    first = losses(tmp_path / "a")
    # 14 samples in micro-batches of 3 -> 5 per epoch -> 3 steps per epoch (the last takes one micro-batch).
    assert len(first) == 6
    assert first == losses(tmp_path / "b")
    assert first != losses(tmp_path / "c")


@pytest.mark.slow
def test_packed_training_sees_every_token_once_per_epoch_and_reports_padding(config_file, tmp_path, capsys):
    run_training(load_config(config_file, ["data.packing=true", "data.max_length=128"]), tmp_path / "p")
    assert "padding per epoch: random" in capsys.readouterr().out
    run_training(load_config(config_file), tmp_path / "u")
    packed, unpacked = metrics(tmp_path / "p"), metrics(tmp_path / "u")
    assert len(packed) < len(unpacked)  # rows of several samples: fewer steps for the same two epochs
    for key in ("tokens", "trained_tokens"):
        assert sum(r[key] for r in packed) == sum(r[key] for r in unpacked)


@pytest.mark.slow
def test_a_typo_in_model_size_is_named(config_file, tmp_path):
    config = load_config(config_file, ["model.size.hidden_sise=64"])
    with pytest.raises(UserError, match=r"model.size.hidden_sise: not a field of the llama config; did you mean"):
        run_training(config, tmp_path / "wd")


@pytest.mark.slow
def test_unknown_architecture_suggests_one(config_file, tmp_path):
    config = load_config(config_file, ["model.architecture=lama"])
    with pytest.raises(UserError, match=r"'lama' is not a transformers model type; did you mean .*llama"):
        run_training(config, tmp_path / "wd")
