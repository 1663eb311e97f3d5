"""Loop invariants on a tiny Llama: token weighting, accumulation, clipping, schedule, determinism."""

from __future__ import annotations

import math

import pytest
import torch

from tuneforge.engines.base import global_grad_norm
from tuneforge.train.loop import steps_per_epoch
from tuneforge.train.schedule import LRSchedule, resolve_warmup

from conftest import accumulate, chat, rows_batch, single_engine, tiny_llama, tokenized


def samples_of_different_lengths(tokenizer, count: int = 8):
    data = tokenized(tokenizer, [chat("q" * (3 + 7 * i), "answer " * (1 + (i * 5) % 11)) for i in range(count)])
    assert len(set(data.lengths.tolist())) == count
    return data


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_batch_of_8_equals_8_micro_batches_of_1(tokenizer):
    data = samples_of_different_lengths(tokenizer)
    pad = tokenizer.pad_token_id

    model = tiny_llama(tokenizer)
    whole = accumulate(single_engine(model), [rows_batch(data, list(range(8)), pad)], "fp32")
    grads_whole = gradients(model)

    model = tiny_llama(tokenizer)
    split = accumulate(single_engine(model), [rows_batch(data, [i], pad) for i in range(8)], "fp32")
    grads_split = gradients(model)

    assert split.num_targets == whole.num_targets
    assert split.loss == pytest.approx(whole.loss, abs=1e-5)
    for name, grad in grads_whole.items():
        torch.testing.assert_close(grads_split[name], grad, atol=1e-5, rtol=1e-5, msg=name)


def test_loss_is_the_mean_over_target_tokens_not_a_mean_of_means(tokenizer):
    data = samples_of_different_lengths(tokenizer, 4)
    model = tiny_llama(tokenizer)
    batches = [rows_batch(data, [i], tokenizer.pad_token_id) for i in range(4)]
    result = accumulate(single_engine(model), batches, "fp32")
    per_batch_sums, counts = [], []
    with torch.no_grad():
        for batch in batches:
            logits = model(input_ids=batch.input_ids).logits
            per_batch_sums.append(
                torch.nn.functional.cross_entropy(logits[0], batch.targets[0], ignore_index=-100, reduction="sum")
            )
            counts.append(batch.num_targets)
    token_mean = float(sum(per_batch_sums) / sum(counts))
    mean_of_means = float(sum(s / c for s, c in zip(per_batch_sums, counts, strict=True)) / len(counts))
    assert result.loss == pytest.approx(token_mean, rel=1e-5)
    assert abs(token_mean - mean_of_means) > 1e-3  # the two definitions really differ on this data


def test_clipping_reports_the_norm_before_clipping(tokenizer):
    model = tiny_llama(tokenizer)
    batch = rows_batch(samples_of_different_lengths(tokenizer, 2), [0, 1], tokenizer.pad_token_id)
    accumulate(single_engine(model), [batch], "fp32")
    expected = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
    reported = global_grad_norm(model.parameters(), max_norm=expected / 10)
    assert reported == pytest.approx(expected, rel=1e-5)
    after = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
    assert after == pytest.approx(expected / 10, rel=1e-4)


def test_bf16_autocast_runs_on_cpu_and_stays_close_to_fp32(tokenizer):
    batch = rows_batch(samples_of_different_lengths(tokenizer, 2), [0, 1], tokenizer.pad_token_id)
    fp32 = accumulate(single_engine(tiny_llama(tokenizer)), [batch], "fp32").loss
    bf16 = accumulate(single_engine(tiny_llama(tokenizer)), [batch], "bf16").loss
    assert bf16 == pytest.approx(fp32, rel=2e-2)


def test_cosine_schedule_values():
    schedule = LRSchedule(peak=1e-3, min_lr=1e-4, total_steps=110, warmup_steps=10, kind="cosine")
    assert schedule(1) == pytest.approx(1e-4)
    assert schedule(5) == pytest.approx(5e-4)
    assert schedule(10) == pytest.approx(1e-3)
    assert schedule(60) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # halfway through decay
    assert schedule(35) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert schedule(110) == pytest.approx(1e-4)


def test_linear_and_constant_schedules():
    linear = LRSchedule(peak=2.0, min_lr=0.0, total_steps=20, warmup_steps=0, kind="linear")
    assert [linear(s) for s in (1, 10, 20)] == pytest.approx([1.9, 1.0, 0.0])
    constant = LRSchedule(peak=2.0, min_lr=0.0, total_steps=20, warmup_steps=4, kind="constant")
    assert [constant(s) for s in (1, 4, 5, 20)] == pytest.approx([0.5, 2.0, 2.0, 2.0])


def test_warmup_from_ratio_or_steps():
    assert resolve_warmup(1000, 0.03, None) == 30
    assert resolve_warmup(10, 0.03, None) == 1
    assert resolve_warmup(1000, 0.03, 7) == 7
    assert resolve_warmup(5, 0.0, 50) == 5


def test_last_step_of_an_epoch_takes_the_remainder():
    assert steps_per_epoch(16, 4) == 4
    assert steps_per_epoch(17, 4) == 5


def test_a_whole_step_reads_tensor_values_on_the_host_once(tokenizer, monkeypatch):
    """The CPU form of the CUDA sync test: every way Python reads a tensor's value (`item`, `tolist`, `float`,
    `int`, `bool`, `numpy`) is counted, with where it came from, over two micro-batches of an MoE model with its
    router balance loss and the optimizer step. Only the step's one read of its sums and gradient norm remains;
    transformers' mask preparation (its packed-sequence check, once per forward) is its own."""
    import traceback

    from tuneforge.config.schema import TrainConfig
    from tuneforge.data.batching import collate
    from tuneforge.engines.single import SingleEngine
    from tuneforge.model.moe import find_moe
    from tuneforge.model.quantized_experts import register_experts_implementation
    from tuneforge.model.router_balance import attach_router_balance
    from tuneforge.train.loop import accumulate_gradients
    from tuneforge.train.objectives import build_objective
    from tuneforge.train.optim import build_optimizer

    from conftest import tiny_qwen3_moe

    model = tiny_qwen3_moe(tokenizer)
    model.set_experts_implementation(register_experts_implementation())
    balance, _ = attach_router_balance(find_moe(model), model.config, 0.01)
    engine = SingleEngine(model, lambda m: build_optimizer(m, TrainConfig(precision="fp32")))
    objective = build_objective(engine, "fp32", balance)
    data = tokenized(tokenizer, [chat("a" * 5, "short"), chat("b" * 30, "a longer reply " * 3), chat("c", "mid")])
    batches = [collate(data, [[0, 1]], tokenizer.pad_token_id, packed=True), collate(data, [[2]], 0, packed=True)]
    accumulate_gradients(engine, batches, objective).read(engine.step(1e-4, 1.0))  # warm-up

    reads: list[str] = []
    for method in ("item", "tolist", "__float__", "__int__", "__bool__", "numpy"):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _method=method, **kwargs):
            caller = traceback.extract_stack(limit=2)[0]
            reads.append(f"{_method} at {caller.filename.rsplit('/', 1)[-1]}:{caller.lineno}: {caller.line}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    step = accumulate_gradients(engine, batches, objective)
    norm = engine.step(1e-4, 1.0)
    host_side = (
        "(self.targets != IGNORE_INDEX).sum()",  # the batch's own counts: collated on the host, never on a GPU
        "self.attention_mask.sum()",
        "float(token_mask.sum())",  # the router balance's token count, from the same host batch
        "bool(tiny.any())",  # the fused loss's CPU-only path (probabilities written over the logits)
    )
    during = [read for read in reads if "masking_utils.py" not in read and not any(h in read for h in host_side)]
    masks = sum("masking_utils.py" in read for read in reads)
    (loss,) = step.read(norm)
    monkeypatch.undo()
    assert during == [] and masks <= len(batches), reads
    assert loss > 0 and step.router_aux_loss is not None


def test_a_steps_sums_are_read_back_by_name():
    from tuneforge.train.loop import COUNTS, FIGURES, AccumulatedStep, SumsLayout, read_together

    layout = SumsLayout(("rewards/margin", "rewards/accuracy"), signals=2)
    assert layout.size == len(FIGURES) + 2 + len(COUNTS) + 2
    values = [0.5, 0.25, 3.0, 2.0, 40, 50, 64, 1.5, 0, 1]  # loss, router, metrics, counts, votes
    steps = [AccumulatedStep(torch.tensor(values, dtype=torch.float64), layout, True, 4) for _ in range(2)]
    assert read_together(steps, [torch.tensor(2.5), 3.5]) == [2.5, 3.5]
    step = steps[1]
    assert (step.loss, step.router_aux_loss, step.num_targets, step.num_tokens, step.num_slots) == (
        0.5,
        0.25,
        40,
        50,
        64,
    )
    assert step.metrics == {"rewards/margin": 0.75, "rewards/accuracy": 0.5}  # means over the step's 4 units
    assert step.step_seconds == 1.5 and step.stop_votes == (0, 1)
