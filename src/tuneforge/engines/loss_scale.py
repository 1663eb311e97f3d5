"""fp16 loss scaling for the engines that own their optimizer step (single, DDP, FSDP2).

fp16 has five exponent bits: small gradients underflow to zero unless the loss is multiplied by a large
factor before backward and the gradients divided by it afterwards. Too large a factor overflows instead;
dynamic scaling halves it on every overflowing step (which is skipped) and doubles it again after a
window of clean steps. DeepSpeed brings its own scaler; the same settings are handed to it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from tuneforge.config.schema import TrainConfig


class LossScaler:
    def __init__(
        self, initial: float = 2.0**16, window: int = 1000, dynamic: bool = True, min_scale: float = 1.0
    ) -> None:
        self.scale = float(initial)
        self.window = window
        self.dynamic = dynamic
        self.min_scale = min_scale
        self.clean_steps = 0
        """Steps in a row without overflow since the scale last changed."""
        self.overflows = 0
        """Overflowing (skipped) steps in this run so far."""

    @classmethod
    def for_config(cls, train: TrainConfig) -> LossScaler | None:
        """The scaler `train` asks for: dynamic unless `loss_scale` fixes it; None without fp16."""
        if train.precision != "fp16":
            return None
        return cls(train.loss_scale or train.initial_loss_scale, train.loss_scale_window, train.loss_scale is None)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Divide the gradients by the scale in place (sharded DTensor gradients too: an elementwise op)."""
        inverse = 1.0 / self.scale
        for parameter in parameters:
            if parameter.grad is not None:
                parameter.grad.mul_(inverse)

    def update(self, finite: bool) -> None:
        if not finite:
            self.overflows += 1
            self.clean_steps = 0
            if self.dynamic:
                self.scale = max(self.scale / 2, self.min_scale)
            return
        self.clean_steps += 1
        if self.dynamic and self.clean_steps >= self.window:
            self.scale *= 2
            self.clean_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.overflows = int(state["overflows"])

    def save(self, directory: Path) -> None:
        """Identical on every rank: the main rank writes it."""
        (directory / SCALER_FILE).write_text(json.dumps(self.state_dict()))

    def load(self, directory: Path) -> None:
        self.load_state_dict(json.loads((directory / SCALER_FILE).read_text()))


SCALER_FILE = "loss_scale.json"
