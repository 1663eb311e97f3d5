"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded across ranks.

One FSDP unit per decoder layer plus the root. Nothing below a decoder layer is ever its own unit,
so an MoE block's experts are gathered with their layer whatever tokens they receive: every rank
issues the same all-gathers and reduce-scatters.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from tuneforge.config.schema import ParallelConfig, TrainConfig
from tuneforge.distributed import DistInfo
from tuneforge.engines.base import Engine, EngineTraits, FrozenModel, OptimizerFactory
from tuneforge.errors import UserError, first_line
from tuneforge.model.moe import MoEMap
from tuneforge.model.structure import decoder_layers
from tuneforge.pickle_guard import refuse_unsafe_pickles


class DataOnlyLoadPlanner(DefaultLoadPlanner):
    """PyTorch's planner reads a checkpoint's non-tensor values (optimizer settings) with
    `torch.load(weights_only=False)`: each is first read with the weights-only loader, which refuses anything but
    data, and only then handed on."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as exc:  # UnpicklingError, and whatever a foreign value raises
            # Never torch's own text for a refused pickle: its advice is to load it with weights_only=False.
            reason = (
                "it names Python objects that would run code"
                if isinstance(exc, pickle.UnpicklingError)
                else first_line(exc)
            )
            raise UserError(
                f"--resume: a value of the FSDP checkpoint ({read_item.dest_index.fqn}) holds more than data "
                f"({reason}); tuneforge does not load files that could run code: take another checkpoint"
            ) from None
        value.seek(0)
        super().load_bytes(read_item, value)


def load_data_only(state: dict, checkpoint: Path) -> None:
    """`dcp.load` with `DataOnlyLoadPlanner`; the refusal it raises (wrapped by DCP in a CheckpointException, a
    BaseException) comes out as itself, any other failure as a RuntimeError naming its first cause."""
    try:
        dcp.load(state, checkpoint_id=str(checkpoint), planner=DataOnlyLoadPlanner())
    except CheckpointException as exc:
        causes = [f[0] if isinstance(f, tuple) and f else f for f in exc.failures.values()]
        for cause in causes:
            if isinstance(cause, UserError):
                raise cause from None
        first = first_line(causes[0], 300) if causes else ""
        raise RuntimeError(f"the distributed checkpoint {checkpoint} cannot be read ({first})") from None


DCP_METADATA_TYPES = {
    f"torch.distributed.checkpoint.metadata.{name}"
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {"torch.distributed.checkpoint.filesystem._StorageInfo", "pathlib.PosixPath", "pathlib.WindowsPath"}


def _dcp_metadata_type(name: str) -> bool:
    """The record types of a distributed checkpoint's `.metadata`, and the path type its storage info holds:
    those classes by name (the module also holds modules and functions, which a pickle could reach)."""
    return name in DCP_METADATA_TYPES


class FSDPEngine(Engine):
    @classmethod
    def setting_problems(cls, parallel: ParallelConfig) -> list[str]:
        if parallel.cpu_offload == "optimizer":
            return ["FSDP2 offloads all state or none: use parallel.cpu_offload=all with fsdp"]
        return []

    @classmethod
    def traits_for(cls, parallel: ParallelConfig, train: TrainConfig, device: str = "cuda") -> EngineTraits:
        return EngineTraits(
            name="fsdp",
            label="fsdp (FSDP2)",
            shard_stage=3,
            casts_parameters=False,
            reduces_every_micro_batch=False,
            # The output layer belongs to the root unit, which FSDP2 keeps unsharded from forward to backward.
            fuses_output_layer=True,
            skips_nonfinite=True,
            compiles=False,
            moe_safety="gathered whole inside their decoder layer's FSDP unit, zero gradients reduced for idle experts"
            if parallel.moe_safety
            else "",
        )

    def __init__(
        self,
        model: torch.nn.Module,
        make_optimizer: OptimizerFactory,
        info: DistInfo,
        parallel: ParallelConfig | None = None,
        train: TrainConfig | None = None,
        moe: MoEMap | None = None,
    ):
        super().__init__(info, parallel, train, moe)
        parallel, train = parallel or ParallelConfig(), train or TrainConfig(precision="fp32")
        self._options: dict = {"mesh": init_device_mesh(info.device.type, (info.world_size,))}
        # bf16 parameters pay off on GPUs; on CPU, autocast does the bf16 compute with fp32 weights.
        if train.precision == "bf16" and info.device.type == "cuda":
            self._options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if parallel.cpu_offload == "all":
            # Pinned host memory speeds up copies to a GPU and does not exist without one.
            self._options["offload_policy"] = CPUOffloadPolicy(pin_memory=info.device.type == "cuda")
        root = self._shard(model)
        if self.traits.moe_safety and self.moe:
            # Experts that receive no tokens on one rank have no gradient there: reduce zeros for them, so
            # every rank's reduce-scatter has the same size.
            root.set_reduce_scatter_unused_params(True)
        self._root = root
        self._model = model
        # Built after sharding: the optimizer must hold the sharded parameters.
        self.optimizer = make_optimizer(model)

    def _shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` sharded in units of one decoder layer plus the root; returns the root unit. The root is the
        Hugging Face model itself, inside a PEFT wrapper if there is one: generation calls that model's forward
        directly, and its hooks are what gather the root's parameters (the embeddings)."""
        if "offload_policy" not in self._options:
            model.to(self.info.device)
        root = model.get_base_model() if hasattr(model, "get_base_model") else model
        for layer in decoder_layers(root):
            fully_shard(layer, **self._options)
        fully_shard(root, **self._options)
        return root

    def frozen(self, model: torch.nn.Module) -> FrozenModel:
        root = self._shard(model.requires_grad_(False).eval())
        # The root unit stays gathered after its forward (FSDP2 expects the backward to need it at once); with
        # no backward to come, it is sharded again once the reference's log-probs are read.
        return FrozenModel(root, root, fuses_output_layer=True, release=root.reshard)

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @contextlib.contextmanager
    def whole(self, unit: torch.nn.Module):
        # Every decoder layer and the root are FSDP units; the root's own group is what lies outside the layers.
        unit.unshard()
        try:
            yield
        finally:
            unit.reshard()

    @property
    def unwrapped(self) -> torch.nn.Module:
        return self._model

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        self._root.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        # The reduce-scatter averages over ranks; the loss is already normalised by the global target count.
        (self.scaled(loss) * self.info.world_size).backward()

    def step(self, lr: float, max_grad_norm: float) -> torch.Tensor | float:
        # The norm of sharded (DTensor) gradients is a collective: every rank computes the same.
        return self._clipped_step(self._model.parameters(), lr, max_grad_norm)

    def save_state(self, directory: Path) -> None:
        model_state, optimizer_state = get_state_dict(self._model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory / "fsdp"))
        if self.scaler is not None and self.info.is_main:
            self.scaler.save(directory)

    def load_state(self, directory: Path) -> None:
        # PyTorch reads the checkpoint's `.metadata` with pickle.load (its tensors with weights_only=True).
        refuse_unsafe_pickles(
            [directory / "fsdp" / ".metadata"], _dcp_metadata_type, f"--resume {directory}", single_pickle=True
        )
        model_state, optimizer_state = get_state_dict(self._model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        load_data_only(state, directory / "fsdp")
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
