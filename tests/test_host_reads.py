"""The loop's host reads, counted through whole runs of every objective: a step that prints no line, saves, validates,
samples nor checks for a stop reads nothing of the device (the GPU never waits for the host between steps); the
steps that do read take every unread step's figures in one transfer, and metrics.jsonl still has a row per step."""

from __future__ import annotations

import traceback

import pytest
import torch

from tuneforge.train.loop import Trainer

from conftest import TINY_LLAMA, chat, metrics, train_here, write_jsonl

LORA = TINY_LLAMA.replace("tokenizer: bytes,", "tokenizer: bytes, lora: {r: 4, alpha: 8, dropout: 0.0},")
JOB = """data: {{train_files: [train.jsonl], cache_dir: null}}
train: {{objective: {objective}, lr: 1.0e-3, micro_batch_size: 2, gradient_accumulation: 2, max_steps: 6,
  precision: fp32}}
checkpoint: {{every_steps: 0, save_final: false}}
watchdog: {{stop_grace_s: 100000}}
log: {{every_steps: 5, progress: lines, plot: false}}
"""
OBJECTIVES = {
    "sft": (LORA, "sft", []),
    "dpo-adapters": (LORA, "dpo", ["preference.reference=adapters"]),
    "dpo-precompute": (LORA, "dpo", ["preference.reference=precompute"]),
    "dpo-model": (TINY_LLAMA, "dpo", ["preference.reference=model"]),
    "orpo": (LORA, "orpo", []),
    "reward": (LORA, "reward", []),
}
READ_STEPS = {1, 2, 5, 6}
"""The first step, the next (the ranks' pace is not known before it), the step that prints a line, the last."""
HOST_SIDE = (
    "(self.targets != IGNORE_INDEX).sum()",  # the batch's own counts: collated on the host, never on a GPU
    "self.attention_mask.sum()",
    "bool(tiny.any())",  # the fused loss's CPU-only path (probabilities written over the logits)
    "row.nonzero().flatten().tolist()",  # packed attention's spans, from the host copy of the position ids
    "int(lengths[0])",  # its gather plan, from a tensor of those spans' Python lengths
    "int(per_row.sum())",  # preference objectives' answers per row, from the CPU copy of the batch
)
"""Reads of tensors that are on the host wherever training runs."""


def pair(i: int) -> dict:
    return {
        "prompt": [{"role": "user", "content": f"Convert #{i:06x}."}],
        "chosen": [{"role": "assistant", "content": f"({i}, {i % 7}, {i % 5})"}],
        "rejected": [{"role": "assistant", "content": f"({i + 3}, {i % 7}, 9{i})"}],
    }


def write_job(directory, name: str) -> list[str]:
    """`cfg.yaml` and `train.jsonl` in `directory` for objective `name`; returns the run's overrides."""
    model, objective, extra = OBJECTIVES[name]
    rows = [chat(f"q {i}", f"answer {i * 7}") if objective == "sft" else pair(i) for i in range(24)]
    write_jsonl(directory / "train.jsonl", rows)
    (directory / "cfg.yaml").write_text(model + JOB.format(objective=objective))
    return extra


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_a_step_that_logs_nothing_reads_nothing_from_the_device(tmp_path, monkeypatch, name):
    extra = write_job(tmp_path, name)

    reads: dict[int, list[str]] = {}
    counting: list[int] = []  # the step whose work is running, while the loop runs one

    def counted_during(method_name: str):
        original = getattr(Trainer, method_name)

        def wrapper(self, *args, **kwargs):
            counting.append(args[0] if method_name == "train_step" else self.pending[-1].step)
            try:
                return original(self, *args, **kwargs)
            finally:
                counting.pop()

        monkeypatch.setattr(Trainer, method_name, wrapper)

    counted_during("train_step")
    counted_during("read_pending")
    for method in ("item", "tolist", "__float__", "__int__", "__bool__", "numpy"):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _method=method, **kwargs):
            if counting:
                caller = traceback.extract_stack(limit=2)[0]
                site = f"{_method} at {caller.filename.rsplit('/', 1)[-1]}:{caller.lineno}: {caller.line}"
                if "masking_utils.py" not in site and not any(h in site for h in HOST_SIDE):
                    reads.setdefault(counting[-1], []).append(site)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)

    result = train_here(tmp_path / "cfg.yaml", tmp_path / "run", *extra)
    monkeypatch.undo()
    assert result.returncode == 0, result.stderr[-3000:]
    assert {step: sites for step, sites in reads.items() if step not in READ_STEPS} == {}, reads
    # Each read step: one transfer of every unread step's sums and gradient norm.
    assert {step: len(sites) for step, sites in reads.items()} == dict.fromkeys(READ_STEPS, 1), reads
    assert all("_read_all" in sites[0] or "torch.cat(parts).tolist()" in sites[0] for sites in reads.values())
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in records)
    assert [line.split()[1] for line in result.stdout.splitlines() if line.startswith("step ") and "loss" in line] == [
        "1/6",
        "5/6",
        "6/6",
    ]
