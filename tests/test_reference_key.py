"""DPO's precomputed reference table is keyed by what its values depend on and checked when read: the model's
files by content (a rewrite that keeps the size and modification time included), the tokenizer, the chat
template, the precision and the data; a table altered after it was written is computed again, with a line that
says so."""

from __future__ import annotations

import os
import time

import torch
from safetensors.torch import load_file

from tuneforge.config.schema import Config
from tuneforge.data.byte_tokenizer import build_byte_tokenizer
from tuneforge.train.reference import (
    DIGEST_CACHE,
    file_digests,
    model_files,
    reference_key,
    reference_log_probs,
    reference_parts,
)


def test_a_file_rewritten_in_place_with_its_times_restored_is_hashed_again(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"a" * 4096)
    cache, said = tmp_path / "work" / DIGEST_CACHE, []
    first = file_digests([weights], cache, said.append, lambda: None)
    assert len(said) == 1 and "hashing 1 model file(s)" in said[0]
    assert file_digests([weights], cache, said.append, lambda: None) == first and len(said) == 1  # from the cache
    times = weights.stat()
    # The kernel stamps change times from a coarse clock (a few ms): wait for a later tick, as in life.
    tick, deadline = tmp_path / "tick", time.monotonic() + 10
    tick.touch()
    while tick.stat().st_ctime_ns <= times.st_ctime_ns:
        assert time.monotonic() < deadline, "the change-time clock never ticked"
        time.sleep(0.001)
        tick.touch()
    with weights.open("r+b") as handle:  # the same inode, size and modification time: only the content differs
        handle.write(b"b")
    os.utime(weights, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert weights.stat().st_mtime_ns == times.st_mtime_ns and weights.stat().st_size == times.st_size
    again = file_digests([weights], cache, said.append, lambda: None)
    assert again != first and len(said) == 2


def test_the_model_files_are_its_weights_config_and_code(tmp_path):
    names = ("model-1.safetensors", "model-2.safetensors", "pytorch_model.bin", "config.json", "README.md")
    for name in (*names, "generation_config.json", "tokenizer.json"):
        (tmp_path / name).write_text("x")
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "consolidated.00.pth").write_text("x")
    assert [p.name for p in model_files(tmp_path)] == ["config.json", "model-1.safetensors", "model-2.safetensors"]
    for name in ("model-1.safetensors", "model-2.safetensors"):
        (tmp_path / name).unlink()
    assert [p.name for p in model_files(tmp_path)] == ["config.json", "pytorch_model.bin"]


def job(**sections) -> Config:
    model = {"path": "/models/m", "tokenizer": "bytes", **sections.pop("model", {})}
    train = {"objective": "dpo", "precision": "fp32", **sections.pop("train", {})}
    return Config.model_validate({"model": model, "data": {"train_files": ["x.jsonl"]}, "train": train, **sections})


def test_the_key_changes_with_the_weights_tokenizer_template_and_precision():
    tokenizer = build_byte_tokenizer()
    base = reference_key(reference_parts(job(), tokenizer, "w1", "cpu"))
    assert reference_key(reference_parts(job(), build_byte_tokenizer(), "w1", "cpu")) == base
    grown = build_byte_tokenizer()
    grown.add_tokens(["<extra>"])
    other_template = {"template": "llama3_chat", "train_files": ["x.jsonl"]}
    keys = [
        reference_key(reference_parts(job(), tokenizer, "w2", "cpu")),
        reference_key(reference_parts(job(), grown, "w1", "cpu")),
        reference_key(reference_parts(job(data=other_template), tokenizer, "w1", "cpu")),
        reference_key(reference_parts(job(train={"precision": "bf16"}), tokenizer, "w1", "cpu")),
        reference_key(reference_parts(job(model={"dtype": "bfloat16"}), tokenizer, "w1", "cpu")),
    ]
    assert len({base, *keys}) == 6
    # A fresh model's weights follow from its seed and where it is initialised; a loaded model's do not.
    fresh = {"path": None, "architecture": "llama"}
    assert reference_parts(job(model=fresh), tokenizer, "fresh", "cpu") != reference_parts(
        job(model=fresh), tokenizer, "fresh", "cuda"
    )
    assert reference_parts(job(train={"seed": 1}), tokenizer, "w1", "cpu") == reference_parts(
        job(), tokenizer, "w1", "cpu"
    )


def test_an_altered_table_is_computed_again_and_a_stale_one_is_named(tmp_path):
    parts = {"weights": "a", "model": "m", "tokenizer": "t", "template": "c", "precision": "fp32", "data": "d"}
    values, said, computed = torch.tensor([-1.5, -2.25, -3.0]), [], []

    def compute() -> torch.Tensor:
        computed.append(1)
        return values.clone()

    def table(which: dict) -> torch.Tensor:
        return reference_log_probs(tmp_path, "train", which, 3, compute, True, said.append)

    assert torch.equal(table(parts), values) and len(computed) == 1
    (path,) = (tmp_path / "reference").glob("train-*.safetensors")
    assert torch.equal(table(parts), values) and len(computed) == 1
    assert said[-1] == f"dpo reference: train log-probabilities read from {path}"

    data = bytearray(path.read_bytes())
    data[-4:] = torch.tensor([-0.5]).numpy().tobytes()  # the last value, edited in place
    path.write_bytes(bytes(data))
    assert load_file(path)["log_probs"][-1] == -0.5
    said.clear()
    assert torch.equal(table(parts), values) and len(computed) == 2
    assert said[0] == (
        f"dpo reference: {path} altered since it was written (its values no longer match its checksum); "
        "computing it again"
    )
    assert torch.equal(load_file(path)["log_probs"], values)  # written again

    said.clear()
    table({**parts, "weights": "b", "precision": "bf16"})  # new weights at the same path, and another precision
    assert said[0] == f"dpo reference: {path} was computed for other model files, precision; not used"
    assert said[1].startswith("dpo reference: computing the train log-probabilities") and len(computed) == 3
