"""Time per optimizer step: compute at an assumed share of the peak (a vision-language model's tower and
projector over its images apart), the memory-bound expert adapter deltas, collectives, and host transfers and the
CPU optimizer under offload."""

from __future__ import annotations

from tuneforge.config.schema import Config
from tuneforge.engines.base import EngineTraits
from tuneforge.estimate.hardware import Accelerator
from tuneforge.estimate.shapes import ModelShapes, count_label, frozen_copy, row_tokens

BASE_MFU = 0.35  # share of peak bf16 FLOP/s a Hugging Face model reaches in training with SDPA/flash attention
QUANTIZED_EFFICIENCY = 0.5  # k-bit layers dequantize their weight before each matmul: about half the throughput
EXPERT_EFFICIENCY = 0.5  # routed experts: many small per-expert matmuls plus token gather/scatter: about half
GATHER_PASSES = 2  # sharded weights are gathered for forward and again for backward (recompute reuses it)
DELTA_BYTES = 16  # per stacked expert weight value and pass: fp32 delta B@A written, cast, added to W
DEQUANTIZE_BYTES = 4.5  # per 4-bit expert value and pass: half a byte read, bf16 written, read again by the matmul
PCIE_BYTES_PER_S = 25e9  # host <-> GPU per GPU with pinned memory (PCIe Gen4 x16 in practice; Gen5 up to ~50)
NVLINK_BYTES_PER_S = 200e9  # all-gather/reduce-scatter bandwidth per GPU inside one NVLink node, per-layer sizes
NETWORK_BYTES_PER_S = 40e9  # the same across nodes: one 400 Gb/s NIC per GPU
CPU_ADAM_PARAMS_PER_S = 2e8  # parameters one rank's torch AdamW updates per second on the host's shared cores


REFERENCE_FORWARDS = {
    "adapters": "the base with its adapters disabled, no gradient",
    "model": "a frozen copy of the model, no gradient",
}
"""DPO references that run a forward per micro-batch (a precomputed one is a pass before training)."""

Times = list[tuple[str, float, str]]
"""(what, seconds per optimizer step, how it was counted)."""


def step_times(
    cfg: Config,
    s: ModelShapes,
    traits: EngineTraits,
    world_size: int,
    per_node: int,
    accelerator: Accelerator,
    kbit: float,
    compute_bytes: int,
    grad_bytes: int,
) -> tuple[Times, float | None]:
    """Each part of an optimizer step's time, and the step's: the GPU's work and the exchanges on its critical
    path, overlapped with the collectives that prefetch and reduce, then the host's part under offload."""
    if accelerator.bf16_flops is None:
        return [], None
    times = gpu_times(cfg, s, accelerator) + exchange_times(cfg, s, per_node, compute_bytes)
    gpu_s = sum(seconds for _, seconds, _ in times)
    collective = 0.0
    if world_size > 1:
        collective = collective_seconds(cfg, s, traits, world_size, per_node, kbit, compute_bytes, grad_bytes)
        times.append(("collectives", collective, "overlap compute (prefetch)"))
    host = host_times(cfg, s, traits, world_size, kbit, compute_bytes, grad_bytes)
    times += host
    return times, max(gpu_s, collective) + sum(seconds for _, seconds, _ in host)


def _tokens_micro(cfg: Config) -> int:
    """This rank's share of a micro-batch's rows, in tokens."""
    return cfg.train.micro_batch_size * row_tokens(cfg) // cfg.parallel.sequence_parallel


def gpu_times(cfg: Config, s: ModelShapes, accelerator: Accelerator) -> Times:
    """The matmuls at an assumed share of the peak, and the memory-bound forming of full-size expert weights."""
    train = cfg.train
    micro, tokens_micro = train.gradient_accumulation, _tokens_micro(cfg)
    passes = 4 + (2 if train.gradient_checkpointing else 0)  # forward, input gradients, recompute: 2 each
    rate = accelerator.bf16_flops * BASE_MFU
    forward = forward_weight(s)
    weighted = passes * forward + 2 * s.active_trainable + 6 * s.adapter_active  # weight gradients; adapter matmuls
    flops_token = passes * s.active + 2 * s.active_trainable + 6 * s.adapter_active
    compute = micro * tokens_micro * weighted / rate
    mfu_note = (
        f"MFU {BASE_MFU}"
        + (f", routed experts x{EXPERT_EFFICIENCY}" if s.active_routed else "")
        + (f", k-bit layers x{QUANTIZED_EFFICIENCY}" if s.active_quantized else "")
    )
    times = [("compute", compute, f"{flops_token / 1e9:.1f} GFLOP/token, {mfu_note}")]
    if s.vision is not None:
        times.append(vision_time(cfg, s, rate))
    if extra := cfg.objective.extra_forwards(cfg):  # the reference's forward, no backward
        reference = micro * tokens_micro * 2 * forward * extra / rate
        times.append(("reference forward", reference, REFERENCE_FORWARDS.get(cfg.reference, "")))
    bandwidth = accelerator.memory_bytes_per_s or 2e12
    if s.stacked_adapted:  # W + B@A formed in full on every pass: memory-bound on the GPU
        delta_passes = 2 + (1 if train.gradient_checkpointing else 0)
        flops = 2 * cfg.model.lora.r * s.stacked_adapted / rate
        memory = DELTA_BYTES * s.stacked_adapted / bandwidth
        delta = micro * delta_passes * max(flops, memory)
        times.append(
            ("expert adapter deltas", delta, f"{count_label(s.stacked_adapted)} values formed {delta_passes}x")
        )
    if s.stacked_quantized:  # every pass rebuilds the whole 4-bit expert stack: memory-bound on the GPU
        dequantize_passes = 2 + (1 if train.gradient_checkpointing else 0)  # forward, backward, recompute
        dequantize = micro * dequantize_passes * DEQUANTIZE_BYTES * s.stacked_quantized / bandwidth
        values = f"{count_label(s.stacked_quantized)} values rebuilt {dequantize_passes}x"
        times.append(("expert dequantization", dequantize, values))
    return times


def vision_time(cfg: Config, s: ModelShapes, rate: float) -> tuple[str, float, str]:
    """The tower over every patch and the projector over every image token of a step's images: a forward, and
    where they train or pass gradients on, their backward (and the tower's recompute under checkpointing)."""
    v, train = s.vision, cfg.train
    images = train.gradient_accumulation * train.micro_batch_size * v.images_per_row
    tower_passes = 2
    if v.tower_trains:  # input gradients (and weight gradients in full), the recompute
        tower_passes += 2 + (2 if v.tower_mode == "full" else 0) + (2 if train.gradient_checkpointing else 0)
    projector_passes = 2 + (2 if v.projector_trains else 0) + (2 if v.tower_trains else 0)
    tower = v.image.patches * v.tower_patch_params + v.image.tokens * v.tower_token_params
    flops = tower_passes * tower + projector_passes * v.image.tokens * v.projector
    flops += 6 * v.image.patches * v.tower_adapter_active
    how = "forward only" if not v.tower_trains else "forward and backward"
    note = f"{images:,} images per GPU x {flops / 1e9:,.0f} GFLOP ({v.image.patches:,} patches each), tower {how}"
    return ("vision tower", images * flops / rate, note)


def forward_weight(s: ModelShapes) -> float:
    """Parameters a token multiplies with in a forward, weighted by how far each kind's matmuls fall below the
    assumed MFU (k-bit layers dequantize, routed experts run many small matmuls)."""
    other = s.active - s.active_quantized - s.active_routed
    return other + s.active_quantized / QUANTIZED_EFFICIENCY + s.active_routed / EXPERT_EFFICIENCY


def reference_pass_seconds(cfg: Config, s: ModelShapes, accelerator: Accelerator, pairs_per_rank: float) -> float:
    """DPO's precomputed reference (`preference.reference: precompute`): one forward, no gradient, over every
    pair of the training data before the first step, split over the data-parallel ranks."""
    if accelerator.bf16_flops is None:
        return 0.0
    micro_batches = pairs_per_rank / cfg.train.micro_batch_size
    return micro_batches * _tokens_micro(cfg) * 2 * forward_weight(s) / (accelerator.bf16_flops * BASE_MFU)


def exchange_times(cfg: Config, s: ModelShapes, per_node: int, compute_bytes: int) -> Times:
    """All-to-alls on the critical path: tokens to their experts' ranks, heads for tokens across a row's ranks."""
    train, par = cfg.train, cfg.parallel
    micro, tokens_micro = train.gradient_accumulation, _tokens_micro(cfg)
    times = []
    experts = par.expert_parallel
    if experts > 1 and s.moe_layers:
        # Per MoE layer and micro-batch: each token's top-k copies sent to their experts' ranks and the results
        # sent back, forward and again for the gradients backward (and the recompute); (N-1)/N leaves the rank.
        sends = 2 * (2 + (1 if train.gradient_checkpointing else 0))
        exchanged = micro * tokens_micro * s.moe_layers * s.top_k * s.hidden * compute_bytes * sends
        exchanged *= (experts - 1) / experts
        bandwidth = NVLINK_BYTES_PER_S if experts <= per_node else NETWORK_BYTES_PER_S
        times.append(("expert all-to-all", exchanged / bandwidth, f"{experts} ranks per expert group, not overlapped"))
    split = par.sequence_parallel
    if split > 1:
        # Per layer and micro-batch: q, k, v and the output exchanged forward, their gradients backward (about 4
        # hidden-sized vectors per token each way), (N-1)/N of it leaving the rank; on the critical path.
        exchanged = micro * tokens_micro * s.layers * 8 * s.hidden * compute_bytes * (split - 1) / split
        bandwidth = NVLINK_BYTES_PER_S if split <= per_node else NETWORK_BYTES_PER_S
        times.append(("sequence all-to-all", exchanged / bandwidth, f"{split} ranks per row, not overlapped"))
    return times


def collective_seconds(
    cfg: Config,
    s: ModelShapes,
    traits: EngineTraits,
    world_size: int,
    per_node: int,
    kbit: float,
    compute_bytes: int,
    grad_bytes: int,
) -> float:
    """Gathers of sharded weights and reductions of gradients, which overlap the compute."""
    micro, par = cfg.train.gradient_accumulation, cfg.parallel
    gather_bytes = s.quantized * kbit + (s.frozen + s.trainable) * compute_bytes
    spread = (world_size - 1) / world_size
    bandwidth = NVLINK_BYTES_PER_S if world_size <= per_node else NETWORK_BYTES_PER_S
    copy_quantized, copy_other = frozen_copy(cfg, s)  # DPO's frozen reference: gathered once, for its forward
    copy_bytes = copy_quantized * kbit + copy_other * compute_bytes
    moved = micro * (GATHER_PASSES * gather_bytes + copy_bytes) * spread if traits.sharded else 0.0
    reductions = micro if traits.reduces_every_micro_batch else 1  # FSDP and DDP sync at the last micro-batch
    all_reduce = not traits.shards_anything  # an all-reduce moves twice a reduce-scatter's bytes
    # Under expert parallelism each rank reduces only its own experts' gradients (with the ranks that hold them).
    reduced = s.trainable - s.routed_trainable * (1 - 1 / par.expert_parallel)
    moved += reductions * reduced * grad_bytes * spread * (2 if all_reduce else 1)
    return moved / bandwidth


def host_times(
    cfg: Config, s: ModelShapes, traits: EngineTraits, world_size: int, kbit: float, compute_bytes: int, grad_bytes: int
) -> Times:
    """Under offload: weights and gradients across PCIe, and the optimizer step on the host's cores."""
    par, micro = cfg.parallel, cfg.train.gradient_accumulation
    if par.cpu_offload == "none":
        return []
    host = 0.0
    if par.cpu_offload == "all":
        gather_bytes = s.quantized * kbit + (s.frozen + s.trainable) * compute_bytes
        copy_quantized, copy_other = frozen_copy(cfg, s)  # DPO's frozen reference: one forward pass
        copy_bytes = copy_quantized * kbit + copy_other * compute_bytes
        host += micro * (GATHER_PASSES * gather_bytes + copy_bytes) / world_size  # each rank uploads its shard
    grads_out = micro if traits.reduces_every_micro_batch else 1  # DeepSpeed accumulates them on the host
    host += grads_out * s.trainable * grad_bytes / world_size
    if par.cpu_offload == "optimizer":
        host += s.trainable * compute_bytes / world_size  # updated weights back
    adam = s.trainable / world_size / CPU_ADAM_PARAMS_PER_S
    return [
        ("PCIe host transfers", host / PCIE_BYTES_PER_S, f"{host / 1e9:.1f} GB per GPU"),
        ("CPU AdamW", adam, f"{count_label(s.trainable / world_size)} parameters per rank"),
    ]
