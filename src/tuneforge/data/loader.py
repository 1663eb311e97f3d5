"""The batching strategy chosen by the config, and padding figures for the data report."""

from __future__ import annotations

from collections.abc import Callable

from tuneforge.config.schema import Config
from tuneforge.data.batching import BatchPlanner, MicroBatch, best_fit_decreasing, padding_fraction, plan_epoch
from tuneforge.data.tokenize import TokenizedData
from tuneforge.distributed import Layout


def strategy(cfg: Config) -> str:
    if cfg.data.packing:
        return "packed"
    return "grouped" if cfg.data.group_by_length else "random"


def data_plan(cfg: Config) -> str:
    """The settings the order of the training data follows, as a checkpoint records them: the seed, and how
    rows are formed (with packing, up to `max_length` tokens each)."""
    rows = f"packed rows of {cfg.data.max_length} tokens" if cfg.data.packing else f"{strategy(cfg)} batches"
    return f"train.seed={cfg.train.seed}, {rows}"


def make_planner(
    data: TokenizedData,
    cfg: Config,
    pad_id: int,
    layout: Layout | None = None,
    attach_images: Callable[[MicroBatch], MicroBatch] | None = None,
) -> BatchPlanner:
    """This rank's batches: its data-parallel group's share of every global micro-batch, and under sequence
    parallelism its shard of each row; `attach_images` gives each its pixel inputs (vision-language models)."""
    layout = layout or Layout()
    return BatchPlanner(
        data,
        cfg.train.micro_batch_size,
        pad_id,
        cfg.train.seed,
        strategy(cfg),
        cfg.data.max_length,
        layout.data_rank,
        layout.data_size,
        (layout.shard, layout.size),
        group=2 if cfg.paired else 1,
        attach_images=attach_images,
    )


def padding_by_strategy(data: TokenizedData, micro_batch_size: int, max_length: int) -> dict[str, float]:
    """Padding share of one epoch's micro-batches under each strategy (epoch 0, seed 0)."""
    if len(data) == 0:
        return {}
    rows = best_fit_decreasing(data.lengths, max_length)
    return {
        name: padding_fraction(plan_epoch(data.lengths, micro_batch_size, name, 0, 0, rows), data.lengths)
        for name in ("random", "grouped", "packed")
    }
