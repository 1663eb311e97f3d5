"""SDPA that computes attention sample by sample, registered with `transformers`' attention interface.

A packed row of 1,024 tokens holding three samples needs three causal triangles of about 340 tokens; a
block-diagonal mask over the row makes SDPA compute the whole 1,024 x 1,024 square and mask most of it
away (and on CPU it also rules out the causal fast path). Here every sample, found where the position
ids restart, gets its own causal SDPA call: several times less attention work, and exact, since the
block-diagonal mask allows nothing more. Calls that are not whole training sequences (generation with a
cache, a single query) go to the library's own SDPA unchanged. This is the documented extension point
(`AttentionInterface.register`), not a change to any model's code.

Used on GPUs only, where a masked SDPA falls back from the flash kernel to one that computes the whole
square. On CPU the masked kernel is about as fast (the per-sample calls measured within 2% of it on the
52M Llama benchmark; 3-7% slower before their outputs were concatenated): exact there, but not worth a
switch. Not yet measured on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "tuneforge_sdpa"
"""Registered name; the model config still says `sdpa` to the user (`model.attn_implementation`)."""


def sample_spans(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) of each run of consecutive positions: a sample, or a stretch of padding."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    length = position_ids.size(1)
    spans = []
    for row in starts.cpu():
        begin = row.nonzero().flatten().tolist()
        spans.append(list(zip(begin, [*begin[1:], length], strict=True)))
    return spans


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
    length = query.size(2)
    # Whole sequences: no cached keys ahead of the queries (training, or generation's first pass).
    whole = position_ids is not None and length > 1 and key.size(2) == length and position_ids.size(1) == length
    if not whole or not getattr(module, "is_causal", True):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    groups = query.size(1) // key.size(1)
    dropout = dropout if module.training else 0.0
    rows = []
    for row, spans in enumerate(sample_spans(position_ids)):
        # Concatenated rather than written into a preallocated output: its backward is a cheap split.
        parts = [
            F.scaled_dot_product_attention(
                query[row : row + 1, :, start:end],
                key[row : row + 1, :, start:end],
                value[row : row + 1, :, start:end],
                dropout_p=dropout,
                is_causal=True,
                scale=scaling,
                enable_gqa=groups > 1,
            )
            for start, end in spans
        ]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0).transpose(1, 2).contiguous(), None


def register() -> str:
    """Make `NAME` available to every model (idempotent); returns it."""
    AttentionInterface.register(NAME, packed_sdpa_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
