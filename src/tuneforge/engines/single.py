"""One process, no collectives."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from tuneforge.distributed import DistInfo
from tuneforge.engines.loss_scale import LossScaler


def global_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> float:
    """The gradients' global norm before clipping; clipped to `max_norm` (0: not clipped) when finite. Works on
    sharded (DTensor) gradients too: the norm is then a collective."""
    with_grads = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in with_grads])
    norm = float(total.full_tensor() if isinstance(total, DTensor) else total)
    if max_norm > 0 and math.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, total)
    return norm


def apply_step(optimizer: torch.optim.Optimizer, norm: float, lr: float) -> None:
    """Step unless the gradients are not finite: a skipped step leaves weights and optimizer moments as they
    were (the loop reports it and stops after too many in a row)."""
    if math.isfinite(norm):
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def scaled_step(engine, optimizer, parameters, lr: float, max_grad_norm: float) -> float:
    """Unscale fp16 gradients (when scaling), clip, step unless not finite, then let the scaler adapt."""
    scaler: LossScaler | None = engine.scaler
    if scaler is not None:
        scaler.unscale_(parameters)
    norm = engine.clip_grad_norm(max_grad_norm)
    apply_step(optimizer, norm, lr)
    if scaler is not None:
        scaler.update(math.isfinite(norm))
    return norm


class SingleEngine:
    name = "single"
    sharded = False
    skips_nonfinite = True

    def __init__(
        self,
        model: torch.nn.Module,
        make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
        info: DistInfo | None = None,
        scaler: LossScaler | None = None,
    ):
        info = info or DistInfo(0, 1, 0, next(model.parameters()).device)
        self.info = info
        self.scaler = scaler
        self._model = model.to(info.device)
        self.optimizer = make_optimizer(self._model)

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def unwrapped(self) -> torch.nn.Module:
        return self._model

    def sum_across_ranks(self, values: list[float]) -> list[float]:
        return list(values)

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @property
    def loss_scale(self) -> float | None:
        return self.scaler.scale if self.scaler is not None else None

    def backward(self, loss: torch.Tensor) -> None:
        self._scaled(loss).backward()

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scaled(loss) if self.scaler is not None else loss

    def clip_grad_norm(self, max_norm: float) -> float:
        return global_grad_norm(list(self._model.parameters()), max_norm)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return None

    def save_state(self, directory: Path) -> None:
        # Frozen weights (a LoRA base) are rebuilt identically at start; only what trains is saved.
        if self.info.is_main:
            trainable = {n: p.detach().cpu() for n, p in self.unwrapped.named_parameters() if p.requires_grad}
            torch.save({"model": trainable, "optimizer": self.optimizer.state_dict()}, directory / "engine.pt")
            if self.scaler is not None:
                self.scaler.save(directory)

    def load_state(self, directory: Path) -> None:
        state = torch.load(directory / "engine.pt", map_location=self.info.device, weights_only=True)
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

    def step(self, lr: float, max_grad_norm: float) -> float:
        return scaled_step(self, self.optimizer, self.unwrapped.parameters(), lr, max_grad_norm)
