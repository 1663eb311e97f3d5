"""The narrow protocol between the training loop and how the work is spread over processes.

The loop calls only these methods, in the same order on every rank, and never asks which engine
it has. That is what keeps every rank issuing the same collectives.

What an engine does (whether it shards parameters, casts them, where the loss may read the output layer,
how MoE blocks stay collective-safe) is an `EngineTraits`, known from the config before the engine exists:
the doctor, the estimate and model loading ask the traits instead of comparing engine names.
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.distributed.tensor import DTensor

from tuneforge.config.schema import Config, ParallelConfig, TrainConfig
from tuneforge.distributed import DistInfo, all_reduce_sum
from tuneforge.engines.loss_scale import LossScaler
from tuneforge.errors import UserError
from tuneforge.model.moe import MoEMap
from tuneforge.model.router_balance import RouterBalance

OptimizerFactory = Callable[[torch.nn.Module], torch.optim.Optimizer]


@dataclass(frozen=True)
class EngineTraits:
    name: str
    label: str
    """How the run and the estimate name the set-up, e.g. `deepspeed ZeRO-3`."""
    shard_stage: int
    """What is split across ranks: 0 nothing, 1 optimizer state, 2 and gradients, 3 and parameters."""
    casts_parameters: bool
    """Every parameter, frozen ones included, is held in the compute dtype (DeepSpeed under bf16/fp16)."""
    reduces_every_micro_batch: bool
    """Gradients are reduced after every micro-batch, not only at the last one of a step."""
    fuses_output_layer: bool
    """The output layer's weight is whole on every rank after the forward, so the loss may apply it itself."""
    skips_nonfinite: bool
    """`step` leaves weights and optimizer state untouched when the gradient norm is not finite."""
    compiles: bool
    """`train.compile` works under this engine."""
    moe_safety: str
    """How MoE blocks issue the same collectives on every rank whatever their tokens pick ('' when nothing is
    needed or `parallel.moe_safety` is off)."""

    @property
    def sharded(self) -> bool:
        """Parameters live in pieces across ranks: every forward is a collective, so generation runs in lockstep,
        and 4-bit weights must be stored in a dtype the engine can split."""
        return self.shard_stage == 3

    @property
    def shards_anything(self) -> bool:
        return self.shard_stage > 0

    def check_compile(self) -> None:
        """`train.compile` is refused before the model loads under engines it is not tested with."""
        if not self.compiles:
            raise UserError(
                f"train.compile: supported with parallel.engine single or ddp, not {self.label}; "
                "set train.compile=false"
            )


@dataclass(frozen=True)
class FrozenModel:
    """A second model that does not train (DPO's frozen reference), held the way its engine holds the policy:
    a replica per rank, or sharded over the ranks (its forwards are then collectives, run in the same order on
    every rank)."""

    module: torch.nn.Module
    """What to call for a forward (possibly the engine's wrapper)."""
    plain: torch.nn.Module
    """The Hugging Face model inside it."""
    fuses_output_layer: bool
    """The output layer's weight is whole after the forward (see `EngineTraits.fuses_output_layer`)."""
    release: Callable[[], None] = lambda: None
    """Called after each use: frees what the forward gathered and kept (FSDP2 keeps its root unit whole)."""


def global_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """The gradients' global norm before clipping, as a tensor on their device (nothing waits for it); the
    gradients clipped to `max_norm` (0: not clipped). A non-finite norm leaves them non-finite: the step that
    follows is skipped. Works on sharded (DTensor) gradients too: the norm is then a collective."""
    with_grads = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in with_grads])
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, total)
    return total.full_tensor() if isinstance(total, DTensor) else total


class Engine(abc.ABC):
    """The common parts of every engine; subclasses wrap the model and say how gradients are made and applied.
    Every engine is built the same way: `Engine(model, make_optimizer, info, parallel, train, moe)`."""

    scales_fp16_loss = True
    """fp16 loss scaling is ours (`LossScaler`); DeepSpeed scales with its own scaler, same settings."""
    optimizer: torch.optim.Optimizer

    def __init__(
        self,
        info: DistInfo,
        parallel: ParallelConfig | None = None,
        train: TrainConfig | None = None,
        moe: MoEMap | None = None,
    ):
        parallel, train = parallel or ParallelConfig(), train or TrainConfig(precision="fp32")
        self.info = info
        self.traits = self.traits_for(parallel, train, info.device.type)
        self.moe = moe if moe is not None else MoEMap()
        self.scaler = LossScaler.for_config(train) if self.scales_fp16_loss else None

    @classmethod
    @abc.abstractmethod
    def traits_for(cls, parallel: ParallelConfig, train: TrainConfig, device: str = "cuda") -> EngineTraits:
        """What this engine does under `parallel` and `train` on a `device` type, before it is built."""

    @classmethod
    def setting_problems(cls, parallel: ParallelConfig) -> list[str]:
        """What in `parallel` this engine cannot do, one line each with its fix (checked before anything loads)."""
        return []

    shards_experts: ClassVar[bool] = False
    """Whether `parallel.expert_parallel` can shard the routed experts over ranks on this engine."""

    @classmethod
    def model_problems(cls, cfg: Config, read_config: Callable[[], Any], world_size: int) -> tuple[list[str], str]:
        """What this engine refuses of the model whose config `read_config` reads, under `cfg` and `world_size`
        (one line each with its fix), checked before the model loads; and a line to say when nothing is refused
        ("" when there is nothing to say)."""
        return [], ""

    @classmethod
    def input_problems(cls, parallel: ParallelConfig) -> list[str]:
        """What is wrong with the files `parallel` names for this engine, said before any process starts."""
        return []

    def keep_router_balance(self, balance: RouterBalance) -> None:
        """Router balance hooks on the MoE blocks this engine holds: an engine that replaced the model's blocks
        (expert parallelism) moves them to its own. The others hold the blocks the hooks are on already."""
        return

    @property
    def name(self) -> str:
        return self.traits.name

    @property
    def sharded(self) -> bool:
        return self.traits.sharded

    @property
    def skips_nonfinite(self) -> bool:
        return self.traits.skips_nonfinite

    @property
    def generates_in_lockstep(self) -> bool:
        """Every forward is a collective here (parameters sharded over several ranks): generation runs the same
        number of forwards on every rank, however soon its own replies end."""
        return self.sharded and self.info.distributed

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale; None without fp16 loss scaling."""
        return self.scaler.scale if self.scaler is not None else None

    @property
    @abc.abstractmethod
    def model(self) -> torch.nn.Module:
        """The module to call for training forward passes (possibly a wrapper)."""

    @property
    @abc.abstractmethod
    def unwrapped(self) -> torch.nn.Module:
        """The plain Hugging Face model (inside PEFT's wrapper, if any), for generation and saving."""

    def sum_across_ranks(self, values: list[float]) -> list[float]:
        """Element-wise sums over all ranks (token counts, loss sums), in one collective."""
        return all_reduce_sum(values, self.info) if self.info.distributed else list(values)

    def sum_tensor_across_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise sums over all ranks of a tensor on this rank's device, in place and without a host
        round trip (the router loss's per-micro-batch statistics)."""
        if self.info.distributed:
            torch.distributed.all_reduce(tensor)
        return tensor

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        """Context of one micro-batch's forward and backward; gradients are synchronised only when `last`."""
        return contextlib.nullcontext()

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the fp16 loss scale, when scaling."""
        return self.scaler.scaled(loss) if self.scaler is not None else loss

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """`loss` is this rank's share of the global mean: its token-loss sum over the global target count.
        Under fp16 the engine multiplies it by its loss scale and `step` divides the gradients again."""

    @abc.abstractmethod
    def step(self, lr: float, max_grad_norm: float) -> torch.Tensor | float:
        """Clip the gradients to `max_grad_norm` (0: no clipping), apply them at learning rate `lr` (unless the
        norm is not finite, where `skips_nonfinite`), clear them. Returns the global norm before clipping, where
        possible as a device tensor the caller reads with the step's other figures."""

    @abc.abstractmethod
    def save_state(self, directory: Path) -> None:
        """Model and optimizer state for an exact resume, into `directory` (shared by all ranks). A collective
        for sharded engines: every rank calls it."""

    @abc.abstractmethod
    def load_state(self, directory: Path) -> None:
        """Restore what `save_state` wrote (same world size). Every rank calls it."""

    @abc.abstractmethod
    def frozen(self, model: torch.nn.Module) -> FrozenModel:
        """`model` with no gradient and in eval mode, placed like the policy (`FrozenModel`). Every rank calls it:
        sharding engines shard it with the same process group and settings."""

    def whole(self, unit: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Inside, `unit`'s parameters are whole on this rank, to be read (a copy made of what must outlive it).
        `unit` is the model's root (then its parameters outside the decoder layers) or one decoder layer: the units
        sharding engines shard by. A collective for sharded engines: every rank enters the same units in the same
        order."""
        return contextlib.nullcontext()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights for saving, on rank 0. A collective for sharded engines: every rank calls
        it. None means the unwrapped model's own weights are the whole model."""
        return None

    def _clipped_step(
        self, parameters: Iterable[torch.nn.Parameter], lr: float, max_grad_norm: float
    ) -> torch.Tensor | float:
        """For engines that step a torch optimizer themselves: unscale fp16 gradients (when scaling), clip, step
        unless not finite (weights, moments and the step count stay as they were), clear, and let the scaler
        adapt. The fused AdamW decides the skip on the device (its `found_inf`), so nothing here waits for the
        GPU; other optimizers, and fp16's scaler, read the norm."""
        parameters = list(parameters)
        if self.scaler is not None:
            self.scaler.unscale_(parameters)
        norm = global_grad_norm(parameters, max_grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # a part with its own rate (optim.LR_SCALE)
        if self.optimizer.defaults.get("fused"):
            self.optimizer.found_inf = (~torch.isfinite(norm)).float()
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
        elif math.isfinite(float(norm)):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.update(math.isfinite(float(norm)))
        return norm
