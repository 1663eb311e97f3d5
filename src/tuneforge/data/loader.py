"""The batching strategy chosen by the config, and padding figures for the data report."""

from __future__ import annotations

from tuneforge.config.schema import Config
from tuneforge.data.batching import BatchPlanner, best_fit_decreasing, padding_fraction, plan_epoch
from tuneforge.data.tokenize import TokenizedData


def strategy(cfg: Config) -> str:
    if cfg.data.packing:
        return "packed"
    return "grouped" if cfg.data.group_by_length else "random"


def make_planner(data: TokenizedData, cfg: Config, pad_id: int, rank: int = 0, world_size: int = 1) -> BatchPlanner:
    return BatchPlanner(
        data, cfg.train.micro_batch_size, pad_id, cfg.train.seed, strategy(cfg), cfg.data.max_length, rank, world_size
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
