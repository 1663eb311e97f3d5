"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded across ranks.

One FSDP unit per decoder layer plus the root. Nothing below a decoder layer is ever its own unit,
so an MoE block's experts are gathered with their layer whatever tokens they receive: every rank
issues the same all-gathers and reduce-scatters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from tuneforge.distributed import DistInfo, all_reduce_sum
from tuneforge.engines.loss_scale import LossScaler
from tuneforge.engines.single import global_grad_norm, scaled_step
from tuneforge.model.moe import find_moe_blocks
from tuneforge.model.structure import decoder_layers


class FSDPEngine:
    name = "fsdp"
    sharded = True
    skips_nonfinite = True

    def __init__(
        self,
        model: torch.nn.Module,
        make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
        info: DistInfo,
        cpu_offload: bool = False,
        bf16_params: bool = False,
        moe_safety: bool = True,
        scaler: LossScaler | None = None,
    ):
        self.info = info
        self.scaler = scaler
        mesh = init_device_mesh(info.device.type, (info.world_size,))
        options: dict = {"mesh": mesh}
        if bf16_params:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cpu_offload:
            # Pinned host memory speeds up copies to a GPU and does not exist without one.
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=info.device.type == "cuda")
        if not cpu_offload:
            model = model.to(info.device)
        # The root unit is the Hugging Face model itself, inside a PEFT wrapper if there is one: generation calls
        # that model's forward directly, and its hooks are what gather the root's parameters (the embeddings).
        root = model.get_base_model() if hasattr(model, "get_base_model") else model
        for layer in decoder_layers(root):
            fully_shard(layer, **options)
        fully_shard(root, **options)
        if moe_safety and find_moe_blocks(root):
            # Experts that receive no tokens on one rank have no gradient there: reduce zeros for them, so
            # every rank's reduce-scatter has the same size.
            root.set_reduce_scatter_unused_params(True)
        self._root = root
        self._model = model
        # Built after sharding: the optimizer must hold the sharded parameters.
        self.optimizer = make_optimizer(model)

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def unwrapped(self) -> torch.nn.Module:
        return self._model

    def sum_across_ranks(self, values: list[float]) -> list[float]:
        return all_reduce_sum(values, self.info)

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        self._root.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        # The reduce-scatter averages over ranks; the loss is already normalised by the global target count.
        scaled = self.scaler.scaled(loss) if self.scaler is not None else loss
        (scaled * self.info.world_size).backward()

    def clip_grad_norm(self, max_norm: float) -> float:
        return global_grad_norm(list(self._model.parameters()), max_norm)

    @property
    def loss_scale(self) -> float | None:
        return self.scaler.scale if self.scaler is not None else None

    def step(self, lr: float, max_grad_norm: float) -> float:
        return scaled_step(self, self.optimizer, self._model.parameters(), lr, max_grad_norm)

    def save_state(self, directory: Path) -> None:
        model_state, optimizer_state = get_state_dict(self._model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory / "fsdp"))
        if self.scaler is not None and self.info.is_main:
            self.scaler.save(directory)

    def load_state(self, directory: Path) -> None:
        model_state, optimizer_state = get_state_dict(self._model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(directory / "fsdp"))
        set_state_dict(
            self._model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        if self.scaler is not None:
            self.scaler.load(directory)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: every rank must call it. Rank 0 gets the whole model on CPU, the others None."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self._model, options=options)
        return state if self.info.is_main else None
