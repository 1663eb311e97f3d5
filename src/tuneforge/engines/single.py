"""One process, no collectives."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch

from tuneforge.distributed import DistInfo


def global_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> float:
    grads = [p for p in parameters if p.grad is not None]
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))
    return float(torch.nn.utils.get_total_norm([p.grad for p in grads]))


class SingleEngine:
    name = "single"
    sharded = False

    def __init__(
        self,
        model: torch.nn.Module,
        make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
        info: DistInfo | None = None,
    ):
        info = info or DistInfo(0, 1, 0, next(model.parameters()).device)
        self.info = info
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

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm(self, max_norm: float) -> float:
        return global_grad_norm(list(self._model.parameters()), max_norm)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return None

    def save_state(self, directory: Path) -> None:
        # Frozen weights (a LoRA base) are rebuilt identically at start; only what trains is saved.
        if self.info.is_main:
            trainable = {n: p.detach().cpu() for n, p in self.unwrapped.named_parameters() if p.requires_grad}
            torch.save({"model": trainable, "optimizer": self.optimizer.state_dict()}, directory / "engine.pt")

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

    def step(self, lr: float, max_grad_norm: float) -> float:
        norm = self.clip_grad_norm(max_grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm
