"""Memory per GPU and time per optimizer step of a training job, from the model's shapes and the config.

A sizing estimate, not a measurement: every figure is parameter shapes times a few named assumptions, and the
assumptions are printed with the result. It says which set-up fits and roughly how fast, not what a profiler
would show. The model is a skeleton on the meta device, so nothing is downloaded or allocated. What the engine
does (sharding, casting, where the loss runs) comes from its `EngineTraits`.

- `hardware`: the accelerator table (also the step log's MFU peaks);
- `shapes`: parameters and activations by kind, from the skeleton and its MoE map; `vision`: a
  vision-language model's tower, projector and images;
- `memory`: bytes per GPU and per node; `timing`: seconds per step; `report`: the record and its table.
"""

from __future__ import annotations

import math

from torch import nn

from tuneforge.config.schema import Config
from tuneforge.engines.base import EngineTraits
from tuneforge.estimate.hardware import ACCELERATORS, GIB, Accelerator, local_accelerator
from tuneforge.estimate.memory import memory_use
from tuneforge.estimate.report import Estimate, assumptions, format_estimate, vision_line
from tuneforge.estimate.shapes import model_shapes, row_label, row_tokens
from tuneforge.estimate.timing import reference_pass_seconds, step_times
from tuneforge.model.moe import MoEMap
from tuneforge.model.precision import choose_precision, with_precision
from tuneforge.model.quantize import kbit_bytes


def estimate(
    cfg: Config,
    skeleton: nn.Module,
    traits: EngineTraits,
    world_size: int,
    accelerator: Accelerator,
    moe: MoEMap,
    gpus_per_node: int | None = None,
    num_samples: int | None = None,
) -> Estimate:
    """Memory per GPU (and host RAM per node) and time per optimizer step for `cfg` on `world_size` ranks of
    the engine with `traits`. `moe`: the skeleton's MoE map."""
    cfg = with_precision(cfg, choose_precision(cfg.train.precision, on_gpu=True)[0])  # the GPUs named compute bf16
    par, train, quantization = cfg.parallel, cfg.train, cfg.model.quantization
    per_node = min(gpus_per_node or world_size, world_size)
    compute_bytes = 2 if train.precision in ("bf16", "fp16") else 4
    kbit = kbit_bytes(quantization.bits, quantization.double_quant) if quantization is not None else 0.0
    s = model_shapes(cfg, skeleton, moe, compute_bytes)
    memory = memory_use(cfg, s, traits, world_size, per_node, compute_bytes, kbit, accelerator.memory_gib * GIB)
    tokens_micro = train.micro_batch_size * row_tokens(cfg)
    groups = world_size // par.sequence_parallel  # a sequence-parallel group of ranks shares its rows
    tokens_step = groups * train.gradient_accumulation * tokens_micro
    ranks = f"{groups} ranks" if par.sequence_parallel == 1 else f"{groups} groups of {par.sequence_parallel} ranks"
    tokens_note = (
        f"{ranks} x {train.gradient_accumulation} micro-batches x {train.micro_batch_size} x "
        f"{row_label(cfg)} tokens" + ("" if cfg.data.packing else "; without packing an upper bound")
    )
    times, step_s = step_times(
        cfg, s, traits, world_size, per_node, accelerator, kbit, compute_bytes, memory.trainable_bytes
    )
    if train.max_steps is not None:
        steps = train.max_steps
    elif num_samples:
        steps = math.ceil(num_samples / (groups * train.micro_batch_size * train.gradient_accumulation))
        steps *= train.epochs
    else:
        steps = None
    before_training = None
    if cfg.objective.reference_pass(cfg) and num_samples:
        seconds = reference_pass_seconds(cfg, s, accelerator, math.ceil(num_samples / groups))
        what = f"the reference's log-probabilities of {num_samples:,} pairs (one forward pass, rows counted full)"
        before_training = (what, seconds)
    offload = "" if par.cpu_offload == "none" else f", cpu_offload={par.cpu_offload}"
    return Estimate(
        accelerator=accelerator,
        setup=f"{world_size} x {accelerator.name}, {traits.label}{offload}",
        rows=memory.rows,
        load_gpu=memory.load_gpu,
        load_host=memory.load_host,
        tokens_per_step=tokens_step,
        tokens_note=tokens_note,
        times=times,
        step_s=step_s,
        steps=steps,
        activation_factor=s.act_total * compute_bytes / s.hidden / s.layers,
        assumptions=assumptions(cfg, traits, s),
        before_training=before_training,
        vision=vision_line(s),
    )


__all__ = ["ACCELERATORS", "GIB", "Accelerator", "Estimate", "estimate", "format_estimate", "local_accelerator"]
