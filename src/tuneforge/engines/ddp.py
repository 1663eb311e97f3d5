"""DistributedDataParallel: a full replica per rank, gradients averaged by all-reduce."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from tuneforge.diagnostics.recorder import RECORDER
from tuneforge.distributed import DistInfo, all_reduce_sum
from tuneforge.engines.loss_scale import LossScaler
from tuneforge.engines.single import SingleEngine, global_grad_norm
from tuneforge.model.moe import find_moe_blocks


def _recorded_allreduce(state, bucket):
    entry = RECORDER.record("all_reduce", (bucket.buffer(),), {})
    entry.module = f"DDP gradient bucket {bucket.index()}"

    def finished(future: torch.futures.Future) -> torch.Tensor:
        RECORDER.done(entry)
        return future.value()

    return default_hooks.allreduce_hook(None, bucket).then(finished)


class DDPEngine(SingleEngine):
    name = "ddp"

    def __init__(
        self,
        model: torch.nn.Module,
        make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
        info: DistInfo,
        scaler: LossScaler | None = None,
    ):
        super().__init__(model, make_optimizer, info, scaler)
        self._plain = self._model
        self._model = DistributedDataParallel(
            self._plain,
            device_ids=[info.device.index] if info.device.type == "cuda" else None,
            broadcast_buffers=False,  # rotary caches and the like are identical on every rank
            # MoE blocks skip experts that receive no tokens, leaving their parameters without gradients.
            find_unused_parameters=bool(find_moe_blocks(self._plain)),
        )
        # DDP's gradient all-reduces run in C++; a communication hook makes them visible to the recorder.
        self._model.register_comm_hook(state=None, hook=_recorded_allreduce)

    @property
    def unwrapped(self) -> torch.nn.Module:
        return self._plain

    def sum_across_ranks(self, values: list[float]) -> list[float]:
        return all_reduce_sum(values, self.info)

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else self._model.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        # DDP averages gradients over ranks; the loss is already normalised by the global target count.
        (self._scaled(loss) * self.info.world_size).backward()

    def clip_grad_norm(self, max_norm: float) -> float:
        # After the all-reduce every rank holds the same gradients, hence the same norm.
        return global_grad_norm(list(self._plain.parameters()), max_norm)
