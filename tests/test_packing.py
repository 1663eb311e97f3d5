"""Packed rows give every sample exactly the logits and loss it has alone, on SDPA, per-sample SDPA and eager."""

from __future__ import annotations

import pytest
import torch

from tuneforge.data.batching import collate
from tuneforge.model import packed_attention
from tuneforge.model.attention import model_inputs

from conftest import accumulate, chat, rows_batch, single_engine, tiny_deepseek_v2, tiny_llama, tiny_mistral, tokenized

RECORDS = [chat("a" * 5, "short"), chat("b" * 30, "a longer reply " * 3), chat("c" * 12, "mid reply")]


def build(kind: str, tokenizer, implementation: str):
    packed_attention.register()
    if kind == "llama":
        model = tiny_llama(tokenizer, seed=1)
        model.config._attn_implementation = implementation
        return model
    return tiny_deepseek_v2(tokenizer, seed=1, attn_implementation=implementation)


def logits_of(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**model_inputs(model, batch, torch.device("cpu")), use_cache=False).logits


@pytest.mark.parametrize("kind", ["llama", "deepseek_v2"])
@pytest.mark.parametrize("implementation", ["sdpa", "eager", packed_attention.NAME])
def test_packed_row_equals_unpacked_samples(tokenizer, kind, implementation):
    data = tokenized(tokenizer, RECORDS)
    model = build(kind, tokenizer, implementation).eval()
    pad = tokenizer.pad_token_id
    packed = collate(data, [[0, 1, 2]], pad, packed=True)
    packed_logits = logits_of(model, packed)[0]
    cursor = 0
    for index in range(3):
        alone = logits_of(model, rows_batch(data, [index], pad))[0]
        n = alone.shape[0]
        torch.testing.assert_close(packed_logits[cursor : cursor + n], alone, atol=1e-5, rtol=1e-5)
        cursor += n

    loss_packed = accumulate(single_engine(build(kind, tokenizer, implementation)), [packed], "fp32")
    loss_unpacked = accumulate(
        single_engine(build(kind, tokenizer, implementation)), [rows_batch(data, [0, 1, 2], pad)], "fp32"
    )
    assert loss_packed.num_targets == loss_unpacked.num_targets
    assert loss_packed.loss == pytest.approx(loss_unpacked.loss, abs=1e-5)


def test_position_ids_alone_do_not_isolate_samples_on_sdpa(tokenizer):
    """Why the explicit mask exists: transformers infers sample boundaries from position ids only when no cache
    is built, and with the config's default `use_cache=True` one is, so the second sample sees the first."""
    data = tokenized(tokenizer, RECORDS)
    model = build("llama", tokenizer, "sdpa").eval()
    packed = collate(data, [[0, 1]], tokenizer.pad_token_id, packed=True)
    with torch.no_grad():
        leaky = model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits[0]
    alone = logits_of(model, rows_batch(data, [1], tokenizer.pad_token_id))[0]
    first = int(data.lengths[0])
    assert (leaky[first : first + alone.shape[0]] - alone).abs().max() > 1e-3


@pytest.mark.parametrize("implementation", ["sdpa", packed_attention.NAME])
def test_packed_rows_with_padding_stay_finite(tokenizer, implementation):
    data = tokenized(tokenizer, RECORDS)
    model = build("llama", tokenizer, implementation)
    batch = collate(data, [[0, 2], [1]], tokenizer.pad_token_id, packed=True)
    assert batch.attention_mask.sum() < batch.attention_mask.numel()  # the second row is padded
    result = accumulate(single_engine(model), [batch], "fp32")
    assert torch.isfinite(torch.tensor(result.loss))
    # The step counts what it computed, padding included: metrics.jsonl's `padding` is 1 - tokens / slots.
    assert result.num_slots == batch.input_ids.numel() and result.num_tokens == int(batch.attention_mask.sum())
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_padding_is_one_span_for_position_based_splitting(tokenizer):
    """Per-sample attention and flash varlen split rows where positions restart: padding must be one stretch."""
    data = tokenized(tokenizer, RECORDS)
    batch = collate(data, [[0, 2], [1]], tokenizer.pad_token_id, packed=True)
    lengths = [int(n) for n in data.lengths]
    width = batch.input_ids.size(1)
    spans = packed_attention.sample_spans(batch.position_ids)
    assert spans[0] == [(0, lengths[0]), (lengths[0], lengths[0] + lengths[2]), (lengths[0] + lengths[2], width)]
    assert spans[1] == [(0, lengths[1])]


@pytest.mark.parametrize("kv_heads,value_dim", [(4, 16), (2, 24)])
def test_gathered_sample_batches_equal_the_block_diagonal_mask(kv_heads, value_dim):
    """Many samples of mixed lengths, grouped into padded batches across rows: outputs and all three
    gradients equal one masked SDPA over the rows, with grouped keys and a value width of its own."""
    torch.manual_seed(0)
    lengths = [[7, 30, 1, 12, 14], [33, 25, 6], [72]]
    width = 72
    position_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), 1, width, width, dtype=torch.bool)
    for row, row_lengths in enumerate(lengths):
        start = 0
        for n in [*row_lengths, width - sum(row_lengths)]:  # the last run is padding, possibly empty
            position_ids[row, start : start + n] = torch.arange(n)
            mask[row, 0, start : start + n, start : start + n] = torch.ones(n, n, dtype=torch.bool).tril()
            start += n
    plan = packed_attention.plan_gather(position_ids)
    assert 1 < len(plan.batches) < 10  # grouped by length: fewer calls than samples
    assert plan.inverse.unique().numel() == position_ids.numel()  # every token has its own output slot

    shapes = [(3, 4, width, 16), (3, kv_heads, width, 16), (3, kv_heads, width, value_dim)]
    inputs = [torch.randn(shape, requires_grad=True) for shape in shapes]
    module = torch.nn.Module()
    module.is_causal, module.training = True, True
    ours, _ = packed_attention.packed_sdpa_forward(module, *inputs, None, position_ids=position_ids)
    groups = 4 // kv_heads
    q, k, v = inputs
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask
    ).transpose(1, 2)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    weights = torch.randn_like(expected)
    ours_grads = torch.autograd.grad((ours * weights).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * weights).sum(), inputs)
    for mine, theirs in zip(ours_grads, expected_grads, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_sliding_window_is_kept_within_each_packed_sample(tokenizer):
    """Mistral-style sliding window (query - key < window): a packed row gives every sample exactly the
    logits it has alone under `transformers`' own SDPA, for samples longer and shorter than the window."""
    packed_attention.register()
    model = tiny_mistral(tokenizer, sliding_window=50).eval()
    data = tokenized(tokenizer, RECORDS)
    assert min(data.lengths) < 50 < max(data.lengths)
    model.config._attn_implementation = packed_attention.NAME
    packed_logits = logits_of(model, collate(data, [[0, 1, 2]], tokenizer.pad_token_id, packed=True))[0]
    model.config._attn_implementation = "sdpa"
    cursor, alone = 0, []
    for index in range(3):
        alone.append(logits_of(model, rows_batch(data, [index], tokenizer.pad_token_id))[0])
        n = alone[-1].shape[0]
        torch.testing.assert_close(packed_logits[cursor : cursor + n], alone[-1], atol=1e-5, rtol=1e-5)
        cursor += n
    # The window matters for the long sample: without it, its logits differ (so the test can tell).
    model.config.sliding_window = None
    unwindowed = logits_of(model, rows_batch(data, [1], tokenizer.pad_token_id))[0]
    assert (unwindowed - alone[1]).abs().max() > 1e-4


def test_packed_rows_take_the_gathered_path_with_no_mask_and_unpacked_rows_keep_theirs(tokenizer, monkeypatch):
    """Packed rows reach the attention with no batch x L x L mask and are split by positions; unpacked rows
    carry their padding mask to the library's SDPA (one call, nothing to split)."""
    data = tokenized(tokenizer, RECORDS)
    model = build("llama", tokenizer, packed_attention.NAME).eval()
    plans, masks = [], []
    real_plan, real_forward = packed_attention.plan_gather, packed_attention.packed_sdpa_forward

    def spy_forward(module, query, key, value, attention_mask, *args, **kwargs):
        masks.append(attention_mask)
        return real_forward(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setattr(packed_attention, "plan_gather", lambda ids, **kw: plans.append(ids) or real_plan(ids, **kw))
    from transformers import AttentionInterface

    AttentionInterface.register(packed_attention.NAME, spy_forward)
    try:
        logits_of(model, collate(data, [[0, 1, 2]], tokenizer.pad_token_id, packed=True))
        assert len(plans) == 1 and masks and all(mask is None for mask in masks)  # planned once per forward
        plans.clear(), masks.clear()
        logits_of(model, rows_batch(data, [0, 1], tokenizer.pad_token_id))
        assert not plans and masks and all(mask is not None for mask in masks)
    finally:
        packed_attention.register()
