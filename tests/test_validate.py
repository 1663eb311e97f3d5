"""Validation loss: every sample counted once on any number of ranks, logged, and the best model kept."""

from __future__ import annotations

import json

import pytest

from tuneforge.config import load_config
from tuneforge.distributed import Layout
from tuneforge.train.objectives import build_objective
from tuneforge.train.run import run_training
from tuneforge.train.validate import validation_batches, validation_loss

from conftest import accumulate, chat, rows_batch, single_engine, tiny_llama, tokenized, write_jsonl


@pytest.mark.parametrize(("world_size", "sequence_parallel"), [(1, 1), (2, 1), (3, 1), (2, 2), (6, 2)])
@pytest.mark.parametrize("packing", [False, True])
def test_every_target_counts_once_whatever_the_ranks(tokenizer, world_size, sequence_parallel, packing):
    data = tokenized(tokenizer, [chat(f"q{i}" * (1 + i % 3), f"answer {i}") for i in range(5)])
    per_rank = [
        list(
            validation_batches(
                data, 1, tokenizer.pad_token_id, Layout.of(rank, world_size, sequence_parallel), packing, 256
            )
        )
        for rank in range(world_size)
    ]
    assert len({len(batches) for batches in per_rank}) == 1  # the same number of forwards on every rank
    counted = sum(b.num_targets for batches in per_rank for b in batches)
    assert counted == rows_batch(data, list(range(5)), tokenizer.pad_token_id).num_targets


def test_validation_loss_is_the_token_mean_over_the_split(tokenizer):
    data = tokenized(tokenizer, [chat(f"question {i}", "answer " * (1 + i)) for i in range(4)])
    model = tiny_llama(tokenizer)
    engine = single_engine(model)
    batches = list(validation_batches(data, 2, tokenizer.pad_token_id, Layout(), False, 256))
    result = validation_loss(engine, batches, build_objective(engine, "fp32"))
    loss, targets = result.loss, result.units
    reference = accumulate(engine, [rows_batch(data, list(range(4)), tokenizer.pad_token_id)], "fp32")
    assert targets == reference.num_targets
    assert loss == pytest.approx(reference.loss, rel=1e-6)
    assert model.training  # back in training mode


CONFIG = """\
model:
  architecture: llama
  size: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4}
  tokenizer: bytes
data: {train_files: [train.jsonl], cache_dir: null, validation_fraction: 0.25}
train: {lr: 3.0e-3, micro_batch_size: 4, max_steps: 6, precision: fp32}
checkpoint: {every_steps: 0, keep_best: true}
eval: {every_steps: 2}
log: {progress: lines}
"""


@pytest.mark.slow
def test_val_loss_is_logged_and_the_best_model_kept(tmp_path, capsys):
    write_jsonl(tmp_path / "train.jsonl", [chat(f"question {i % 5}", f"answer {i % 5}") for i in range(24)])
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    summary = run_training(load_config(tmp_path / "cfg.yaml"), tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4, 6]
    assert summary["val_loss"] == records[-1]["val_loss"]
    assert "val_loss" in capsys.readouterr().out
    best = json.loads((tmp_path / "run" / "checkpoints" / "best" / "tuneforge.json").read_text())
    best_step = min((r for r in records if "val_loss" in r), key=lambda r: r["val_loss"])["step"]
    assert best["step"] == best_step
