"""Engines behind one protocol: `single`, `ddp`, `fsdp` (FSDP2) and `deepspeed` (ZeRO 0-3)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tuneforge.config.schema import ParallelConfig, TrainConfig
from tuneforge.distributed import DistInfo
from tuneforge.engines.base import Engine
from tuneforge.engines.loss_scale import LossScaler
from tuneforge.errors import UserError


def choose_engine(requested: str, info: DistInfo) -> str:
    if requested == "auto":
        return "ddp" if info.distributed else "single"
    if requested == "single" and info.distributed:
        raise UserError(f"parallel.engine=single cannot run in {info.world_size} processes; use ddp, fsdp or auto")
    if requested != "single" and not info.distributed:
        raise UserError(
            f"parallel.engine={requested} needs several processes; add --nproc-per-node N, or use single or auto"
        )
    return requested


def build_engine(
    name: str,
    model: torch.nn.Module,
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    info: DistInfo,
    parallel: ParallelConfig,
    train: TrainConfig,
) -> Engine:
    precision = train.precision
    scaler = None
    if precision == "fp16" and name != "deepspeed":  # DeepSpeed scales with its own scaler, same settings
        scaler = LossScaler(
            train.loss_scale or train.initial_loss_scale, train.loss_scale_window, train.loss_scale is None
        )
    if name == "single":
        from tuneforge.engines.single import SingleEngine

        return SingleEngine(model, make_optimizer, info, scaler)
    if name == "ddp":
        from tuneforge.engines.ddp import DDPEngine

        return DDPEngine(model, make_optimizer, info, scaler)
    # bf16 parameters pay off on GPUs; on CPU, autocast does the bf16 compute with fp32 weights.
    bf16_params = precision == "bf16" and info.device.type == "cuda"
    if name == "fsdp":
        from tuneforge.engines.fsdp import FSDPEngine

        return FSDPEngine(
            model,
            make_optimizer,
            info,
            cpu_offload=parallel.cpu_offload == "all",
            bf16_params=bf16_params,
            scaler=scaler,
        )
    from tuneforge.engines.deepspeed import DeepSpeedEngine

    return DeepSpeedEngine(model, make_optimizer, info, parallel, train, bf16_params)


__all__ = ["Engine", "build_engine", "choose_engine"]
