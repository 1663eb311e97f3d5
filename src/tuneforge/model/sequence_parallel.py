"""Sequence parallelism: each sample's tokens split across a group of ranks, attention exact (Ulysses).

With `parallel.sequence_parallel: N`, the N ranks of a group hold the same rows, each rank a contiguous
1/N of every row (`data.batching.shard_rows`). Everything but attention works token by token, so it runs
on the rank's share unchanged: embeddings, rotary positions (the shard keeps its true position ids), MLPs,
experts, norms and the loss. Attention needs every token of a sample: before it, one all-to-all per
tensor trades the sequence split for a head split (each rank then holds all tokens of H/N heads), the
attention runs over whole rows, and one all-to-all trades back. Backward is the reverse all-to-all. The
attention itself is tuneforge's packed attention (`packed_attention`), so samples stay isolated with
packing, on the varlen flash kernel on CUDA.

The exchanges are `torch.distributed.all_to_all_single` on a group made with `new_group`: the c10d
collective every engine already uses, recorded by the hang watchdog's recorder like every other collective.
DeepSpeed's `UlyssesSPAttentionHF` does the same exchange but assumes one head width for queries, keys
and values (MLA's 192/192/128 fail its shape checks), gathers the position ids again in every layer, and
takes effect by replacing `transformers`' global `sdpa` entry; PyTorch's `context_parallel` (ring attention)
needs DTensor inputs and CUDA SDPA backends and has no variable-length form for packed rows. Hence the
exchange around tuneforge's own attention, on every engine.

Gradients: the parameters are whole on every rank (as in data parallelism), each rank's backward yields
the gradient of its share of the loss, and the engines sum gradients over all ranks. Token counts, the
loss normalisation and the router balance statistics are sums over all ranks too, and each token lives on
exactly one rank, so the sums are those of the whole rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tuneforge.distributed import Layout

_GROUP: dist.ProcessGroup | None = None


def init_groups(rank: int, world_size: int, size: int) -> Layout:
    """This rank's layout, creating the sequence-parallel process groups (a collective: every rank calls it
    with the same `size`)."""
    global _GROUP
    layout = Layout.of(rank, world_size, size)
    if size > 1:
        for first in range(0, world_size, size):
            group = dist.new_group(list(range(first, first + size)))
            if first == layout.data_rank * size:
                _GROUP = group
    return layout


def group() -> dist.ProcessGroup:
    if _GROUP is None:
        raise RuntimeError("sequence parallelism is not set up in this process (init_groups)")
    return _GROUP


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` over dim 0 (split into equal chunks, chunk j to rank j); backward is the same exchange
    of the gradients in the other direction."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, process_group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.process_group = process_group
        tensor = tensor.contiguous()
        out = torch.empty_like(tensor)
        dist.all_to_all_single(out, tensor, group=process_group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.process_group)
        return out, None


def heads_to_sequence(states: torch.Tensor, process_group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """(batch, heads, local length, dim) -> (batch, heads / N, N x local length, dim): this rank's heads over the
    whole rows, the sequence in shard order."""
    batch, heads, length, dim = states.shape
    chunks = states.reshape(batch, size, heads // size, length, dim).transpose(0, 1)
    exchanged = _AllToAll.apply(chunks, process_group)  # (shard, batch, heads / N, local length, dim)
    return exchanged.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * length, dim)


def sequence_to_heads(out: torch.Tensor, process_group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """(batch, whole length, heads / N, dim) -> (batch, local length, heads, dim): back to this rank's tokens,
    every head."""
    batch, length, heads, dim = out.shape
    chunks = out.reshape(batch, size, length // size, heads, dim).transpose(0, 1)
    exchanged = _AllToAll.apply(chunks, process_group)  # (head group, batch, local length, heads / N, dim)
    return exchanged.permute(1, 2, 0, 3, 4).reshape(batch, length // size, size * heads, dim)


@dataclass(frozen=True)
class SequenceShard:
    """What the attention of a sharded forward needs about the whole rows, planned on the CPU before the forward
    and passed to every layer as the `sequence_shard` keyword (through the model's attention keywords)."""

    process_group: dist.ProcessGroup
    size: int
    position_ids: torch.Tensor
    """Positions of the whole rows, on the model's device: where the samples start."""
    cu_lengths: torch.Tensor | None = None
    """Cumulative sample lengths of the whole rows for the varlen kernel (CUDA), else None."""
    longest: int = 0
    host_position_ids: torch.Tensor | None = None
    """The CPU copy of `position_ids`: the gathered SDPA plans from it without waiting on the GPU."""

    def gather(self, states: torch.Tensor) -> torch.Tensor:
        return heads_to_sequence(states, self.process_group, self.size)

    def scatter(self, out: torch.Tensor) -> torch.Tensor:
        return sequence_to_heads(out, self.process_group, self.size)


def unsupported(heads: int, kv_heads: int, world_size: int, size: int) -> list[str]:
    """Why `parallel.sequence_parallel: size` cannot run with this model and world, one reason per line (whether
    the engine can is `Engine.setting_problems`)."""
    problems = []
    if world_size % size:
        problems.append(f"the {world_size} rank(s) do not split into groups of {size} (world size % N != 0)")
    for name, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if count % size:
            problems.append(f"the model's {count} {name} do not divide among {size} ranks")
    return problems
