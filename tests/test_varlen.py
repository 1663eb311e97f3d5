"""The CUDA attention path for packed rows, checked on CPU: the cumulative lengths computed before the forward,
the call into a variable-length kernel (here a reference of its documented contract; tests/gpu/ runs PyTorch's
own on a GPU) equal to the gathered SDPA, the choice between them, and lengths rounded for repeating shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tuneforge.data.batching import collate
from tuneforge.model import packed_attention
from tuneforge.model.packed_attention import (
    cumulative_lengths,
    gathered_sdpa,
    plan_gather,
    sample_spans,
    varlen_forward,
    varlen_unsupported,
)

from conftest import chat, tiny_llama, tokenized

LENGTHS = [[7, 30, 1, 12, 14], [33, 25, 6], [72]]
WIDTH = 72


def packed_positions() -> torch.Tensor:
    position_ids = torch.zeros(len(LENGTHS), WIDTH, dtype=torch.long)
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for n in [*lengths, WIDTH - sum(lengths)]:  # the last run is padding, possibly empty
            position_ids[row, start : start + n] = torch.arange(n)
            start += n
    return position_ids


def reference_varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn's contract, one segment at a time: (tokens, heads, dim) in and
    out; window_size (left, 0) lets query i see keys i - left .. i (left -1: all earlier keys)."""
    assert torch.equal(cu_q, cu_k) and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    assert cu_q.dtype == torch.int32 and window_size[1] == 0
    outputs = []
    for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
        n = end - start
        distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        allowed = (distance >= 0) & ((distance <= window_size[0]) if window_size[0] >= 0 else True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=enable_gqa)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)


def test_cumulative_lengths_bound_every_sample_and_padding_run_of_a_collated_batch(tokenizer):
    records = [chat("a" * 5, "short"), chat("b" * 30, "a longer reply " * 3), chat("c" * 12, "mid reply")]
    batch = collate(tokenized(tokenizer, records), [[0, 2], [1]], tokenizer.pad_token_id, packed=True)
    bounds, longest = cumulative_lengths(batch.position_ids)
    width = batch.position_ids.size(1)
    expected = [row * width + start for row, runs in enumerate(sample_spans(batch.position_ids)) for start, _ in runs]
    assert bounds.dtype == torch.int32 and bounds.tolist() == [*expected, batch.position_ids.numel()]
    assert longest == int((bounds[1:] - bounds[:-1]).max()) and len(expected) == 4  # 3 samples, 1 padding run


@pytest.mark.parametrize(
    ("kv_heads", "width", "value_width", "window"),
    [(4, 16, 16, None), (2, 16, 16, None), (4, 24, 16, None), (2, 16, 16, 10)],
    ids=["mha", "gqa", "mla-widths", "sliding-window"],
)
def test_the_varlen_call_equals_the_gathered_sdpa_forward_and_backward(kv_heads, width, value_width, window):
    torch.manual_seed(0)
    position_ids = packed_positions()
    shapes = [(3, 4, WIDTH, width), (3, kv_heads, WIDTH, width), (3, kv_heads, WIDTH, value_width)]
    inputs = [torch.randn(shape, requires_grad=True) for shape in shapes]
    bounds, longest = cumulative_lengths(position_ids)
    ours = varlen_forward(*inputs, bounds, longest, 0.3, window, kernel=reference_varlen_attn)
    expected = gathered_sdpa(*inputs, plan_gather(position_ids), 0.0, 0.3, window)
    assert ours.shape == expected.shape == (3, WIDTH, 4, value_width)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    weights = torch.randn_like(expected)
    for mine, theirs in zip(
        torch.autograd.grad((ours * weights).sum(), inputs),
        torch.autograd.grad((expected * weights).sum(), inputs),
        strict=True,
    ):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_a_varlen_kernel_without_gqa_is_given_repeated_key_value_heads(monkeypatch):
    """PyTorch 2.11's varlen_attn takes no enable_gqa: the key/value heads are repeated to the query's count,
    with the same output and gradients as a kernel that groups them itself."""

    def kernel_of_torch_2_11(query, key, value, cu_q, cu_k, max_q, max_k, *, scale, window_size):
        assert key.size(1) == value.size(1) == query.size(1)
        return reference_varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)

    monkeypatch.setattr(packed_attention, "_varlen_attn", kernel_of_torch_2_11)
    monkeypatch.setattr(packed_attention, "VARLEN_TAKES_GQA", False)
    torch.manual_seed(0)
    position_ids = packed_positions()
    shapes = [(3, 4, WIDTH, 16), (3, 2, WIDTH, 16), (3, 2, WIDTH, 16)]
    inputs = [torch.randn(shape, requires_grad=True) for shape in shapes]
    bounds, longest = cumulative_lengths(position_ids)
    repeated = varlen_forward(*inputs, bounds, longest, None, None)
    grouped = varlen_forward(*inputs, bounds, longest, None, None, kernel=reference_varlen_attn)
    torch.testing.assert_close(repeated, grouped, atol=1e-6, rtol=1e-6)
    weights = torch.randn_like(grouped)
    for mine, theirs in zip(
        torch.autograd.grad((repeated * weights).sum(), inputs),
        torch.autograd.grad((grouped * weights).sum(), inputs),
        strict=True,
    ):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6)


def test_batch_lengths_rounded_up_for_repeating_shapes_give_the_same_attention():
    torch.manual_seed(0)
    position_ids = packed_positions()
    inputs = [torch.randn(3, 4, WIDTH, 16) for _ in range(3)]
    rounded = plan_gather(position_ids, multiple=16)
    assert all(padded % 16 == 0 for _, padded in rounded.batches)
    torch.testing.assert_close(
        gathered_sdpa(*inputs, rounded, 0.0, None, None),
        gathered_sdpa(*inputs, plan_gather(position_ids), 0.0, None, None),
        atol=1e-6,
        rtol=1e-6,
    )


def test_the_varlen_kernel_is_chosen_only_where_it_applies():
    def states(dtype, heads=4, width=128):
        return torch.zeros(1, heads, 8, width, dtype=dtype)

    bf16 = torch.bfloat16
    assert varlen_unsupported(states(bf16), states(bf16), states(bf16), 0.0) == "not on CUDA"
    on_gpu = {"device_type": "cuda"}
    if packed_attention._varlen_attn is None:
        pytest.skip("this PyTorch has no varlen attention")
    assert varlen_unsupported(states(bf16), states(bf16, 2), states(bf16, 2), 0.0, **on_gpu) is None
    mla = varlen_unsupported(states(bf16, width=192), states(bf16, width=192), states(bf16), 0.0, **on_gpu)
    assert mla is None  # DeepSeek-V2's q/k 192 and v 128: values padded
    fp32 = torch.float32
    assert varlen_unsupported(states(fp32), states(fp32), states(fp32), 0.0, **on_gpu).startswith("float32")
    assert varlen_unsupported(states(bf16), states(bf16), states(bf16), 0.1, **on_gpu) == "attention dropout"
    wide = states(bf16, width=320)
    assert varlen_unsupported(wide, wide, wide, 0.0, **on_gpu) == "head dims q 320, k 320, v 320"


def test_cpu_inputs_carry_no_varlen_plan(tokenizer):
    from tuneforge.model.attention import model_inputs

    model = tiny_llama(tokenizer)
    model.config._attn_implementation = packed_attention.register()
    records = [chat("a" * 5, "short"), chat("c" * 12, "mid reply")]
    batch = collate(tokenized(tokenizer, records), [[0, 1]], tokenizer.pad_token_id, packed=True)
    inputs = model_inputs(model, batch, torch.device("cpu"))
    assert set(inputs) == {"input_ids", "position_ids"}  # the CPU keeps its gathered SDPA, planned in the forward


def test_the_gathered_sdpa_plans_from_the_host_copy_of_the_positions_when_given():
    """On CUDA the fallback gets the CPU copy of the positions, so that planning reads nothing from the GPU.
    Here the device tensor is wrong on purpose (one sample per row): the result is right only if the plan
    came from the host copy."""
    torch.manual_seed(0)
    position_ids = packed_positions()
    inputs = [torch.randn(3, 4, WIDTH, 16) for _ in range(3)]
    expected = gathered_sdpa(*inputs, plan_gather(position_ids), 0.0, None, None)
    misleading = torch.arange(WIDTH).expand(3, -1).clone()
    from_host = packed_attention.samples_attention(*inputs, misleading, None, 0, 0.0, None, None, position_ids)
    torch.testing.assert_close(from_host, expected, atol=1e-6, rtol=1e-6)
    from_device = packed_attention.samples_attention(*inputs, misleading, None, 0, 0.0, None, None)
    assert not torch.allclose(from_device, expected)
