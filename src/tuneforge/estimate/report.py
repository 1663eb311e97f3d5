"""The estimate as one record, its assumptions in words, and the table `tuneforge doctor` prints."""

from __future__ import annotations

from dataclasses import dataclass

from tuneforge.config.schema import Config
from tuneforge.engines.base import EngineTraits
from tuneforge.estimate.hardware import GIB, Accelerator
from tuneforge.estimate.memory import CUDA_OVERHEAD_GIB, FUSED_LOGIT_BYTES, GATHERED_LAYERS, LOGITS_BYTES, Row
from tuneforge.estimate.shapes import ModelShapes, count_label
from tuneforge.estimate.timing import (
    BASE_MFU,
    CPU_ADAM_PARAMS_PER_S,
    DELTA_BYTES,
    DEQUANTIZE_BYTES,
    EXPERT_EFFICIENCY,
    GATHER_PASSES,
    NETWORK_BYTES_PER_S,
    NVLINK_BYTES_PER_S,
    PCIE_BYTES_PER_S,
    QUANTIZED_EFFICIENCY,
)


@dataclass(frozen=True)
class Estimate:
    accelerator: Accelerator
    setup: str
    rows: list[Row]
    load_gpu: float
    """Bytes on each GPU while loading: the model is whole there before the engine shards it."""
    load_host: float
    """Bytes of host RAM per node while loading (each rank reads the whole model)."""
    tokens_per_step: int
    tokens_note: str
    times: list[tuple[str, float, str]]
    """(what, seconds per optimizer step, how it was counted)."""
    step_s: float | None
    steps: int | None
    """Optimizer steps of the run, when the data size or `train.max_steps` is known."""
    activation_factor: float
    """Activation bytes a token keeps per decoder layer, in units of the hidden size."""
    assumptions: list[str]
    before_training: tuple[str, float] | None = None
    """Work done once before the first step, and its seconds (DPO's precomputed reference pass)."""
    vision: str | None = None
    """A vision-language model's parts and images, in words (None for a text model)."""

    @property
    def gpu_bytes(self) -> float:
        return sum(row.gpu for row in self.rows)

    @property
    def host_bytes(self) -> float:
        return sum(row.host for row in self.rows)

    @property
    def peak_gpu(self) -> float:
        return max(self.gpu_bytes, self.load_gpu)

    @property
    def fits(self) -> bool:
        return self.peak_gpu <= self.accelerator.memory_gib * GIB


STAGING_NOTES = {
    "auto": "onto the GPU where that fits 90% of its memory less 1 GiB (stage_experts=auto), else into host RAM "
    "(a copy per rank) and to the GPU one stack at a time",
    "device": "onto the GPU (stage_experts=device)",
    "host": "into host RAM (stage_experts=host, a copy per rank), to the GPU one stack at a time",
}


def assumptions(cfg: Config, traits: EngineTraits, s: ModelShapes) -> list[str]:
    slower = [f"routed-expert matmuls at x{EXPERT_EFFICIENCY}"] if s.active_routed else []
    slower += [f"k-bit ones at x{QUANTIZED_EFFICIENCY}"] if s.active_quantized else []
    notes = [
        f"compute at {BASE_MFU:.0%} of the bf16 peak (MFU)"
        + (f"; {', '.join(slower)} of that" if slower else "")
        + "; attention scores (s x s) not counted",
        "FLOPs per token: 2 forward + 2 input gradients (+2 recompute with checkpointing) x active parameters, "
        "+2 x trainable ones (weight gradients); routed experts count by their top-k share",
        "activations: each matmul's input and output, each norm's input, per token and layer, in the compute "
        f"dtype (Korthikanti et al. 2022: 34 x hidden bytes for a GPT layer); the fused loss holds one chunk of "
        f"logits ({FUSED_LOGIT_BYTES} bytes each), ZeRO-3 the whole batch's ({LOGITS_BYTES} bytes each)",
        f"{CUDA_OVERHEAD_GIB:g} GiB per GPU for the CUDA context, NCCL and fragmentation",
    ]
    if traits.sharded:
        notes.append(
            f"sharded weights: {GATHERED_LAYERS} decoder layers unsharded at a time, gathered {GATHER_PASSES}x "
            f"per micro-batch at {NVLINK_BYTES_PER_S / 1e9:.0f} GB/s per GPU in a node "
            f"({NETWORK_BYTES_PER_S / 1e9:.0f} across nodes), overlapping compute"
        )
    if cfg.parallel.cpu_offload != "none":
        notes.append(
            f"host transfers at {PCIE_BYTES_PER_S / 1e9:.0f} GB/s per GPU and CPU AdamW at "
            f"{CPU_ADAM_PARAMS_PER_S / 1e6:.0f}M parameters/s per rank, not overlapping compute (an upper bound)"
        )
    if s.stacked_adapted:
        notes.append(
            "adapters on stacked experts (PEFT target_parameters) form W + B@A for every expert on every pass "
            f"(~{DELTA_BYTES} bytes of GPU memory traffic per value) and keep it for backward"
        )
    if s.stacked_quantized:
        notes.append(
            "4-bit stacked experts: the whole stack rebuilt in the compute dtype on every pass (forward, backward, "
            f"recompute), ~{DEQUANTIZE_BYTES} bytes of GPU memory traffic per value; loaded in the model's dtype "
            f"before they are quantized: {STAGING_NOTES[cfg.model.quantization.stage_experts]}"
        )
    if cfg.model.quantization is not None:
        notes.append(
            "k-bit: 4 bits + block constants per weight; the unquantized rest is fp32 after PEFT's k-bit "
            "preparation (16-bit again under DeepSpeed), whole on every GPU while loading"
        )
    notes.append("tokens per micro-batch = micro_batch_size x max_length (shorter unpacked samples cost less)")
    if s.vision is not None:
        notes.append(
            "images: one per sample, so one per unpacked row and as many as their tokens fit in a packed one (an "
            "upper bound); their tokens are part of the row's max_length; the tower and projector computed at the "
            "same MFU; a frozen tower keeps no activations, and its forward's passing ones are not counted"
        )
    return notes


def vision_line(s: ModelShapes) -> str | None:
    """The tower, projector and images of a vision-language model, for the report."""
    v = s.vision
    if v is None:
        return None
    rows = "packed row" if v.images_per_row > 1 else "row"
    return (
        f"tower {count_label(v.tower)} ({v.tower_mode}), projector {count_label(v.projector)} "
        f"({'trained' if v.projector_trains else 'frozen'}), language model {v.language}; "
        f"{v.image.tokens:,} token{'s' if v.image.tokens > 1 else ''} per image ({v.image.how}) from "
        f"{v.image.patches:,} patches through the tower, {v.images_per_row} image"
        f"{'s' if v.images_per_row > 1 else ''} per {rows}"
    )


def _gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def _duration(seconds: float) -> str:
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.1f} s"


def format_estimate(est: Estimate) -> str:
    width = max(len(row.label) for row in est.rows) + 2
    lines = [
        f"estimate for {est.setup} (from shapes; a sizing estimate, not a measurement)",
        f"  {'memory':<{width}}{'GPU GiB':>9}{'host GiB/node':>15}",
    ]
    lines += [f"  {row.label:<{width}}{_gib(row.gpu):>9}{_gib(row.host):>15}" for row in est.rows]
    capacity = f"{_gib(est.gpu_bytes)} / {est.accelerator.memory_gib:g}"
    lines.append(f"  {'total':<{width}}{capacity:>9}{_gib(est.host_bytes):>15}")
    if max(est.load_gpu, est.load_host) >= 0.05 * GIB:
        lines.append(f"  {'while loading, before sharding':<{width}}{_gib(est.load_gpu):>9}{_gib(est.load_host):>15}")
    lines.append(f"  activations: {est.activation_factor:.0f} x hidden bytes per token per layer (from shapes)")
    if est.vision is not None:
        lines.append(f"  vision: {est.vision}")
    if est.step_s is None:
        lines.append("  time: the accelerator's peak FLOP/s is unknown")
    else:
        lines.append(f"  time per optimizer step of {est.tokens_per_step:,} tokens ({est.tokens_note}):")
        lines += [f"    {what:<22}{seconds:7.2f} s  {how}" for what, seconds, how in est.times]
        rate = est.tokens_per_step / est.step_s
        lines.append(f"    {'step':<22}{est.step_s:7.2f} s  = {rate:,.0f} tokens/s over all GPUs")
        if est.steps is not None:
            lines.append(f"    run: {est.steps:,} steps = {_duration(est.steps * est.step_s)}")
        else:
            lines.append(f"    run: data size unknown; 1,000 steps = {_duration(1000 * est.step_s)}")
        if est.before_training is not None:
            what, seconds = est.before_training
            lines.append(f"    before the first step: {what}, {_duration(seconds)}")
    lines.append("  assumptions:")
    lines += [f"    - {note}" for note in est.assumptions]
    return "\n".join(lines)
