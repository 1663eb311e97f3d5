"""Validation loss on all ranks: the mean over every target token of the validation split."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tuneforge.data.batching import (
    MicroBatch,
    best_fit_decreasing,
    collate,
    mask_filler_rows,
    plan_epoch,
    rows_for_rank,
    sequence_width_multiple,
    shard_rows,
)
from tuneforge.data.tokenize import TokenizedData
from tuneforge.distributed import Layout
from tuneforge.engines import Engine
from tuneforge.objective import Objective


def validation_batches(
    data: TokenizedData,
    micro_batch_size: int,
    pad_id: int,
    layout: Layout,
    packing: bool,
    max_length: int,
    group: int = 1,
    index_offset: int = 0,
    attach_images: Callable[[MicroBatch], MicroBatch] | None = None,
) -> Iterator[MicroBatch]:
    """This rank's share of every global validation micro-batch (its data-parallel group's rows, its sequence
    shard of them). When a batch has fewer rows than groups, the rows repeated to give every group a batch have
    their targets masked, so each sample counts exactly once. `group` samples side by side stay in one row (2:
    a preference pair's answers), as in training. `index_offset` is added to the batches' sample indices (where
    a table holds the train split's samples first). `attach_images`: a vision-language model's pixel inputs."""
    rank, world_size = layout.data_rank, layout.data_size
    units = data.lengths.reshape(-1, group).sum(axis=1) if group > 1 else data.lengths
    packed_rows = best_fit_decreasing(units, max_length * group) if packing else None
    plan = plan_epoch(units, micro_batch_size * world_size, "packed" if packing else "grouped", 0, 0, packed_rows)
    for batch in plan:
        batch = [[unit * group + member for unit in row for member in range(group)] for row in batch]
        rows = rows_for_rank(batch, rank, world_size, filler=batch)
        mine = collate(data, rows, pad_id, packing or group > 1, sequence_width_multiple(layout.size))
        mine.sample_indices = [index + index_offset for index in mine.sample_indices]
        mask_filler_rows(mine, rank, world_size, len(batch))
        mine = shard_rows(mine, layout.shard, layout.size)
        yield attach_images(mine) if attach_images is not None else mine


@dataclass(frozen=True)
class ValidationResult:
    loss: float
    """The objective's mean over the split's units (target tokens, pairs)."""
    units: int
    metrics: dict[str, float]
    """The objective's figures (`Objective.metric_names`), means over the units."""


@torch.no_grad()
def validation_loss(engine: Engine, batches: list[MicroBatch], objective: Objective) -> ValidationResult:
    """The objective's mean over the whole split, rows repeated to fill a batch not counted. Every rank runs the
    same number of forwards; the sums stay on the device until the one read at the end."""
    engine.model.eval()
    totals = torch.zeros(1 + len(objective.metric_names), dtype=torch.float64, device=objective.forward.device)
    units = 0
    for batch in batches:
        loss, metrics = objective.evaluate(batch, objective.prepare(batch))
        totals += torch.stack([loss, *(metrics[name] for name in objective.metric_names)]).double()
        units += objective.count(batch)
    engine.model.train()
    *sums, units = engine.sum_across_ranks([*totals.tolist(), units])
    mean = [value / max(units, 1.0) for value in sums]
    return ValidationResult(mean[0], int(units), dict(zip(objective.metric_names, mean[1:], strict=True)))
