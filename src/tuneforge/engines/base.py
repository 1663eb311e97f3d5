"""The narrow protocol between the training loop and how the work is spread over processes.

The loop calls only these methods, in the same order on every rank, and never asks which engine
it has. That is what keeps every rank issuing the same collectives.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Protocol

import torch

from tuneforge.distributed import DistInfo


class Engine(Protocol):
    name: str
    info: DistInfo
    sharded: bool
    """Parameters live in pieces across ranks: every forward is a collective, so generation runs in lockstep."""
    skips_nonfinite: bool
    """`step` leaves weights and optimizer state untouched when the gradient norm is not finite."""

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale; None without fp16 loss scaling."""
        ...

    @property
    def model(self) -> torch.nn.Module:
        """The module to call for training forward passes (possibly a wrapper)."""
        ...

    @property
    def unwrapped(self) -> torch.nn.Module:
        """The plain Hugging Face model, for generation and saving."""
        ...

    def sum_across_ranks(self, values: list[float]) -> list[float]:
        """Element-wise sums over all ranks (token counts, loss sums), in one collective."""
        ...

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        """Context of one micro-batch's forward and backward; gradients are synchronised only when `last`."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """`loss` is this rank's share of the global mean: its token-loss sum over the global target count.
        Under fp16 the engine multiplies it by its loss scale and `step` divides the gradients again."""
        ...

    def step(self, lr: float, max_grad_norm: float) -> float:
        """Clip the gradients to `max_grad_norm` (0: no clipping), apply them at learning rate `lr` (unless the
        norm is not finite, where `skips_nonfinite`), clear them. Returns the global norm before clipping."""
        ...

    def save_state(self, directory: Path) -> None:
        """Model and optimizer state for an exact resume, into `directory` (shared by all ranks). A collective
        for sharded engines: every rank calls it."""
        ...

    def load_state(self, directory: Path) -> None:
        """Restore what `save_state` wrote (same world size). Every rank calls it."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights for saving, on rank 0. A collective for sharded engines: every rank calls
        it. None from an unsharded engine means the unwrapped model's own weights are the whole model."""
        ...
