"""DeepSpeed ZeRO stages 0-3 with optional CPU offload, driven with the same semantics as the other engines.

The DeepSpeed JSON is generated from our config (a user's JSON can be merged over it). Under ZeRO-3
every MoE block class is registered as a leaf module, so a block's experts are fetched together
whichever experts receive tokens: without it, ranks whose tokens reach different experts issue
different parameter all-gathers and wait for each other forever (the hang of the original report).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tuneforge.config.schema import Config, ParallelConfig, TrainConfig
from tuneforge.distributed import DistInfo
from tuneforge.engines.base import Engine, EngineTraits, FrozenModel, OptimizerFactory
from tuneforge.engines.expert_parallel import (
    autoep_section,
    expert_parallel_problems,
    expert_parallel_routers,
    hugging_face_state_dict,
    without_router_logit_recorders,
)
from tuneforge.errors import SharedUserError, UserError
from tuneforge.model.moe import MoEMap
from tuneforge.model.router_balance import RouterBalance
from tuneforge.model.structure import decoder_layers
from tuneforge.pickle_guard import refuse_unsafe_pickles

DEEPSPEED_RECORD_TYPES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""Besides tensors and containers, what DeepSpeed pickles into its checkpoint files: its loss scaler's settings,
enums and ZeRO-1/2's parameter slice addresses (plain attributes, restored without calling code)."""


def _deepspeed_record_type(name: str) -> bool:
    return name in DEEPSPEED_RECORD_TYPES


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
        extra, problem = read_user_config(parallel)
        if problem:
            raise UserError(problem)
        config = _merge(config, extra)
    return config


def read_user_config(parallel: ParallelConfig) -> tuple[dict[str, Any], str]:
    """`parallel.deepspeed_config`'s JSON object, or what is wrong with the file ("" when nothing)."""
    path = Path(parallel.deepspeed_config)
    try:
        merged = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return {}, f"parallel.deepspeed_config: cannot read {path} ({exc})"
    if not isinstance(merged, dict):
        return {}, f"parallel.deepspeed_config: {path} holds no JSON object"
    return merged, ""


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


def skip_inference_only_kernels() -> None:
    """DeepSpeed's communication backend compiles a shared-memory all-reduce the first time it starts on a CPU
    machine (40-50 s on 2 cores, again for each new environment path). Only DeepSpeed inference's
    `inference_all_reduce` uses it; training never does. Marked unbuildable in DeepSpeed's table of compatible ops
    (a table it keeps editable for this), the backend keeps torch.distributed's all-reduce, as where the build
    cannot run."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _load_trainable_weights(src: dict[str, torch.Tensor], dst: torch.nn.Module) -> None:
    """The module part of a DeepSpeed checkpoint, for what trains. Frozen weights are rebuilt identically when the
    run starts, and a quantized base saves state (bitsandbytes' absmax, quant_map...) that `load_state_dict` does
    not take back; ZeRO 1-3 then restore the trainable weights from their fp32 partitions anyway."""
    trainable = [name for name, param in dst.named_parameters() if param.requires_grad]
    missing = [name for name in trainable if name not in src]
    if missing:
        raise ValueError(f"resume: the DeepSpeed checkpoint lacks trainable weights {missing[:3]}")
    dst.load_state_dict({name: src[name] for name in trainable}, strict=False)


class DeepSpeedEngine(Engine):
    scales_fp16_loss = False  # DeepSpeed's own scaler, with the same settings (`fp16_config`)

    shards_experts = True

    @classmethod
    def setting_problems(cls, parallel: ParallelConfig) -> list[str]:
        problems = []
        if parallel.cpu_offload == "all" and parallel.zero_stage != 3:
            problems.append("parameter offload needs ZeRO-3: set parallel.zero_stage=3 or cpu_offload=optimizer")
        if parallel.expert_parallel > 1:
            # What tuneforge runs and checkpoints under AutoEP; the rest of AutoEP's matrix is not tested here.
            if parallel.zero_stage == 3:
                problems.append(
                    "parallel.expert_parallel runs with ZeRO 0-2 (the experts are already sharded; ZeRO-3's "
                    "partitioned experts cannot be written as a Hugging Face checkpoint): set parallel.zero_stage=2"
                )
            if parallel.cpu_offload != "none":
                problems.append("parallel.expert_parallel runs without offload: set parallel.cpu_offload=none")
            if parallel.sequence_parallel > 1:
                problems.append("parallel.expert_parallel and parallel.sequence_parallel cannot be combined yet")
        return problems

    @classmethod
    def model_problems(cls, cfg: Config, read_config: Callable[[], Any], world_size: int) -> tuple[list[str], str]:
        if cfg.parallel.expert_parallel == 1:
            return [], ""
        return expert_parallel_problems(cfg, read_config(), world_size)  # AutoEP's presets and sizes

    @classmethod
    def input_problems(cls, parallel: ParallelConfig) -> list[str]:
        # The file is merged once the model is built: one that is not a JSON object is said before anything runs.
        problem = read_user_config(parallel)[1] if parallel.deepspeed_config else ""
        return [problem] if problem else []

    def keep_router_balance(self, balance: RouterBalance) -> None:
        if self.expert_parallel > 1:
            balance.rehook(expert_parallel_routers(self.unwrapped))  # AutoEP replaced the MoE blocks

    @classmethod
    def traits_for(cls, parallel: ParallelConfig, train: TrainConfig, device: str = "cuda") -> EngineTraits:
        stage = parallel.zero_stage
        return EngineTraits(
            name="deepspeed",
            label=f"deepspeed ZeRO-{stage}",
            shard_stage=stage,
            casts_parameters=train.precision == "fp16" or (train.precision == "bf16" and device == "cuda"),
            reduces_every_micro_batch=True,
            # ZeRO-3 partitions the output layer again as soon as its forward ends: the loss uses the logits.
            fuses_output_layer=stage < 3,
            # DeepSpeed applies a bf16/fp32 step whatever the gradients; it skips overflowing steps only under fp16.
            skips_nonfinite=train.precision == "fp16",
            compiles=False,
            moe_safety="gathered whole as ZeRO-3 leaf modules" if stage == 3 and parallel.moe_safety else "",
        )

    def __init__(
        self,
        model: torch.nn.Module,
        make_optimizer: OptimizerFactory,
        info: DistInfo,
        parallel: ParallelConfig,
        train: TrainConfig,
        moe: MoEMap | None = None,
    ):
        import deepspeed

        super().__init__(info, parallel, train, moe)
        skip_inference_only_kernels()
        self.fp16 = train.precision == "fp16"
        """DeepSpeed's own fp16 loss scaler runs (and skips the steps whose gradients overflow)."""
        bf16 = train.precision == "bf16" and info.device.type == "cuda"
        self.config = deepspeed_config(parallel, train, info.world_size, bf16)
        self.expert_parallel = parallel.expert_parallel
        if self.expert_parallel > 1:
            # Keys of AutoEP's own from parallel.deepspeed_config (use_grouped_mm, ...) are kept over ours.
            ours = autoep_section(self.expert_parallel, model.config.model_type)
            self.config["expert_parallel"] = {**ours, **self.config.get("expert_parallel", {})}
        self._check_overrides(parallel, train)
        self._offloads_parameters = parallel.cpu_offload == "all"
        model = self._placed(model)
        optimizer = make_optimizer(model)
        parameters = None
        if self.expert_parallel > 1:
            # AutoEP replaces the MoE blocks inside initialize, after the optimizer exists: DeepSpeed re-points
            # the groups' parameters at the new experts, and the optimizer is then built again from them, with
            # the experts in groups of their own (ZeRO reduces them over the expert-data-parallel ranks only).
            if without_router_logit_recorders(model) and info.is_main:
                print(
                    "expert parallelism: the model's output_router_logits turned off (tuneforge computes the router "
                    "balance loss from AutoEP's routers); the checkpoints' config.json says false"
                )
            parameters = [{**group, "name": f"group-{i}"} for i, group in enumerate(optimizer.param_groups)]
            optimizer = _rebuilt_with_expert_groups(type(optimizer), optimizer.defaults)
            self._hugging_face_names = list(model.state_dict())  # what the gathered checkpoints must hold
        self._engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=parameters,
            config=self.config,
            dist_init_required=False,
        )

    def _check_overrides(self, parallel: ParallelConfig, train: TrainConfig) -> None:
        """Settings the run relies on must come from our config, where the doctor and the loop see them; and
        DeepSpeed's own refusals, said in our terms before it raises them. Every rank finds the same, so rank 0
        alone says it."""
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        if train.precision == "fp16" and not accelerator.is_fp16_supported():
            raise SharedUserError(
                f"train.precision=fp16: DeepSpeed's {accelerator.device_name()} accelerator has no fp16 on this "
                "machine (on CPU it needs fp16 support in oneDNN); use train.precision=bf16 or fp32, or "
                "parallel.engine=fsdp, which scales fp16 losses itself"
            )
        merged_stage = self.config["zero_optimization"].get("stage", parallel.zero_stage)
        if merged_stage != parallel.zero_stage:
            raise SharedUserError(
                f"parallel.deepspeed_config sets zero_optimization.stage={merged_stage}; set parallel.zero_stage "
                "instead (the doctor, the MoE safety and checkpoints follow it)"
            )
        merged_experts = self.config.get("expert_parallel", {})
        if merged_experts.get("enabled") and (
            parallel.expert_parallel == 1 or merged_experts.get("autoep_size") != parallel.expert_parallel
        ):
            raise SharedUserError(
                "parallel.deepspeed_config sets expert_parallel; set parallel.expert_parallel instead (the run "
                "checks the model for it, builds the optimizer's expert groups and gathers experts on save)"
            )
        if self.config["gradient_clipping"] != train.max_grad_norm:
            raise SharedUserError(
                f"parallel.deepspeed_config sets gradient_clipping={self.config['gradient_clipping']}; set "
                "train.max_grad_norm instead"
            )

    def _placed(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` made ready for `deepspeed.initialize`: under ZeRO-3 its MoE blocks are gathered whole (leaf
        modules, see the module's docstring); on the device unless its parameters are offloaded."""
        import deepspeed

        if self.traits.moe_safety and self.moe:
            deepspeed.utils.set_z3_leaf_modules(model, self.moe.block_classes)
        return model if self._offloads_parameters else model.to(self.info.device)

    def frozen(self, model: torch.nn.Module) -> FrozenModel:
        import deepspeed

        # DeepSpeed without an optimizer, as it runs inference: it casts the copy exactly as it cast the policy
        # (parameters, not buffers) and, under ZeRO-3, partitions it (offloaded like the policy's) and gathers
        # each module's parameters for its forward. Below ZeRO-3 there is nothing to shard without gradients or
        # optimizer state: stage 0, a replica.
        zero = {"stage": 0}
        if self.traits.sharded:
            zero = {k: v for k, v in self.config["zero_optimization"].items() if k != "offload_optimizer"}
        training_only = ("optimizer", "scheduler", "expert_parallel", "zero_optimization")
        config = {key: value for key, value in self.config.items() if key not in training_only}
        config["zero_optimization"] = zero
        model = self._placed(model.requires_grad_(False).eval())
        wrapped, *_ = deepspeed.initialize(model=model, config=config, dist_init_required=False)
        wrapped.eval()
        return FrozenModel(wrapped, wrapped.module, self.traits.fuses_output_layer)

    @property
    def model(self) -> torch.nn.Module:
        return self._engine

    @property
    def unwrapped(self) -> torch.nn.Module:
        return self._engine.module

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
        if not self.fp16:
            return None
        return float(self.optimizer.cur_scale)

    def step(self, lr: float, max_grad_norm: float) -> float:
        # DeepSpeed clips inside its own step, to the `gradient_clipping` it was built with.
        if max_grad_norm != self.config["gradient_clipping"]:
            raise ValueError(
                f"DeepSpeed clips to gradient_clipping={self.config['gradient_clipping']} from its config; "
                f"a step cannot ask for {max_grad_norm}"
            )
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # a part with its own rate (optim.LR_SCALE)
        self._engine.step()
        if self.fp16 and getattr(self.optimizer, "overflow", False):
            return float("inf")
        norm = self._engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def save_state(self, directory: Path) -> None:
        # DeepSpeed's own format: ZeRO partitions and optimizer shards, one file set per rank. A write that
        # fails on one rank is held until save_checkpoint returns: raised at once, it would leave that rank out
        # of the gathers and barriers DeepSpeed runs between its writes, and the others waiting in them.
        writer = HeldWriteErrors(self._engine.checkpoint_engine)
        self._engine.checkpoint_engine = writer
        # Rank 0 also copies DeepSpeed's recovery scripts (zero_to_fp32.py) beside its files, with a plain file
        # copy outside the checkpoint engine: held the same way for this save (an instance attribute over the
        # method, removed after).
        self._engine._copy_recovery_script = writer.held(self._engine._copy_recovery_script)
        try:
            self._engine.save_checkpoint(str(directory), tag="deepspeed", save_latest=False)
        finally:
            self._engine.checkpoint_engine = writer.inner
            del self._engine._copy_recovery_script
        writer.raise_first()

    def load_state(self, directory: Path) -> None:
        # DeepSpeed unpickles its files with torch.load(weights_only=False): they are scanned first.
        refuse_unsafe_pickles(
            sorted((directory / "deepspeed").glob("*.pt")), _deepspeed_record_type, f"--resume {directory}"
        )
        path, _ = self._engine.load_checkpoint(
            str(directory),
            tag="deepspeed",
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
            custom_load_fn=_load_trainable_weights,
        )
        if path is None:
            raise ValueError(f"resume: DeepSpeed found no checkpoint in {directory}")

    @property
    def generates_in_lockstep(self) -> bool:
        # Under expert parallelism every MoE forward exchanges tokens with the group's other ranks.
        return super().generates_in_lockstep or self.expert_parallel > 1

    def whole(self, unit: torch.nn.Module) -> contextlib.AbstractContextManager:
        if not self.traits.sharded:
            return contextlib.nullcontext()
        import deepspeed

        if any(unit is layer for layer in self._decoder_layers):
            parameters = list(unit.parameters())
        else:  # the root: what is outside the decoder layers, which are gathered one by one
            inside = {id(p) for p in self._decoder_layers.parameters()}
            parameters = [p for p in unit.parameters() if id(p) not in inside]
        return deepspeed.zero.GatheredParameters(parameters, modifier_rank=None)

    @functools.cached_property
    def _decoder_layers(self) -> torch.nn.ModuleList:
        # Found once: `whole` is entered for every unit of every rollout, and the search walks the whole model.
        return decoder_layers(self.unwrapped)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        if self.expert_parallel > 1:
            from deepspeed.utils import groups

            group = groups._get_expert_parallel_group(f"ep_size_{self.expert_parallel}")
            return hugging_face_state_dict(self._engine.module, group, self.info.is_main, self._hugging_face_names)
        if not self.traits.sharded:
            return None
        state = self._engine._zero3_consolidated_16bit_state_dict()  # collective: all ranks take part
        return state if self.info.is_main else None


def _rebuilt_with_expert_groups(
    optimizer_class: type[torch.optim.Optimizer], defaults: dict[str, Any]
) -> Callable[[list[dict[str, Any]]], torch.optim.Optimizer]:
    # Every group carries its own settings; the constructor's defaults fill what a new group lacks (and some
    # optimizers keep more in `defaults` than their constructor takes).
    accepted = inspect.signature(optimizer_class).parameters
    settings = {key: value for key, value in defaults.items() if key in accepted}

    def build(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        from deepspeed.moe.utils import configure_moe_param_groups

        return optimizer_class(configure_moe_param_groups(groups), **settings)

    return build


class HeldWriteErrors:
    """DeepSpeed's checkpoint engine with its file writes' errors held instead of raised (the file is left
    unwritten); everything else goes to the engine as it is."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.errors: list[Exception] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def held(self, write: Callable[..., None]) -> Callable[..., None]:
        """`write` with its error held: skipped once the disk has failed this rank (later files would fail the
        same way), its own error kept for the caller's vote with the other ranks' faults."""

        def holding(*args: Any, **kwargs: Any) -> None:
            if self.errors:
                return
            try:
                write(*args, **kwargs)
            except Exception as exc:
                self.errors.append(exc)

        return holding

    def save(self, state_dict: Any, path: str) -> None:
        self.held(self.inner.save)(state_dict, path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.held(self.inner.makedirs)(path, exist_ok=exist_ok)

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]
