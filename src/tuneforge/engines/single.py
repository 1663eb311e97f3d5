"""One process, no collectives."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from tuneforge.config.schema import ParallelConfig, TrainConfig
from tuneforge.distributed import DistInfo
from tuneforge.engines.base import Engine, EngineTraits, FrozenModel, OptimizerFactory
from tuneforge.errors import UserError
from tuneforge.model.moe import MoEMap


class SingleEngine(Engine):
    @classmethod
    def setting_problems(cls, parallel: ParallelConfig) -> list[str]:
        problems = []
        if parallel.cpu_offload != "none":
            problems.append("parallel.cpu_offload needs engine fsdp or deepspeed, not single")
        if parallel.sequence_parallel > 1:
            problems.append(
                "parallel.sequence_parallel needs several ranks: launch several (--nproc-per-node N) with engine "
                "ddp, fsdp or deepspeed"
            )
        return problems

    @classmethod
    def traits_for(cls, parallel: ParallelConfig, train: TrainConfig, device: str = "cuda") -> EngineTraits:
        return EngineTraits(
            name="single",
            label="single",
            shard_stage=0,
            casts_parameters=False,
            reduces_every_micro_batch=False,
            fuses_output_layer=True,
            skips_nonfinite=True,
            compiles=True,
            moe_safety="",
        )

    def __init__(
        self,
        model: torch.nn.Module,
        make_optimizer: OptimizerFactory,
        info: DistInfo | None = None,
        parallel: ParallelConfig | None = None,
        train: TrainConfig | None = None,
        moe: MoEMap | None = None,
    ):
        super().__init__(info or DistInfo(0, 1, 0, next(model.parameters()).device), parallel, train, moe)
        self._plain = model.to(self.info.device)
        self.optimizer = make_optimizer(self._plain)

    @property
    def model(self) -> torch.nn.Module:
        return self._plain

    @property
    def unwrapped(self) -> torch.nn.Module:
        return self._plain

    def backward(self, loss: torch.Tensor) -> None:
        self.scaled(loss).backward()

    def frozen(self, model: torch.nn.Module) -> FrozenModel:
        # A replica per rank (DDP too): a model without gradients has nothing to synchronise.
        model = model.requires_grad_(False).eval().to(self.info.device)
        return FrozenModel(model, model, self.traits.fuses_output_layer)

    def step(self, lr: float, max_grad_norm: float) -> torch.Tensor | float:
        return self._clipped_step(self._plain.parameters(), lr, max_grad_norm)

    def save_state(self, directory: Path) -> None:
        # Frozen weights (a LoRA base) are rebuilt identically at start; only what trains is saved.
        if self.info.is_main:
            trainable = {n: p.detach().cpu() for n, p in self.unwrapped.named_parameters() if p.requires_grad}
            torch.save({"model": trainable, "optimizer": self.optimizer.state_dict()}, directory / "engine.pt")
            if self.scaler is not None:
                self.scaler.save(directory)

    def load_state(self, directory: Path) -> None:
        state = load_data_only(directory / "engine.pt", self.info.device)
        parameters = dict(self.unwrapped.named_parameters())
        missing = sorted(set(state["model"]) - set(parameters))
        if missing:
            raise ValueError(f"resume: the checkpoint has parameters this model lacks: {missing[:3]}")
        with torch.no_grad():
            for name, tensor in state["model"].items():
                parameters[name].copy_(tensor)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None:
            self.scaler.load(directory)


def load_data_only(path: Path, device: torch.device) -> Any:
    """`torch.load` with the weights-only unpickler; a file that holds more than tensors and plain data (a pickle
    naming other callables: code that would run) is refused with one message naming it, never with torch's advice
    to load it unsafely."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(
            f"--resume: {path} holds more than tensors and plain data (the Python objects it names would run code "
            "when loaded); tuneforge does not load files that could run code. This checkpoint was not written by "
            "tuneforge as it is: take another checkpoint (--resume PATH), or start afresh"
        ) from None
