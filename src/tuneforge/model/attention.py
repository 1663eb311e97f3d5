"""Model inputs that keep attention inside each sample, for the model's attention implementation.

Unpacked batches on plain SDPA and eager need only the 2D padding mask. Packed rows need isolation:
flash-attention derives per-sample boundaries from position ids (varlen kernels), and so does tuneforge's
SDPA (`packed_attention`, what models on the attention interface get for `sdpa`), which needs no mask at all;
plain SDPA (models that cannot switch) and eager get an explicit block-diagonal causal mask, which
`transformers` uses as given. Position ids alone are not enough on plain SDPA: without an explicit mask the
packed samples attend to each other.
"""

from __future__ import annotations

import torch

from tuneforge.data.batching import MicroBatch
from tuneforge.model.packed_attention import NAME as PACKED_SDPA


def block_causal_mask(sequence_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, L, L) boolean: query t sees key s iff s <= t and both belong to the same sample.
    Padding (-1) forms its own block, so no query row is empty (an empty row gives NaN in SDPA)."""
    length = sequence_ids.size(1)
    same = sequence_ids[:, :, None] == sequence_ids[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=sequence_ids.device).tril()
    return (same & causal)[:, None, :, :]


def model_inputs(model: torch.nn.Module, batch: MicroBatch, device: torch.device) -> dict[str, torch.Tensor]:
    inputs = {"input_ids": batch.input_ids.to(device), "position_ids": batch.position_ids.to(device)}
    if not batch.packed:
        inputs["attention_mask"] = batch.attention_mask.to(device)
        return inputs
    implementation = getattr(model.config, "_attn_implementation", "eager") or "eager"
    if "flash" in implementation or implementation == PACKED_SDPA:
        return inputs  # both split the rows where position ids restart, with no mask built
    mask = block_causal_mask(batch.sequence_ids.to(device))
    if implementation == "sdpa":
        inputs["attention_mask"] = mask
    else:
        # eager adds the mask to the attention scores
        dtype = next(model.parameters()).dtype
        inputs["attention_mask"] = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(
            ~mask, torch.finfo(dtype).min
        )
    return inputs
