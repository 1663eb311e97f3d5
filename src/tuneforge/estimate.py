"""Memory per GPU and time per optimizer step of a training job, from the model's shapes and the config.

A sizing estimate, not a measurement: every figure is parameter shapes times a few named assumptions, and the
assumptions are printed with the result. It says which set-up fits and roughly how fast, not what a profiler
would show. The model is a skeleton on the meta device, so nothing is downloaded or allocated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tuneforge.config.schema import Config
from tuneforge.engines.base import EngineTraits
from tuneforge.model.adapters import resolve_lora_targets
from tuneforge.model.moe import MoEBlock, MoEMap, find_moe
from tuneforge.model.quantize import matches_module_name, quantized_linears
from tuneforge.model.structure import decoder_layers
from tuneforge.train.fused_loss import CHUNK_ELEMENTS, MIN_CHUNK_ROWS

GIB = 2**30


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gib: float
    bf16_flops: float | None
    """Dense bf16 tensor-core peak (no sparsity); None: unknown, no time estimate."""
    memory_bytes_per_s: float | None = None
    """HBM bandwidth, for the memory-bound work (expert adapter deltas)."""


ACCELERATORS = {
    "h100": Accelerator("H100 80GB", 80.0, 989e12, 3.35e12),
    "h200": Accelerator("H200 141GB", 141.0, 989e12, 4.8e12),
    "a100-80gb": Accelerator("A100 80GB", 80.0, 312e12, 2.0e12),
    "a100-40gb": Accelerator("A100 40GB", 40.0, 312e12, 1.55e12),
}
"""SXM parts, vendors' data sheets; memory is nominal (the CUDA allowance below covers what the driver keeps)."""

BASE_MFU = 0.35  # share of peak bf16 FLOP/s a Hugging Face model reaches in training with SDPA/flash attention
QUANTIZED_EFFICIENCY = 0.5  # k-bit layers dequantize their weight before each matmul: about half the throughput
EXPERT_EFFICIENCY = 0.5  # routed experts: many small per-expert matmuls plus token gather/scatter: about half
QUANT_BLOCK = 64  # bitsandbytes 4-bit: one absmax constant per 64 weights (fp32, or 8-bit with double quant)
DOUBLE_QUANT_GROUP = 256  # double quantization: one fp32 constant per 256 absmax values
GATHERED_LAYERS = 2  # sharded engines hold the decoder layer computing and the one prefetched, unsharded
GATHER_PASSES = 2  # sharded weights are gathered for forward and again for backward (recompute reuses it)
LOGITS_BYTES = 12  # per logit: bf16 logits, their fp32 copy for the loss, and its fp32 gradient
FUSED_LOGIT_BYTES = 10  # per logit of one fused-loss chunk: fp32 logits, fp32 softmax, its 16-bit cast
CUDA_OVERHEAD_GIB = 3.0  # CUDA context, NCCL buffers, allocator fragmentation (not measured here)
DELTA_BYTES = 16  # per stacked expert weight value and pass: fp32 delta B@A written, cast, added to W
PCIE_BYTES_PER_S = 25e9  # host <-> GPU per GPU with pinned memory (PCIe Gen4 x16 in practice; Gen5 up to ~50)
NVLINK_BYTES_PER_S = 200e9  # all-gather/reduce-scatter bandwidth per GPU inside one NVLink node, per-layer sizes
NETWORK_BYTES_PER_S = 40e9  # the same across nodes: one 400 Gb/s NIC per GPU
CPU_ADAM_PARAMS_PER_S = 2e8  # parameters one rank's torch AdamW updates per second on the host's shared cores

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Row:
    label: str
    gpu: float
    """Bytes on each GPU."""
    host: float = 0.0
    """Bytes of host RAM per node."""


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


def accelerator_named(name: str) -> Accelerator:
    return ACCELERATORS[name]


def local_accelerator() -> Accelerator | None:
    """This machine's first GPU, with its peak and bandwidth when the table knows it; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    from tuneforge.train.telemetry import peak_flops

    name = torch.cuda.get_device_name(0)
    memory_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    for key, known in ACCELERATORS.items():
        model, _, size = key.partition("-")
        if model.upper() in name and (not size or (memory_gib > 50) == (size == "80gb")):
            return Accelerator(name, memory_gib, known.bf16_flops, known.memory_bytes_per_s)
    return Accelerator(name, memory_gib, peak_flops(torch.device("cuda", 0)))


@dataclass(frozen=True)
class _Shapes:
    quantized: int
    """Weights stored in k bits."""
    frozen: int
    """Other parameters that do not train (the whole base under LoRA)."""
    trainable: int
    adapter_active: float
    """Adapter parameters a token multiplies with (module adapters only)."""
    stacked_adapted: int
    """Values of stacked expert weights with adapters: W + B@A is formed in full every pass."""
    stacked_layers: int
    active: float
    """Parameters a token multiplies with (routed experts by their top-k share, no input embedding)."""
    active_quantized: float
    active_routed: float
    active_trainable: float
    layers: int
    hidden: int
    vocab: int
    layer_quantized: int
    """Quantized values of the largest decoder layer (what is gathered at once)."""
    layer_other: int
    outside_layers: int
    """Parameters outside the decoder layers (embeddings, head, final norm)."""
    act_total: float
    """Activation bytes per token per compute byte, summed over layers (no checkpointing)."""
    act_max_layer: float


def _routed_parameters(model: nn.Module, moe: MoEMap) -> Iterator[tuple[MoEBlock, nn.Parameter]]:
    for block in moe:
        for name, _ in block.expert_shapes:
            yield block, model.get_parameter(f"{block.experts_path}.{name}")


def _activity(model: nn.Module, moe: MoEMap) -> dict[int, float]:
    """Share of tokens that multiply with each parameter, where it is not 1."""
    share: dict[int, float] = {}
    for block, param in _routed_parameters(model, moe):
        share[id(param)] = min(1.0, block.top_k / block.num_experts) if block.top_k else 1.0
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding is not None and (head is None or head.weight is not embedding.weight):
        share[id(embedding.weight)] = 0.0  # a lookup, not a matmul
    return share


def _saved_values(param: nn.Parameter, activity: float) -> float:
    """Activation values a token leaves for backward around one weight: a matmul's input and output (the
    output feeds the next op, which keeps it); a norm's input. For a GPT layer this gives the 34 x hidden
    bytes per token of Korthikanti et al. (2022) without attention's s x s term (SDPA/flash keep none)."""
    if param.ndim == 3:  # stacked experts x d1 x d2: each routed copy of the token
        return activity * param.shape[0] * (param.shape[1] + param.shape[2])
    if param.ndim == 2:
        return activity * (param.shape[0] + param.shape[1])
    return param.numel()


def _shapes(cfg: Config, model: nn.Module, moe: MoEMap, compute_bytes: int) -> _Shapes:
    share = _activity(model, moe)
    quantization = cfg.model.quantization
    quantized_ids = set()
    if quantization is not None:
        quantized_ids = {id(module.weight) for _, module in quantized_linears(model, quantization)}
    params = list(model.parameters())
    active = {id(p): share.get(id(p), 1.0) * p.numel() for p in params}
    routed_ids = {id(p) for _, p in _routed_parameters(model, moe)}

    lora = cfg.model.lora
    trainable_ids: set[int] = set()
    adapters: dict[str, float] = {}  # module name -> adapter parameters
    stacked: list[nn.Parameter] = []
    extra = 0
    if lora is not None:
        targets = resolve_lora_targets(model, lora, moe)
        for name in targets.modules:
            module = model.get_submodule(name)
            adapters[name] = lora.r * (module.in_features + module.out_features) + (
                module.out_features if lora.use_dora else 0
            )
        for name in targets.parameters:
            param = model.get_parameter(name)
            stacked.append(param)
            extra += param.shape[0] * lora.r * (param.shape[1] + param.shape[2])
        for name, module in model.named_modules():
            if lora.modules_to_save and matches_module_name(name, lora.modules_to_save):
                extra += sum(p.numel() for p in module.parameters())
    else:
        patterns = [re.compile(p) for p in cfg.model.freeze]
        trainable_ids = {id(p) for n, p in model.named_parameters() if not any(r.search(n) for r in patterns)}
    trainable = sum(p.numel() for p in params if id(p) in trainable_ids) + int(sum(adapters.values())) + extra
    quantized = sum(p.numel() for p in params if id(p) in quantized_ids)
    frozen = sum(p.numel() for p in params if id(p) not in quantized_ids and id(p) not in trainable_ids)

    names = {id(module): name for name, module in model.named_modules()}
    lora_saved: dict[str, float] = {}
    if lora is not None:  # bytes per token and compute byte: the dropped-out input and its mask, A's output
        for name in adapters:
            module = model.get_submodule(name)
            dropout = module.in_features * (1 + 1 / compute_bytes) if lora.dropout > 0 else 0.0
            lora_saved[name] = share.get(id(module.weight), 1.0) * (dropout + lora.r)
    layers = decoder_layers(model)
    per_layer = []
    layer_quantized, layer_other, in_layers = 0, 0, 0
    for layer in layers:
        values = sum(_saved_values(p, share.get(id(p), 1.0)) for p in layer.parameters())
        values += sum(lora_saved.get(names[id(m)], 0.0) for m in layer.modules())
        per_layer.append(values)
        q = sum(p.numel() for p in layer.parameters() if id(p) in quantized_ids)
        n = sum(p.numel() for p in layer.parameters())
        in_layers += n
        if n > layer_quantized + layer_other:
            layer_quantized, layer_other = q, n - q
    stacked_ids = {id(p) for p in stacked}
    return _Shapes(
        quantized=quantized,
        frozen=frozen,
        trainable=trainable,
        adapter_active=sum(share.get(id(model.get_submodule(n).weight), 1.0) * count for n, count in adapters.items()),
        stacked_adapted=sum(p.numel() for p in stacked),
        stacked_layers=sum(1 for layer in layers if any(id(p) in stacked_ids for p in layer.parameters())),
        active=sum(active.values()),
        active_quantized=sum(v for k, v in active.items() if k in quantized_ids),
        active_routed=sum(v for k, v in active.items() if k in routed_ids and k not in quantized_ids),
        active_trainable=sum(v for k, v in active.items() if k in trainable_ids)
        + sum(share.get(id(p), 1.0) * p.numel() for p in stacked),
        layers=len(layers),
        hidden=model.config.hidden_size,
        vocab=model.get_output_embeddings().weight.shape[0],
        layer_quantized=layer_quantized,
        layer_other=layer_other,
        outside_layers=sum(p.numel() for p in params) - in_layers,
        act_total=sum(per_layer),
        act_max_layer=max(per_layer),
    )


def kbit_bytes(bits: int, double_quant: bool) -> float:
    """Bytes per k-bit weight, quantization constants included."""
    if bits == 8:
        return 1.0  # plus one fp32 scale per row: negligible
    constants = 8 / QUANT_BLOCK + 32 / (QUANT_BLOCK * DOUBLE_QUANT_GROUP) if double_quant else 32 / QUANT_BLOCK
    return (4 + constants) / 8


def _count(values: float) -> str:
    return f"{values / 1e9:.2f}B" if values >= 1e8 else f"{values / 1e6:.1f}M"


def estimate(
    cfg: Config,
    skeleton: nn.Module,
    traits: EngineTraits,
    world_size: int,
    accelerator: Accelerator,
    gpus_per_node: int | None = None,
    num_samples: int | None = None,
    moe: MoEMap | None = None,
) -> Estimate:
    """Memory per GPU (and host RAM per node) and time per optimizer step for `cfg` on `world_size` ranks of
    the engine with `traits`. `moe`: the skeleton's MoE map (found on it when not given)."""
    moe = moe if moe is not None else find_moe(skeleton)
    par, train, quantization = cfg.parallel, cfg.train, cfg.model.quantization
    per_node = min(gpus_per_node or world_size, world_size)
    mixed = train.precision in ("bf16", "fp16")
    compute_bytes = 2 if mixed else 4
    deepspeed_cast = traits.casts_parameters and mixed  # DeepSpeed casts every parameter to the compute dtype
    model_bytes = DTYPE_BYTES[cfg.model.dtype]
    # PEFT's k-bit preparation upcasts what is not quantized to fp32; DeepSpeed then casts it back.
    frozen_bytes = 2 if deepspeed_cast else 4 if quantization is not None else model_bytes
    kbit = kbit_bytes(quantization.bits, quantization.double_quant) if quantization is not None else 0.0
    s = _shapes(cfg, skeleton, moe, compute_bytes)

    sharded_engine = traits.shards_anything
    stage = traits.shard_stage
    offload_weights = par.cpu_offload == "all"
    offload_optimizer = par.cpu_offload != "none"

    def place(label: str, total: float, min_stage: int, offloaded: bool) -> Row:
        per_rank = total / world_size if sharded_engine and stage >= min_stage else total
        return Row(label, 0.0, per_rank * per_node) if offloaded else Row(label, per_rank)

    if deepspeed_cast:
        weight_b, grad_b, optim_b = 2, 2, 12 + (4 if offload_optimizer else 0)  # fp32 master, moments, grads
        optim_what = "fp32 master, 2 moments" + (", fp32 grads" if offload_optimizer else "")
    else:
        weight_b = 4 if cfg.model.lora is not None else model_bytes  # PEFT keeps adapters in fp32
        grad_b, optim_b = weight_b, 2 * weight_b
        optim_what = f"2 moments in {'fp32' if weight_b == 4 else '16-bit'}"
    frozen_dtype = {2: "16-bit", 4: "fp32"}[frozen_bytes]
    base_label = f"base weights: {_count(s.frozen)} {frozen_dtype}"
    if quantization is not None:
        base_label = f"base weights: {_count(s.quantized)} {quantization.bits}-bit + {_count(s.frozen)} {frozen_dtype}"
    rows = [
        place(base_label, s.quantized * kbit + s.frozen * frozen_bytes, 3, offload_weights),
        place(f"trainable: {_count(s.trainable)} ({weight_b} B each)", s.trainable * weight_b, 3, offload_weights),
        place("gradients", s.trainable * grad_b, 2, offload_optimizer),  # DeepSpeed keeps them with the optimizer
        place(f"optimizer: AdamW {optim_what}", s.trainable * optim_b, 1, offload_optimizer),
    ]
    if not s.quantized and not s.frozen:
        rows.pop(0)  # full fine-tuning: no frozen base
    if traits.sharded:
        gathered = GATHERED_LAYERS * (s.layer_quantized * kbit + s.layer_other * compute_bytes)
        gathered += s.outside_layers * compute_bytes
        rows.append(Row(f"gathered for compute: {GATHERED_LAYERS} layers + embeddings/head", gathered))
    checkpointing = train.gradient_checkpointing
    if s.stacked_adapted:
        per_layer = s.stacked_adapted / s.stacked_layers
        kept = 1 if checkpointing else s.stacked_layers
        rows.append(
            Row(
                f"expert adapters: W + B@A, {kept} of {s.stacked_layers} layers",
                per_layer * (kept * compute_bytes + 4 + compute_bytes),  # + one fp32 delta and W's gradient
            )
        )
    tokens_micro = train.micro_batch_size * cfg.data.max_length
    if checkpointing:
        per_token = s.layers * s.hidden + s.act_max_layer  # layer inputs, one layer recomputed
        act_how = "checkpointed"
    else:
        per_token = s.act_total
        act_how = "all layers"
    rows.append(
        Row(
            f"activations: {train.micro_batch_size} x {cfg.data.max_length} tokens, {act_how}",
            tokens_micro * per_token * compute_bytes,
        )
    )
    head_wrapped = cfg.model.lora is not None and "lm_head" in (cfg.model.lora.modules_to_save or [])
    if not traits.fuses_output_layer or head_wrapped:  # the model's own logits for the whole batch
        rows.append(Row(f"logits and loss: {tokens_micro} x {s.vocab}", tokens_micro * s.vocab * LOGITS_BYTES))
    else:  # the fused loss holds one chunk of logits and the hidden states' gradient
        chunk = min(tokens_micro, max(MIN_CHUNK_ROWS, CHUNK_ELEMENTS // s.vocab))
        fused = chunk * s.vocab * FUSED_LOGIT_BYTES + tokens_micro * s.hidden * compute_bytes
        rows.append(Row(f"fused loss: {chunk} x {s.vocab} logits at a time", fused))
    rows.append(Row("CUDA context, NCCL, fragmentation", CUDA_OVERHEAD_GIB * GIB))

    total_params = s.quantized + s.frozen + s.trainable
    if quantization is not None:  # loaded onto each GPU, the rest upcast to fp32 before the engine casts it
        load_gpu, load_host = s.quantized * kbit + (s.frozen + s.trainable) * 4, 0.0
    else:  # each rank reads the whole model into host RAM; the engine moves it whole to its GPU to shard it
        load_host = per_node * total_params * model_bytes
        load_gpu = total_params * model_bytes if sharded_engine and not offload_weights else 0.0

    tokens_step = world_size * train.gradient_accumulation * tokens_micro
    tokens_note = (
        f"{world_size} ranks x {train.gradient_accumulation} micro-batches x {train.micro_batch_size} x "
        f"{cfg.data.max_length} tokens" + ("" if cfg.data.packing else "; without packing an upper bound")
    )
    times, step_s = _times(cfg, s, traits, world_size, per_node, accelerator, kbit, compute_bytes, weight_b)
    if train.max_steps is not None:
        steps = train.max_steps
    elif num_samples:
        steps = math.ceil(num_samples / (world_size * train.micro_batch_size * train.gradient_accumulation))
        steps *= train.epochs
    else:
        steps = None
    offload = "" if par.cpu_offload == "none" else f", cpu_offload={par.cpu_offload}"
    return Estimate(
        accelerator=accelerator,
        setup=f"{world_size} x {accelerator.name}, {traits.label}{offload}",
        rows=rows,
        load_gpu=load_gpu,
        load_host=load_host,
        tokens_per_step=tokens_step,
        tokens_note=tokens_note,
        times=times,
        step_s=step_s,
        steps=steps,
        activation_factor=s.act_total * compute_bytes / s.hidden / s.layers,
        assumptions=_assumptions(cfg, traits, s),
    )


def _times(
    cfg: Config,
    s: _Shapes,
    traits: EngineTraits,
    world_size: int,
    per_node: int,
    accelerator: Accelerator,
    kbit: float,
    compute_bytes: int,
    grad_bytes: int,
) -> tuple[list[tuple[str, float, str]], float | None]:
    if accelerator.bf16_flops is None:
        return [], None
    train, par = cfg.train, cfg.parallel
    micro = train.gradient_accumulation
    tokens_micro = train.micro_batch_size * cfg.data.max_length
    passes = 4 + (2 if train.gradient_checkpointing else 0)  # forward, input gradients, recompute: 2 each
    rate = accelerator.bf16_flops * BASE_MFU
    other = s.active - s.active_quantized - s.active_routed
    weighted = passes * (other + s.active_quantized / QUANTIZED_EFFICIENCY + s.active_routed / EXPERT_EFFICIENCY)
    weighted += 2 * s.active_trainable + 6 * s.adapter_active  # weight gradients; adapter matmuls
    flops_token = passes * s.active + 2 * s.active_trainable + 6 * s.adapter_active
    compute = micro * tokens_micro * weighted / rate
    mfu_note = (
        f"MFU {BASE_MFU}"
        + (f", routed experts x{EXPERT_EFFICIENCY}" if s.active_routed else "")
        + (f", k-bit layers x{QUANTIZED_EFFICIENCY}" if s.active_quantized else "")
    )
    times = [("compute", compute, f"{flops_token / 1e9:.1f} GFLOP/token, {mfu_note}")]
    gpu_s = compute
    if s.stacked_adapted:  # W + B@A formed in full on every pass: memory-bound on the GPU
        delta_passes = 2 + (1 if train.gradient_checkpointing else 0)
        flops = 2 * cfg.model.lora.r * s.stacked_adapted / rate
        memory = DELTA_BYTES * s.stacked_adapted / (accelerator.memory_bytes_per_s or 2e12)
        delta = micro * delta_passes * max(flops, memory)
        times.append(("expert adapter deltas", delta, f"{_count(s.stacked_adapted)} values formed {delta_passes}x"))
        gpu_s += delta

    sharded3 = traits.sharded
    gather_bytes = s.quantized * kbit + (s.frozen + s.trainable) * compute_bytes
    spread = (world_size - 1) / world_size
    collective = 0.0
    if world_size > 1:
        bandwidth = NVLINK_BYTES_PER_S if world_size <= per_node else NETWORK_BYTES_PER_S
        if sharded3:
            collective += micro * GATHER_PASSES * gather_bytes * spread
        reductions = micro if traits.reduces_every_micro_batch else 1  # FSDP and DDP sync at the last micro-batch
        all_reduce = not traits.shards_anything  # an all-reduce moves twice a reduce-scatter's bytes
        collective += reductions * s.trainable * grad_bytes * spread * (2 if all_reduce else 1)
        collective /= bandwidth
        times.append(("collectives", collective, "overlap compute (prefetch)"))

    host = 0.0
    if par.cpu_offload == "all":
        host += micro * GATHER_PASSES * gather_bytes / world_size  # each rank uploads its shard per pass
    if par.cpu_offload != "none":
        grads_out = micro if traits.reduces_every_micro_batch else 1  # DeepSpeed accumulates them on the host
        host += grads_out * s.trainable * grad_bytes / world_size
        if par.cpu_offload == "optimizer":
            host += s.trainable * compute_bytes / world_size  # updated weights back
        times.append(("PCIe host transfers", host / PCIE_BYTES_PER_S, f"{host / 1e9:.1f} GB per GPU"))
        adam = s.trainable / world_size / CPU_ADAM_PARAMS_PER_S
        times.append(("CPU AdamW", adam, f"{_count(s.trainable / world_size)} parameters per rank"))
        host_s = host / PCIE_BYTES_PER_S + adam
    else:
        host_s = 0.0
    return times, max(gpu_s, collective) + host_s


def _assumptions(cfg: Config, traits: EngineTraits, s: _Shapes) -> list[str]:
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
    if cfg.model.quantization is not None:
        notes.append(
            "k-bit: 4 bits + block constants per weight; the unquantized rest is fp32 after PEFT's k-bit "
            "preparation (16-bit again under DeepSpeed), whole on every GPU while loading"
        )
    notes.append("tokens per micro-batch = micro_batch_size x max_length (shorter unpacked samples cost less)")
    return notes


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
    lines.append("  assumptions:")
    lines += [f"    - {note}" for note in est.assumptions]
    return "\n".join(lines)
