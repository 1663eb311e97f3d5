"""DistributedDataParallel: a full replica per rank, gradients averaged by all-reduce."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from tuneforge.config.schema import ParallelConfig, TrainConfig
from tuneforge.diagnostics.recorder import RECORDER
from tuneforge.distributed import DistInfo
from tuneforge.engines.base import EngineTraits, OptimizerFactory
from tuneforge.engines.single import SingleEngine
from tuneforge.model.moe import MoEMap


def _recorded_allreduce(state, bucket):
    """DDP's own averaging all-reduce, recorded as one collective in flight until its result arrives (the
    asynchronous call inside returns at once, so it is not recorded a second time)."""
    entry = RECORDER.record("all_reduce", (bucket.buffer(),), {})
    entry.module = f"DDP gradient bucket {bucket.index()}"

    def finished(future: torch.futures.Future) -> torch.Tensor:
        RECORDER.done(entry)
        return future.value()

    with RECORDER.paused():
        return default_hooks.allreduce_hook(None, bucket).then(finished)


class DDPEngine(SingleEngine):
    @classmethod
    def setting_problems(cls, parallel: ParallelConfig) -> list[str]:
        if parallel.cpu_offload != "none":
            return ["parallel.cpu_offload needs engine fsdp or deepspeed, not ddp"]
        return []

    @classmethod
    def traits_for(cls, parallel: ParallelConfig, train: TrainConfig, device: str = "cuda") -> EngineTraits:
        # A replica per rank does what one process does; experts without tokens have no gradient, so DDP must
        # look for unused parameters (not a choice, hence not `parallel.moe_safety`).
        single = SingleEngine.traits_for(parallel, train, device)
        return replace(single, name="ddp", label="ddp", moe_safety="experts without tokens found as unused parameters")

    def __init__(
        self,
        model: torch.nn.Module,
        make_optimizer: OptimizerFactory,
        info: DistInfo,
        parallel: ParallelConfig | None = None,
        train: TrainConfig | None = None,
        moe: MoEMap | None = None,
    ):
        super().__init__(model, make_optimizer, info, parallel, train, moe)
        self._wrapped = DistributedDataParallel(
            self._plain,
            device_ids=[info.device.index] if info.device.type == "cuda" else None,
            broadcast_buffers=False,  # rotary caches and the like are identical on every rank
            # MoE blocks skip experts that receive no tokens, leaving their parameters without gradients.
            find_unused_parameters=bool(self.moe),
        )
        # DDP's gradient all-reduces run in C++; a communication hook makes them visible to the recorder.
        self._wrapped.register_comm_hook(state=None, hook=_recorded_allreduce)

    @property
    def model(self) -> torch.nn.Module:
        return self._wrapped

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else self._wrapped.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        # DDP averages gradients over ranks; the loss is already normalised by the global target count.
        # After the all-reduce every rank holds the same gradients, hence the same norm in `step`.
        (self.scaled(loss) * self.info.world_size).backward()
