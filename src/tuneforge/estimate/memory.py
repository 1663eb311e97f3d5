"""Memory per GPU and host RAM per node: weights, gradients, optimizer state, gathered layers, activations,
the loss, a vision-language model's images, and what the CUDA context takes, placed where the engine keeps
them."""

from __future__ import annotations

from dataclasses import dataclass

from tuneforge.config.schema import Config
from tuneforge.engines.base import EngineTraits
from tuneforge.estimate.hardware import GIB
from tuneforge.estimate.shapes import ModelShapes, count_label, frozen_copy, row_label, row_tokens
from tuneforge.estimate.vision import VisionShapes
from tuneforge.model.staging import LOAD_CONTEXT_BYTES, choose_staging, device_load_bytes, host_staged_gpu_bytes
from tuneforge.objective.fused_loss import LOGIT_BYTES as FUSED_LOGIT_BYTES
from tuneforge.objective.fused_loss import chunk_rows

GATHERED_LAYERS = 2  # sharded engines hold the decoder layer computing and the one prefetched, unsharded
LOGITS_BYTES = 12  # per logit: bf16 logits, their fp32 copy for the loss, and its fp32 gradient
CUDA_OVERHEAD_GIB = 3.0  # CUDA context, NCCL buffers, allocator fragmentation (not measured here)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
AUTOCAST_NAMES = {"bf16": "bfloat16", "fp16": "float16"}  # train.precision -> the dtype autocast computes in
PIXEL_BYTES = 4  # image processors give float32 pixels


@dataclass(frozen=True)
class Row:
    label: str
    gpu: float
    """Bytes on each GPU."""
    host: float = 0.0
    """Bytes of host RAM per node."""


@dataclass(frozen=True)
class Memory:
    rows: list[Row]
    load_gpu: float
    """Bytes on each GPU while loading: the model is whole there before the engine shards it."""
    load_host: float
    """Bytes of host RAM per node while loading (each rank reads the whole model)."""
    trainable_bytes: int
    """Bytes per trainable value (and its gradient)."""


def memory_use(
    cfg: Config,
    s: ModelShapes,
    traits: EngineTraits,
    world_size: int,
    per_node: int,
    compute_bytes: int,
    kbit: float,
    gpu_capacity: float = float("inf"),
) -> Memory:
    """Where every byte of a training step lives, for `world_size` ranks with `per_node` to a node."""
    state, weight_b = state_rows(cfg, s, traits, world_size, per_node, compute_bytes, kbit)
    rows = [*state, *expert_rows(cfg, s, compute_bytes), *activation_rows(cfg, s, traits, compute_bytes)]
    rows += reward_model_rows(cfg, compute_bytes)
    rows += vllm_rows(cfg, s, compute_bytes, gpu_capacity)
    rows.append(Row("CUDA context, NCCL, fragmentation", CUDA_OVERHEAD_GIB * GIB))
    load_gpu, load_host = loading_bytes(cfg, s, traits, per_node, kbit, gpu_capacity)
    return Memory(rows, load_gpu, load_host, weight_b)


def reward_model_rows(cfg: Config, compute_bytes: int) -> list[Row]:
    """Online RL's reward models: each rank holds a whole copy, in the compute dtype."""
    if not cfg.objective.prompted:
        return []
    from tuneforge.trained import model_values

    rows = []
    for reward in cfg.rl.rewards:
        if reward.kind == "model" and (values := model_values(reward.path)):
            rows.append(Row(f"reward model: {count_label(values)} values, whole on each rank", values * compute_bytes))
    return rows


def vllm_rows(cfg: Config, s: ModelShapes, compute_bytes: int, gpu_capacity: float) -> list[Row]:
    """`rl.generator: vllm`: the engine takes its share of the GPU (a merged copy of the weights in the compute
    dtype and its KV cache); where the GPU is not known, its weights at least."""
    if not cfg.objective.prompted or cfg.rl.generator != "vllm":
        return []
    share = cfg.rl.vllm.gpu_memory_utilization
    sleeps = "; released during the update" if cfg.rl.vllm.sleep else ""
    if gpu_capacity != float("inf"):
        label = f"vLLM engine: rl.vllm.gpu_memory_utilization {share:g} of the GPU{sleeps}"
        return [Row(label, share * gpu_capacity)]
    values = s.quantized + s.frozen + s.trainable
    label = f"vLLM engine: merged weights, {count_label(values)} values, and its KV cache{sleeps}"
    return [Row(label, values * compute_bytes)]


def state_rows(
    cfg: Config, s: ModelShapes, traits: EngineTraits, world_size: int, per_node: int, compute_bytes: int, kbit: float
) -> tuple[list[Row], int]:
    """Weights, gradients and optimizer state where the engine keeps them (sharded from their ZeRO stage on,
    offloaded to host RAM), the layers a sharding engine gathers; and the bytes per trainable value."""
    par, quantization = cfg.parallel, cfg.model.quantization
    deepspeed_cast = traits.casts_parameters and compute_bytes == 2  # DeepSpeed casts every parameter
    model_bytes = DTYPE_BYTES[cfg.model.dtype]
    # PEFT's k-bit preparation upcasts what is not quantized to fp32; DeepSpeed then casts it back.
    frozen_bytes = 2 if deepspeed_cast else 4 if quantization is not None else model_bytes
    stage = traits.shard_stage
    offload_weights = par.cpu_offload == "all"
    offload_optimizer = par.cpu_offload != "none"

    def place(label: str, total: float, min_stage: int, offloaded: bool) -> Row:
        per_rank = total / world_size if traits.shards_anything and stage >= min_stage else total
        return Row(label, 0.0, per_rank * per_node) if offloaded else Row(label, per_rank)

    if deepspeed_cast:
        weight_b, grad_b, optim_b = 2, 2, 12 + (4 if offload_optimizer else 0)  # fp32 master, moments, grads
        optim_what = "fp32 master, 2 moments" + (", fp32 grads" if offload_optimizer else "")
    else:
        weight_b = 4 if cfg.model.lora is not None else model_bytes  # PEFT keeps adapters in fp32
        grad_b, optim_b = weight_b, 2 * weight_b
        optim_what = f"2 moments in {'fp32' if weight_b == 4 else '16-bit'}"
    frozen_dtype = {2: "16-bit", 4: "fp32"}[frozen_bytes]
    base_label = f"base weights: {count_label(s.frozen)} {frozen_dtype}"
    if quantization is not None:
        base_label = (
            f"base weights: {count_label(s.quantized)} {quantization.bits}-bit + {count_label(s.frozen)} {frozen_dtype}"
        )
    # Expert parallelism keeps 1/N of the routed experts' weights on each rank (their gradients and optimizer
    # state, once sharded, over the ranks that hold the same experts: the same share as without it).
    held = s.trainable - s.routed_trainable * (1 - 1 / par.expert_parallel)
    held_note = f", experts 1/{par.expert_parallel}" if par.expert_parallel > 1 else ""
    rows = [
        place(base_label, s.quantized * kbit + s.frozen * frozen_bytes, 3, offload_weights),
        place(
            f"trainable: {count_label(s.trainable)} ({weight_b} B each{held_note})", held * weight_b, 3, offload_weights
        ),
        # DeepSpeed keeps gradients with the optimizer. Below the stage that shards them, a rank keeps those of
        # the weights it holds.
        place("gradients", (s.trainable if stage >= 2 else held) * grad_b, 2, offload_optimizer),
        place(f"optimizer: AdamW {optim_what}", (s.trainable if stage >= 1 else held) * optim_b, 1, offload_optimizer),
    ]
    if not s.quantized and not s.frozen:
        rows.pop(0)  # full fine-tuning: no frozen base
    copy_quantized, copy_other = frozen_copy(cfg, s)
    if copy_quantized or copy_other:  # prepared and cast exactly as the policy's frozen base is
        rows.append(
            place(
                f"reference model: frozen copy, {count_label(copy_quantized + copy_other)} values",
                copy_quantized * kbit + copy_other * frozen_bytes,
                3,
                offload_weights,
            )
        )
    if traits.sharded:
        gathered = GATHERED_LAYERS * (s.layer_quantized * kbit + s.layer_other * compute_bytes)
        gathered += s.outside_layers * compute_bytes
        rest = "embeddings/head, tower, projector" if s.vision is not None else "embeddings/head"
        rows.append(Row(f"gathered for compute: {GATHERED_LAYERS} layers + {rest}", gathered))
    return rows, weight_b


def expert_rows(cfg: Config, s: ModelShapes, compute_bytes: int) -> list[Row]:
    """Stacked experts formed in full for a pass: adapters in PEFT's W + B@A form, 4-bit stacks dequantized."""
    rows = []
    quantization, train = cfg.model.quantization, cfg.train
    if s.stacked_adapted:
        per_layer = s.stacked_adapted / s.stacked_layers
        kept = 1 if train.gradient_checkpointing else s.stacked_layers
        rows.append(
            Row(
                f"expert adapters: W + B@A, {kept} of {s.stacked_layers} layers",
                per_layer * (kept * compute_bytes + 4 + compute_bytes),  # + one fp32 delta and W's gradient
            )
        )
    if s.stacked_quantized and quantization is not None:
        # Dequantized in the dtype the weights were loaded in, then cast if the experts compute in another.
        computes_in = AUTOCAST_NAMES.get(train.precision, quantization.compute_dtype)
        model_bytes = DTYPE_BYTES[cfg.model.dtype]
        per_value = model_bytes + (DTYPE_BYTES[computes_in] if computes_in != cfg.model.dtype else 0)
        rows.append(
            Row(
                f"4-bit experts: one stack of {count_label(s.stacked_quantized_largest)} dequantized at a time",
                s.stacked_quantized_largest * per_value,
            )
        )
    return rows


def activation_rows(cfg: Config, s: ModelShapes, traits: EngineTraits, compute_bytes: int) -> list[Row]:
    """What one micro-batch's forward keeps for backward, and the logits the loss needs."""
    par, train = cfg.parallel, cfg.train
    # Under sequence parallelism a rank holds 1/N of every row's tokens (attention: all tokens of 1/N of the heads).
    split = par.sequence_parallel
    tokens_micro = train.micro_batch_size * row_tokens(cfg) // split
    shard = f"/{split} (sequence parallel)" if split > 1 else ""
    if train.gradient_checkpointing:
        per_token = s.layers * s.hidden + s.act_max_layer  # layer inputs, one layer recomputed
        act_how = "checkpointed"
    else:
        per_token = s.act_total
        act_how = "all layers"
    rows = [
        Row(
            f"activations: {train.micro_batch_size} x {row_label(cfg)}{shard} tokens, {act_how}",
            tokens_micro * per_token * compute_bytes,
        )
    ]
    if s.vision is not None:
        rows.append(image_row(cfg, s.vision, compute_bytes))
    if cfg.objective.prompted:
        # The rollout's KV cache is freed before the update: only what it needs beyond the activations counts.
        cache = tokens_micro * s.kv_per_token * compute_bytes
        beyond = cache - sum(row.gpu for row in rows)
        if beyond > 0:
            rows.append(Row(f"rollout KV cache beyond the update's activations ({cache / GIB:.1f} GiB)", beyond))
    head_wrapped = cfg.model.lora is not None and "lm_head" in (cfg.model.lora.modules_to_save or [])
    if cfg.objective.scalar_head:  # a score head: one value per token, no vocabulary
        return rows
    if not traits.fuses_output_layer or head_wrapped:  # the model's own logits for the whole batch
        rows.append(Row(f"logits and loss: {tokens_micro} x {s.vocab}", tokens_micro * s.vocab * LOGITS_BYTES))
    else:  # the fused loss holds one chunk of logits and the hidden states' gradient
        chunk = chunk_rows(tokens_micro, s.vocab, on_gpu=True)
        fused = chunk * s.vocab * FUSED_LOGIT_BYTES + tokens_micro * s.hidden * compute_bytes
        rows.append(Row(f"fused loss: {chunk} x {s.vocab} logits at a time", fused))
    return rows


def image_row(cfg: Config, v: VisionShapes, compute_bytes: int) -> Row:
    """A micro-batch's images: their pixels, and what the tower and projector keep for backward. A frozen tower
    keeps nothing (no gradient passes through it); a trained one keeps its layers' activations for every patch
    (checkpointed as the language model's are), and the projector keeps its own for every image token while it
    trains or passes gradients to the tower. The image tokens' activations in the language model are the row's."""
    train = cfg.train
    images = train.micro_batch_size * v.images_per_row
    kept = 0.0
    if v.tower_trains:
        if train.gradient_checkpointing:
            kept += v.image.patches * (v.tower_layers * v.tower_hidden + v.tower_act_max_layer)
        else:
            kept += v.image.patches * v.tower_act_total
    if v.keeps_projector:
        kept += v.image.tokens * v.projector_act
    kept_by = "tower, projector" if v.tower_trains else "projector" if v.keeps_projector else ""
    what = f"pixels, {kept_by} activations" if kept_by else "pixels (tower and projector frozen)"
    label = f"images: {images} x {v.image.tokens:,} tokens, {v.image.patches:,} patches: {what}"
    return Row(label, images * (kept * compute_bytes + v.image.pixels * PIXEL_BYTES))


def loading_bytes(
    cfg: Config, s: ModelShapes, traits: EngineTraits, per_node: int, kbit: float, gpu_capacity: float
) -> tuple[float, float]:
    """Bytes on each GPU and host RAM per node while the model loads, before the engine shards it."""
    quantization = cfg.model.quantization
    model_bytes = DTYPE_BYTES[cfg.model.dtype]
    total_params = s.quantized + s.frozen + s.trainable
    if quantization is not None:  # loaded onto each GPU, the rest upcast to fp32 before the engine casts it
        # Stacked experts arrive in the model's dtype and are quantized once all weights are loaded: on the GPU,
        # or staged in host RAM (a copy per rank) and brought to the GPU one stack at a time.
        rest, linear = s.frozen + s.trainable, s.quantized - s.stacked_quantized
        loaded = device_load_bytes(s.stacked_quantized, linear, rest, model_bytes, kbit)
        load_host = 0.0
        free = gpu_capacity - LOAD_CONTEXT_BYTES
        if s.stacked_quantized and choose_staging(quantization.stage_experts, loaded, free) == "host":
            load_host = per_node * loaded
            loaded = host_staged_gpu_bytes(
                s.stacked_quantized, s.stacked_quantized_largest, linear, rest, model_bytes, kbit
            )
        return max(loaded, s.quantized * kbit + rest * 4), load_host
    # Each rank reads the whole model into host RAM; the engine moves it whole to its GPU to shard it.
    offload_weights = cfg.parallel.cpu_offload == "all"
    load_gpu = total_params * model_bytes if traits.shards_anything and not offload_weights else 0.0
    return load_gpu, per_node * total_params * model_bytes
