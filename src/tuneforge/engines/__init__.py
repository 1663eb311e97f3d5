"""Engines behind one protocol: `single`, `ddp`, `fsdp` (FSDP2) and `deepspeed` (ZeRO 0-3)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tuneforge.config.schema import Config, ParallelConfig, TrainConfig
from tuneforge.distributed import DistInfo
from tuneforge.engines.base import Engine, EngineTraits, OptimizerFactory
from tuneforge.errors import SharedUserError, UserError
from tuneforge.model.moe import MoEMap
from tuneforge.model.router_balance import RouterBalance


@dataclass(frozen=True)
class EngineChoice:
    """The run's engine, chosen once (`choose`): its name, its class and what it does under the config on the run's
    device. The run, the doctor, resume and the estimate ask it; none re-derives it from the name."""

    name: str
    engine_class: type[Engine]
    traits: EngineTraits

    @classmethod
    def choose(
        cls, info: DistInfo, parallel: ParallelConfig, train: TrainConfig, device: str | None = None
    ) -> EngineChoice:
        """`parallel.engine` for this launch (auto: ddp with several processes, else single), with what it cannot do
        in `parallel` refused here, before anything loads. `device`: the device type the traits are for (the
        run's own by default; the doctor's estimate asks for the GPU it sizes)."""
        return cls.of(choose_engine(parallel.engine, info, parallel), parallel, train, device or info.device.type)

    @classmethod
    def of(cls, name: str, parallel: ParallelConfig, train: TrainConfig, device: str) -> EngineChoice:
        """Engine `name` (as `choose_engine` resolved it) under `parallel` and `train` on a `device` type."""
        engine = engine_class(name)
        return cls(name, engine, engine.traits_for(parallel, train, device))

    def model_problems(self, cfg: Config, read_config: Callable[[], Any], world_size: int) -> tuple[list[str], str]:
        """What the engine refuses of this model (from its config, read only where needed, before it loads), and
        a line to say otherwise."""
        return self.engine_class.model_problems(cfg, read_config, world_size)

    def build(
        self,
        model: torch.nn.Module,
        make_optimizer: OptimizerFactory,
        info: DistInfo,
        parallel: ParallelConfig,
        train: TrainConfig,
        moe: MoEMap,
        balance: RouterBalance | None = None,
    ) -> Engine:
        """The engine holding `model` (`moe`: the MoE map of the base model inside it, found before adapters
        wrapped it), with the router balance hooks (`balance`) on the blocks it holds."""
        engine = self.engine_class(model, make_optimizer, info, parallel, train, moe)
        if balance is not None:
            engine.keep_router_balance(balance)
        return engine


def input_problems(parallel: ParallelConfig) -> list[str]:
    """What is wrong with the files `parallel` names for the engine it names, said before any process starts
    (`auto` picks one that reads none: its choice waits for the processes, which know their number)."""
    return [] if parallel.engine == "auto" else engine_class(parallel.engine).input_problems(parallel)


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


__all__ = ["Engine", "EngineChoice", "EngineTraits", "choose_engine", "engine_traits", "input_problems"]
