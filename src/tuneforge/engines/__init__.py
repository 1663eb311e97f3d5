"""Engines behind one protocol: `single` and `ddp` (FSDP2 and DeepSpeed plug in the same way)."""

from __future__ import annotations

import torch

from tuneforge.distributed import DistInfo
from tuneforge.engines.base import Engine
from tuneforge.engines.ddp import DDPEngine
from tuneforge.engines.single import SingleEngine
from tuneforge.errors import UserError


def choose_engine(requested: str, info: DistInfo) -> str:
    if requested == "auto":
        return "ddp" if info.distributed else "single"
    if requested == "single" and info.distributed:
        raise UserError(f"parallel.engine=single cannot run in {info.world_size} processes; use ddp or auto")
    return requested


def build_engine(name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo) -> Engine:
    engines = {"single": SingleEngine, "ddp": DDPEngine}
    return engines[name](model, optimizer, info)


__all__ = ["Engine", "build_engine", "choose_engine"]
