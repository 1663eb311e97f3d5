"""SDPA over the samples of packed rows, registered with `transformers`' attention interface.

A packed row of 1,024 tokens holding three samples needs three causal triangles of about 340 tokens; a
block-diagonal mask over the row makes SDPA compute the whole 1,024 x 1,024 square and mask most of it
away (on GPUs it also rules out the flash kernel, on CPU the causal fast path). Here the samples of the
whole batch, found where the position ids restart, are sorted by length and gathered into a few
right-padded batches of similar lengths, each one causal SDPA call. Exact: a causal query never sees the
padding after its own sample, padded queries are dropped, and the block-diagonal mask allowed nothing
more. Batched calls matter on CPU: one call per sample (batch of one) ran no faster than the masked
kernel, the gathered batches twice as fast (one layer, 8 rows of three ~340-token samples, forward and
backward: 0.14 s against 0.29 s masked and 0.30 s per sample).

Calls that are not whole sequences (generation with a cache, a single query) or that come with a padding
mask (unpacked rows: one sample each, nothing to split) go to the library's own SDPA unchanged. This is the
documented extension point (`AttentionInterface.register`), not a change to any model's code.

On CUDA the packed rows go to PyTorch's variable-length flash kernel (`torch.nn.attention.varlen`) instead:
one call over all samples, with the cumulative lengths computed from the CPU copy of the position ids before
the forward (`cumulative_lengths`, passed in as `cu_seq_lens_q`), so that nothing waits on the GPU. MLA's
narrower values (DeepSeek-V2: q/k 192, v 128) are padded with zero columns and the output sliced. Where the
kernel does not apply (fp32, dropout, head dims above 256) the gathered SDPA above runs with its batch
lengths rounded up to a multiple of 128, so that shapes repeat, planned from the same CPU copy of the
positions (the `host_position_ids` keyword), and every SDPA call on CUDA names its
backends: flash or memory-efficient, never cuDNN, which builds a new plan for every new shape (95% of a
step's time on an H200 with packed rows).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tuneforge.model.sequence_parallel import SequenceShard
from tuneforge.model.transfer import to_device

try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # PyTorch before 2.10
    _varlen_attn = None

# PyTorch 2.11's varlen_attn has no `enable_gqa` (2.13's has): there the key and value heads are repeated to the
# query's count before the call, which the kernel's backward sums back per key/value head.
VARLEN_TAKES_GQA = _varlen_attn is not None and "enable_gqa" in inspect.signature(_varlen_attn).parameters

NAME = "tuneforge_sdpa"
"""Registered name; the model config still says `sdpa` to the user (`model.attn_implementation`)."""

CUDA_LENGTH_MULTIPLE = 128
"""On CUDA the gathered batches' padded lengths are rounded up to this: a few shapes that repeat, not one new
shape per call (kernels and allocator blocks are then reused)."""

CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The SDPA backends allowed on CUDA, in order of preference: cuDNN is left out (see above)."""

BUCKET_RATIO = 0.8
"""A sample joins a batch while its length is at least this fraction of the batch's longest: padded work
stays under 1/0.8^2 = 1.56x of the exact triangles, and a typical batch of 8 rows needs a handful of calls."""


def sample_spans(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) of each run of consecutive positions: a sample, or a stretch of padding.
    Position 0 always starts a sample, so padding numbered -1 before it stays out of it."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = (position_ids[:, 1:] != position_ids[:, :-1] + 1) | (position_ids[:, 1:] == 0)
    length = position_ids.size(1)
    spans = []
    for row in starts.cpu():
        begin = row.nonzero().flatten().tolist()
        spans.append(list(zip(begin, [*begin[1:], length], strict=True)))
    return spans


@dataclass(frozen=True)
class GatherPlan:
    """Where the padded batches take their tokens from, and where every token's output lies afterwards."""

    batches: list[tuple[int, int]]
    """(samples, padded length) per SDPA call, in the order of `index`."""
    index: torch.Tensor
    """Flat token index of every slot of every batch, concatenated (padded slots repeat a real token)."""
    inverse: torch.Tensor
    """For each token of the flattened rows, its slot: the position of its one real copy in `index`."""


def cumulative_lengths(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cumulative lengths as int32, longest length) of the samples of the flattened rows, padding stretches
    counted as samples of their own: the plan a variable-length kernel takes. Meant for the CPU copy of the
    position ids, so that the GPU is never waited on for it."""
    length = position_ids.size(1)
    starts = [row * length + start for row, runs in enumerate(sample_spans(position_ids)) for start, _ in runs]
    bounds = torch.tensor([*starts, position_ids.numel()], dtype=torch.int32)
    return bounds, int((bounds[1:] - bounds[:-1]).max())


def plan_gather(position_ids: torch.Tensor, ratio: float = BUCKET_RATIO, multiple: int = 1) -> GatherPlan:
    """Group the batch's samples by length into right-padded batches, each padded to a multiple of
    `multiple`; indices live on `position_ids`' device."""
    length = position_ids.size(1)
    spans = sample_spans(position_ids)
    # (length, flat start) of every sample, longest first.
    samples = sorted(((end - start, row * length + start) for row, runs in enumerate(spans) for start, end in runs))
    samples.reverse()
    groups: list[list[tuple[int, int]]] = []
    for sample in samples:
        if not groups or sample[0] < groups[-1][0][0] * ratio:
            groups.append([])
        groups[-1].append(sample)
    batches, index_parts, inverse_parts, token_parts, slot = [], [], [], [], 0
    for group in groups:
        lengths = torch.tensor([n for n, _ in group])
        starts = torch.tensor([s for _, s in group])
        padded = -(-int(lengths[0]) // multiple) * multiple
        offsets = torch.arange(padded)
        # Padded slots repeat the sample's last token: finite inputs whose outputs are dropped.
        index = starts[:, None] + torch.minimum(offsets[None, :], lengths[:, None] - 1)
        real = offsets[None, :] < lengths[:, None]
        token_parts.append(index[real])
        inverse_parts.append(slot + real.flatten().nonzero().flatten())
        batches.append((len(group), padded))
        index_parts.append(index.flatten())
        slot += len(group) * padded
    inverse = torch.empty(position_ids.numel(), dtype=torch.long)
    inverse[torch.cat(token_parts)] = torch.cat(inverse_parts)
    return GatherPlan(batches, torch.cat(index_parts).to(position_ids.device), inverse.to(position_ids.device))


class _GatherSlots(torch.autograd.Function):
    """tokens -> slots (`index`), whose backward reads each token's gradient from its one real slot
    (`inverse`). Exact because padded slots get no gradient: their queries' outputs are dropped and, being
    after every real token of their sample, their keys and values are seen by no real query. Autograd's
    own index_select backward would zero-fill a tokens-sized tensor and scatter-add into it instead."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(inverse)
        return tokens.index_select(0, index)

    @staticmethod
    def backward(ctx, grad_slots: torch.Tensor):  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        return grad_slots.index_select(0, inverse), None, None


class _ScatterTokens(torch.autograd.Function):
    """slots -> tokens (`inverse`), whose backward writes each token's gradient into its real slot and
    zeros into padded slots (one fill and one copy, no scatter-add)."""

    @staticmethod
    def forward(ctx, slots: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(inverse)
        ctx.slot_count = slots.size(0)
        return slots.index_select(0, inverse)

    @staticmethod
    def backward(ctx, grad_tokens: torch.Tensor):  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        grad_slots = grad_tokens.new_zeros((ctx.slot_count, *grad_tokens.shape[1:]))
        return grad_slots.index_copy_(0, inverse, grad_tokens), None


_last_plan: tuple[torch.Tensor, int, GatherPlan] | None = None


def _plan_for(position_ids: torch.Tensor, batch: int, host_position_ids: torch.Tensor | None = None) -> GatherPlan:
    """Every layer of one forward gets the same `position_ids` tensor: plan once, not once per layer. The
    cache holds the tensor itself (so its identity cannot be reused) and its version (no in-place edits).
    With `host_position_ids`, their CPU copy, the plan is made from it and its indices moved to the device
    without blocking: nothing waits on the GPU's queue."""
    global _last_plan
    source = host_position_ids if host_position_ids is not None else position_ids
    cached = _last_plan
    if cached is not None and cached[0] is source and cached[1] == source._version:
        return cached[2]
    device = position_ids.device
    # Positions shared by all rows (batch 1 in the model's own default) are expanded for planning only.
    multiple = CUDA_LENGTH_MULTIPLE if device.type == "cuda" else 1
    plan = plan_gather(source.expand(batch, -1), multiple=multiple)
    if plan.index.device != device:
        plan = GatherPlan(plan.batches, to_device(plan.index, device), to_device(plan.inverse, device))
    _last_plan = (source, source._version, plan)
    return plan


def _band_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """Causal attention over the last `window` keys (transformers' sliding window: query - key < window)."""
    offsets = torch.arange(length, device=device)
    distance = offsets[:, None] - offsets[None, :]
    return (distance >= 0) & (distance < window)


def _flat_tokens(states: torch.Tensor) -> torch.Tensor:
    """(batch, heads, length, dim) -> (batch x length, heads, dim)."""
    batch, heads, length, dim = states.shape
    return states.transpose(1, 2).reshape(batch * length, heads, dim)


def sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """Name the SDPA backends on CUDA (never cuDNN); leave the CPU's choice alone."""
    return sdpa_kernel(CUDA_SDPA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


def varlen_unsupported(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float, device_type: str | None = None
) -> str | None:
    """Why the variable-length flash kernel cannot take this call; None when it can."""
    if (device_type or query.device.type) != "cuda":
        return "not on CUDA"
    if _varlen_attn is None:
        return "this PyTorch has no torch.nn.attention.varlen (2.10 or later)"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"{str(query.dtype).removeprefix('torch.')} (the flash kernel takes float16 or bfloat16)"
    if dropout > 0:
        return "attention dropout"
    width = query.size(-1)
    if width > 256 or width % 8 or key.size(-1) != width or value.size(-1) > width:
        return f"head dims q {width}, k {key.size(-1)}, v {value.size(-1)}"
    return None


VarlenKernel = Callable[..., torch.Tensor]


def varlen_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_lengths: torch.Tensor,
    longest: int,
    scaling: float | None,
    window: int | None,
    kernel: VarlenKernel | None = None,
) -> torch.Tensor:
    """Causal attention within each sample of the flattened rows, in one variable-length call: (batch, heads,
    length, dim) in, (batch, length, heads, value dim) out. `kernel` defaults to PyTorch's varlen_attn."""
    batch, heads, length, width = query.shape
    value_width = value.size(-1)
    q, k, v = (_flat_tokens(states) for states in (query, key, value))
    if value_width < width:  # zero columns add nothing to the output, and are sliced off after
        v = F.pad(v, (0, width - value_width))
    gqa = {}
    if heads != key.size(1):
        if kernel is not None or VARLEN_TAKES_GQA:
            gqa = {"enable_gqa": True}
        else:
            k, v = (t.repeat_interleave(heads // key.size(1), dim=1) for t in (k, v))
    out = (kernel or _varlen_attn)(
        q,
        k,
        v,
        cu_lengths,
        cu_lengths,
        longest,
        longest,
        scale=scaling,
        # (left, right) keys around each query: (-1, 0) causal; transformers' window W sees W - 1 keys back.
        window_size=(-1 if window is None else window - 1, 0),
        **gqa,
    )
    return out[..., :value_width].reshape(batch, length, heads, value_width)


@functools.cache
def varlen_verified(device: torch.device, dtype: torch.dtype, width: int, value_width: int, gqa: bool) -> bool:
    """One small comparison with the gathered SDPA per kind of call, before the kernel is trusted: a PyTorch
    build whose kernel misbehaves falls back to SDPA with a warning rather than training on wrong attention."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads = 4, 2 if gqa else 4
    position_ids = torch.cat([torch.arange(37), torch.arange(91)])[None, :]

    def states(count: int, dim: int) -> torch.Tensor:
        return torch.randn(1, count, 128, dim, generator=generator).to(device, dtype)

    query, key, value = states(heads, width), states(kv_heads, width), states(kv_heads, value_width)
    try:
        cu_lengths, longest = cumulative_lengths(position_ids)
        got = varlen_forward(query, key, value, cu_lengths.to(device), longest, None, None)
        expected = gathered_sdpa(query, key, value, plan_gather(position_ids.to(device)), 0.0, None, None)
        error = float((got.float() - expected.float()).abs().max())
    except Exception as exc:  # any failure of the kernel on this build: fall back, say why
        warnings.warn(f"varlen attention unavailable ({type(exc).__name__}: {exc}); packed rows use SDPA", stacklevel=2)
        return False
    if error > 2e-2:
        warnings.warn(f"varlen attention differs from SDPA by {error:.3g} here; packed rows use SDPA", stacklevel=2)
        return False
    return True


def gathered_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: GatherPlan,
    dropout: float,
    scaling: float | None,
    window: int | None,
) -> torch.Tensor:
    """The samples gathered by `plan` into a few causal SDPA calls: (batch, heads, length, dim) in, (batch,
    length, heads, value dim) out."""
    batch, heads, length, _ = query.shape
    # One gather per tensor for all calls, split into per-call views (split's backward is a single cat).
    sizes = [samples * padded for samples, padded in plan.batches]
    split = [
        _GatherSlots.apply(_flat_tokens(states), plan.index, plan.inverse).split(sizes)
        for states in (query, key, value)
    ]
    outputs = []
    with sdpa_backends(query.device):
        for (samples, padded), *parts in zip(plan.batches, *split, strict=True):
            q, k, v = (part.view(samples, padded, *part.shape[1:]).transpose(1, 2) for part in parts)
            banded = window is not None and padded > window
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=_band_mask(padded, window, q.device) if banded else None,
                dropout_p=dropout,
                is_causal=not banded,
                scale=scaling,
                enable_gqa=heads != key.size(1),
            )
            outputs.append(out.transpose(1, 2).reshape(samples * padded, heads, value.size(-1)))
    tokens = _ScatterTokens.apply(torch.cat(outputs), plan.inverse)
    return tokens.view(batch, length, heads, value.size(-1))


def packed_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    position_ids = kwargs.get("position_ids")
    shard: SequenceShard | None = kwargs.get("sequence_shard")
    window = kwargs.get("sliding_window")
    if shard is not None:
        # Sequence parallelism: this rank's tokens of every head in, all tokens of its heads attended, back out.
        query, key, value = (shard.gather(states) for states in (query, key, value))
        dropout = dropout if module.training else 0.0
        out = samples_attention(
            query, key, value, shard.position_ids, shard.cu_lengths, shard.longest, dropout, scaling, window,
            shard.host_position_ids,
        )  # fmt: skip
        return shard.scatter(out), None
    length = query.size(2)
    # Whole sequences: no cached keys ahead of the queries (training, or generation's first pass).
    whole = position_ids is not None and length > 1 and key.size(2) == length and position_ids.size(-1) == length
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    # A padding mask (unpacked rows, left-padded generation) goes to the library's SDPA as it is: with
    # one sample per row there is nothing to split, and one call over the rows beats many small ones.
    if not whole or not causal or attention_mask is not None or kwargs.get("s_aux") is not None:
        with sdpa_backends(query.device):
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    dropout = dropout if module.training else 0.0
    cu_lengths, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q", 0)
    host = kwargs.get("host_position_ids")
    out = samples_attention(query, key, value, position_ids, cu_lengths, longest, dropout, scaling, window, host)
    return out, None


def samples_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position_ids: torch.Tensor,
    cu_lengths: torch.Tensor | None,
    longest: int,
    dropout: float,
    scaling: float | None,
    window: int | None,
    host_position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within each sample of whole rows (samples start where `position_ids` restart): the
    varlen kernel when `cu_lengths` were planned and it applies, else the gathered SDPA, planned from
    `host_position_ids` (the CPU copy) when given. (batch, heads, length, dim) in, (batch, length, heads,
    value dim) out."""
    gqa = query.size(1) != key.size(1)
    if (
        cu_lengths is not None
        and varlen_unsupported(query, key, value, dropout) is None
        and varlen_verified(query.device, query.dtype, query.size(-1), value.size(-1), gqa)
    ):
        return varlen_forward(query, key, value, cu_lengths, longest, scaling, window)
    plan = _plan_for(position_ids, query.size(0), host_position_ids)
    return gathered_sdpa(query, key, value, plan, dropout, scaling, window)


_MASK_PARAMETERS = inspect.signature(sdpa_mask)


def packed_sdpa_mask(*args, **kwargs) -> torch.Tensor | None:
    """No mask for a whole-sequence forward without padding information: the attention above splits the rows
    by position ids (and applies any sliding window itself), so a batch x length x length mask would be
    built for nothing. Everything else (a cache, a padding mask) gets `transformers`' SDPA mask."""
    bound = _MASK_PARAMETERS.bind(*args, **kwargs)
    bound.apply_defaults()
    given = bound.arguments
    whole = given["q_offset"] == 0 and given["kv_offset"] == 0 and given["q_length"] == given["kv_length"] > 1
    if whole and given["attention_mask"] is None:
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Make `NAME` available to every model (idempotent); returns it."""
    AttentionInterface.register(NAME, packed_sdpa_forward)
    AttentionMaskInterface.register(NAME, packed_sdpa_mask)
    return NAME
