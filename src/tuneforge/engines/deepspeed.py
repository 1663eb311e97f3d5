"""DeepSpeed ZeRO stages 0-3 with optional CPU offload, driven with the same semantics as the other engines.

The DeepSpeed JSON is generated from our config (a user's JSON can be merged over it). Under ZeRO-3
every MoE block class is registered as a leaf module, so a block's experts are fetched together
whichever experts receive tokens: without it, ranks whose tokens reach different experts issue
different parameter all-gathers and wait for each other forever (the hang of the original report).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tuneforge.config.schema import ParallelConfig, TrainConfig
from tuneforge.distributed import DistInfo, all_reduce_sum
from tuneforge.errors import UserError
from tuneforge.model.moe import find_moe_blocks


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = (
            _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


def deepspeed_config(parallel: ParallelConfig, train: TrainConfig, world_size: int, bf16: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": parallel.zero_stage}
    if parallel.cpu_offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if parallel.cpu_offload == "all":
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if parallel.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation,
        "train_batch_size": train.micro_batch_size * train.gradient_accumulation * world_size,
        "gradient_clipping": train.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "fp16": fp16_config(train),
        # Our AdamW runs on the CPU-held state when offloading (DeepSpeed's CPU Adam is faster on GPU hosts).
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if parallel.deepspeed_config:
        path = Path(parallel.deepspeed_config)
        try:
            extra = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"parallel.deepspeed_config: cannot read {path} ({exc})") from None
        config = _merge(config, extra)
    return config


def fp16_config(train: TrainConfig) -> dict[str, Any]:
    if train.precision != "fp16":
        return {"enabled": False}
    return {
        "enabled": True,
        "loss_scale": train.loss_scale or 0,  # 0: dynamic
        "initial_scale_power": round(math.log2(train.initial_loss_scale)),
        "loss_scale_window": train.loss_scale_window,
        "hysteresis": 1,  # halve at the first overflow, as the other engines do
        "min_loss_scale": 1,
    }


class DeepSpeedEngine:
    name = "deepspeed"

    def __init__(
        self,
        model: torch.nn.Module,
        make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
        info: DistInfo,
        parallel: ParallelConfig,
        train: TrainConfig,
        bf16: bool,
    ):
        import deepspeed

        self.info = info
        self.sharded = parallel.zero_stage == 3
        # DeepSpeed applies a bf16/fp32 step whatever the gradients; it skips overflowing steps only under fp16.
        self.skips_nonfinite = train.precision == "fp16"
        blocks = find_moe_blocks(model)
        if self.sharded and blocks and parallel.moe_safety:
            deepspeed.utils.set_z3_leaf_modules(model, sorted({type(b.module) for b in blocks}, key=str))
        if parallel.cpu_offload != "all":
            model = model.to(info.device)
        self.config = deepspeed_config(parallel, train, info.world_size, bf16)
        self._engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=make_optimizer(model), config=self.config, dist_init_required=False
        )

    @property
    def model(self) -> torch.nn.Module:
        return self._engine

    @property
    def unwrapped(self) -> torch.nn.Module:
        return self._engine.module

    def sum_across_ranks(self, values: list[float]) -> list[float]:
        return all_reduce_sum(values, self.info)

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        # Our steps may take fewer micro-batches than `gradient_accumulation` (the end of an epoch).
        self._engine.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed averages over ranks; the loss is already normalised by the global target count and must
        # not be divided by the accumulation steps again.
        self._engine.backward(loss * self.info.world_size, scale_wrt_gas=False)

    @property
    def loss_scale(self) -> float | None:
        if not self.skips_nonfinite:
            return None
        return float(self.optimizer.cur_scale)

    def step(self, lr: float, max_grad_norm: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._engine.step()  # clips to `gradient_clipping` from the generated config
        if self.skips_nonfinite and getattr(self.optimizer, "overflow", False):
            return float("inf")
        norm = self._engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def save_state(self, directory: Path) -> None:
        # DeepSpeed's own format: ZeRO partitions and optimizer shards, one file set per rank.
        self._engine.save_checkpoint(str(directory), tag="deepspeed", save_latest=False)

    def load_state(self, directory: Path) -> None:
        path, _ = self._engine.load_checkpoint(
            str(directory), tag="deepspeed", load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise ValueError(f"resume: DeepSpeed found no checkpoint in {directory}")

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        if not self.sharded:
            return None
        state = self._engine._zero3_consolidated_16bit_state_dict()  # collective: all ranks take part
        return state if self.info.is_main else None
