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
from tuneforge.model import sequence_parallel
from tuneforge.model.packed_attention import NAME as PACKED_SDPA
from tuneforge.model.packed_attention import cumulative_lengths
from tuneforge.model.sequence_parallel import SequenceShard
from tuneforge.model.transfer import to_device
from tuneforge.model.vision_inputs import vision_inputs


def block_causal_mask(sequence_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, L, L) boolean: query t sees key s iff s <= t and both belong to the same sample.
    Padding (-1) forms its own block, so no query row is empty (an empty row gives NaN in SDPA)."""
    length = sequence_ids.size(1)
    same = sequence_ids[:, :, None] == sequence_ids[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=sequence_ids.device).tril()
    return (same & causal)[:, None, :, :]


def sequence_shard(whole_position_ids: torch.Tensor, device: torch.device) -> SequenceShard:
    """The attention's view of the whole rows under sequence parallelism, planned from the CPU positions (the run's
    setup has refused models whose attention is not tuneforge's packed attention)."""
    cu_lengths, longest = None, 0
    if device.type == "cuda":
        cu_lengths, longest = cumulative_lengths(whole_position_ids)
        cu_lengths = to_device(cu_lengths, device)
    group = sequence_parallel.group()
    positions = to_device(whole_position_ids, device)
    return SequenceShard(group, group.size(), positions, cu_lengths, longest, host_position_ids=whole_position_ids)


def model_inputs(model: torch.nn.Module, batch: MicroBatch, device: torch.device) -> dict[str, object]:
    """The forward's keyword inputs for `batch`: tokens, positions, what keeps attention inside each sample, and
    a vision-language model's pixel inputs."""
    inputs = _token_inputs(model, batch, device)
    if batch.vision is not None:
        inputs |= vision_inputs(model, batch, device)
    return inputs


def _token_inputs(model: torch.nn.Module, batch: MicroBatch, device: torch.device) -> dict[str, object]:
    inputs: dict[str, object] = {
        "input_ids": to_device(batch.input_ids, device),
        "position_ids": to_device(batch.position_ids, device),
    }
    if batch.whole_position_ids is not None:
        inputs["sequence_shard"] = sequence_shard(batch.whole_position_ids, device)
        return inputs  # no mask: the attention splits the whole rows where positions restart, padded or packed
    if not batch.packed:
        inputs["attention_mask"] = to_device(batch.attention_mask, device)
        return inputs
    implementation = getattr(model.config, "_attn_implementation", "eager") or "eager"
    if implementation == PACKED_SDPA and device.type == "cuda":
        # The varlen kernel's plan, from the CPU copy of the positions: nothing waits on the GPU for it.
        cu_lengths, longest = cumulative_lengths(batch.position_ids)
        cu_lengths = to_device(cu_lengths, device)
        inputs |= {"cu_seq_lens_q": cu_lengths, "cu_seq_lens_k": cu_lengths}
        inputs |= {"max_length_q": longest, "max_length_k": longest}
        # Where the kernel does not apply, the gathered SDPA plans from this copy instead of the GPU's.
        inputs["host_position_ids"] = batch.position_ids
    if "flash" in implementation or implementation == PACKED_SDPA:
        return inputs  # both split the rows where position ids restart, with no mask built
    mask = block_causal_mask(to_device(batch.sequence_ids, device))
    if implementation == "sdpa":
        inputs["attention_mask"] = mask
    else:
        # eager adds the mask to the attention scores
        dtype = next(model.parameters()).dtype
        inputs["attention_mask"] = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(
            ~mask, torch.finfo(dtype).min
        )
    return inputs
