"""Engines behind one protocol: `single`, `ddp`, `fsdp` (FSDP2) and `deepspeed` (ZeRO 0-3)."""

from __future__ import annotations

import torch

from tuneforge.config.schema import ParallelConfig, TrainConfig
from tuneforge.distributed import DistInfo
from tuneforge.engines.base import Engine, EngineTraits, OptimizerFactory
from tuneforge.errors import SharedUserError, UserError
from tuneforge.model.moe import MoEMap


def choose_engine(requested: str, info: DistInfo, parallel: ParallelConfig | None = None) -> str:
    """The engine of this run, once: `parallel.engine` (auto: ddp with several processes, else single), with
    what it cannot do in `parallel` refused here, before anything loads."""
    if requested == "auto":
        chosen = "ddp" if info.distributed else "single"
    elif requested == "single" and info.distributed:
        raise SharedUserError(
            f"parallel.engine=single cannot run in {info.world_size} processes; use ddp, fsdp or auto"
        )
    elif requested != "single" and not info.distributed:
        raise UserError(
            f"parallel.engine={requested} needs several processes; add --nproc-per-node N, or use single or auto"
        )
    else:
        chosen = requested
    if parallel is None:
        return chosen
    problems = engine_class(chosen).setting_problems(parallel)
    if parallel.expert_parallel > 1 and not engine_class(chosen).shards_experts:
        problems.append(f"parallel.expert_parallel needs parallel.engine=deepspeed (DeepSpeed's AutoEP), not {chosen}")
    if problems:  # from the config and the world size alone: every rank finds the same, rank 0 says it
        raise SharedUserError("; ".join(problems))
    return chosen


def engine_class(name: str) -> type[Engine]:
    # Imported on demand: DeepSpeed is an optional extra, and FSDP2 pulls in torch.distributed's checkpointing.
    if name == "single":
        from tuneforge.engines.single import SingleEngine

        return SingleEngine
    if name == "ddp":
        from tuneforge.engines.ddp import DDPEngine

        return DDPEngine
    if name == "fsdp":
        from tuneforge.engines.fsdp import FSDPEngine

        return FSDPEngine
    if name == "deepspeed":
        from tuneforge.engines.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine
    raise ValueError(f"unknown engine {name!r}")


def engine_traits(name: str, parallel: ParallelConfig, train: TrainConfig, device: str = "cuda") -> EngineTraits:
    """What engine `name` does under this config, without building it (for the doctor, the estimate, loading)."""
    return engine_class(name).traits_for(parallel, train, device)


def build_engine(
    name: str,
    model: torch.nn.Module,
    make_optimizer: OptimizerFactory,
    info: DistInfo,
    parallel: ParallelConfig,
    train: TrainConfig,
    moe: MoEMap,
) -> Engine:
    """`moe`: the MoE map of the base model inside `model`, found before adapters wrapped it."""
    return engine_class(name)(model, make_optimizer, info, parallel, train, moe)


__all__ = ["Engine", "EngineTraits", "build_engine", "choose_engine", "engine_traits"]
