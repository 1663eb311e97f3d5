"""Tokenizer and model from the `model` config section: loaded from a directory, or built fresh."""

from __future__ import annotations

import difflib
import importlib
import json
import os
import shutil
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from tuneforge.config.schema import ModelConfig
from tuneforge.data.byte_tokenizer import build_byte_tokenizer
from tuneforge.distributed import DistInfo, barrier, gather_objects
from tuneforge.errors import UserError
from tuneforge.model import packed_attention
from tuneforge.model.compose import compose_llava, composed_config, load_projector, with_image_token
from tuneforge.model.own_code import own_code_problem
from tuneforge.model.quantize import (
    bitsandbytes_config,
    check_cpu_kernel_sizes,
    kbit_bytes,
    keep_training_layout,
    quantized_linears,
    storage_dtype,
    stored_numel,
)
from tuneforge.model.quantized_experts import quantize_stacked_experts, stacked_numel
from tuneforge.model.staging import (
    Staging,
    available_host_bytes,
    check_host_room,
    choose_staging,
    device_load_bytes,
)
from tuneforge.model.unloaded_weights import load_keeping_unloaded, recall
from tuneforge.model.vision import VisionParts, is_vision_config, is_vision_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_tokenizer(cfg: ModelConfig, local_files_only: bool = False) -> PreTrainedTokenizerBase:
    """`local_files_only`: never ask the hub (a missing tokenizer then fails at once instead of retrying)."""
    source = cfg.tokenizer or cfg.path
    if source == "bytes":
        tokenizer = build_byte_tokenizer()
    else:
        tokenizer = AutoTokenizer.from_pretrained(
            source, trust_remote_code=cfg.trust_remote_code, local_files_only=local_files_only
        )
    if cfg.architecture is not None and is_vision_model(cfg):
        from tuneforge.model.fresh_vision import vision_tokenizer

        tokenizer = vision_tokenizer(tokenizer, cfg.architecture)  # with the family's image tokens
    if cfg.vision is not None and cfg.vision.tower_path is not None:
        tokenizer = with_image_token(tokenizer)
    if tokenizer.eos_token is None:
        raise UserError(f"model.tokenizer: the tokenizer at {source} has no EOS token; set one in its config")
    if tokenizer.pad_token is None:
        # Padding positions are masked out of attention and loss, so reusing EOS is safe.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _fresh_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase):
    if cfg.architecture not in CONFIG_MAPPING:
        close = difflib.get_close_matches(cfg.architecture, list(CONFIG_MAPPING.keys()), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UserError(f"model.architecture: {cfg.architecture!r} is not a transformers model type{hint}")
    if is_vision_model(cfg):
        from tuneforge.model.fresh_vision import fresh_vision_config

        return fresh_vision_config(cfg.architecture, cfg.size, tokenizer)
    defaults = AutoConfig.for_model(cfg.architecture)
    for key in cfg.size:
        if not hasattr(defaults, key) and not _read_by_modeling_code(cfg.architecture, key):
            close = difflib.get_close_matches(key, list(defaults.to_dict()), n=1)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            raise UserError(f"model.size.{key}: not a field of the {cfg.architecture} config{hint}")
    return AutoConfig.for_model(
        cfg.architecture,
        **{
            **cfg.size,
            "vocab_size": len(tokenizer),
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
    )


def model_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The model's config alone (no weights): a fresh model's from `model.size`, else `model.path`'s config.json."""
    if cfg.architecture is not None:
        return _fresh_config(cfg, tokenizer)
    if cfg.vision is not None and cfg.vision.tower_path is not None:
        return composed_config(cfg.path, cfg.vision.tower_path, tokenizer, cfg.trust_remote_code)
    return AutoConfig.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code)


def check_model_code(cfg: ModelConfig) -> None:
    """A `model.path` that cannot load without running its own code (see `tuneforge.model.own_code`), refused in
    one line."""
    if problem := own_code_problem(cfg.path, cfg.trust_remote_code):
        raise UserError(problem)


def _read_by_modeling_code(model_type: str, key: str) -> bool:
    """Some config fields exist only when given (Qwen3-MoE's `head_dim`); the modeling code reading
    `config.<key>` is what makes them meaningful."""
    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        return False
    source = Path(module.__file__).read_text(encoding="utf-8")
    return f"config.{key}" in source or f'"{key}"' in source


def native_architecture(path: str) -> bool:
    """Whether `transformers` itself implements the checkpoint's architecture. Its implementation is preferred
    over the checkpoint's remote code: it is tested, and MoE blocks there run every rank's collectives alike."""
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, OSError):
        return False
    print(
        f"model: trust_remote_code was set, but transformers implements {config.model_type} natively; "
        "using the native implementation"
    )
    return True


def _skeleton(path: str, remote: bool, required: bool) -> torch.nn.Module | None:
    """The model without weights (meta device), to read its shapes before loading; None where its code cannot
    build it so and the caller can do without."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=remote)
    try:
        with torch.device("meta"):
            return model_class(False, is_vision_config(config)).from_config(config, trust_remote_code=remote)
    except Exception:  # remote code may need real tensors (a custom init): then the shapes are unknown
        if required:
            raise
        return None


def model_class(scalar_head: bool, vision: bool = False) -> type:
    """The transformers auto class: the causal LM, or for reward models the same network with a score head
    (`XForSequenceClassification`, one label) in place of the LM head; a vision-language model's
    image-text-to-text class."""
    if vision:
        if scalar_head:
            raise UserError("reward models of vision-language models are not supported; train a text model")
        return AutoModelForImageTextToText
    return AutoModelForSequenceClassification if scalar_head else AutoModelForCausalLM


def _load(
    path: str,
    cfg: ModelConfig,
    device: torch.device,
    sharded_engine: bool,
    info: DistInfo | None = None,
    scalar_head: bool = False,
) -> PreTrainedModel:
    remote = cfg.trust_remote_code and not native_architecture(path)
    vision = is_vision_model(cfg.model_copy(update={"path": path, "architecture": None}))
    options: dict = {"dtype": DTYPES[cfg.dtype], "attn_implementation": cfg.attn_implementation}
    if scalar_head:
        options["num_labels"] = 1
    staging: Staging = "device"
    if cfg.quantization is not None:
        skeleton = _skeleton(path, remote, required=device.type == "cpu")
        if device.type == "cpu":
            check_cpu_kernel_sizes(skeleton, cfg.quantization)
        staging = _staging(skeleton, cfg, device, info)
        options["quantization_config"] = bitsandbytes_config(cfg.quantization, sharded_engine)
        options["device_map"] = {"": "cpu" if staging == "host" else device}
    try:
        model = load_keeping_unloaded(model_class(scalar_head, vision), path, trust_remote_code=remote, **options)
    except OSError as exc:
        raise UserError(f"model.path: cannot load a model from {path!r} ({exc})") from None
    except ValueError as exc:
        if "attention implementation" not in str(exc):
            raise
        raise UserError(
            f"model.attn_implementation: {cfg.attn_implementation} is not supported by this model; "
            "set model.attn_implementation=eager"
        ) from None
    if cfg.quantization is not None:
        keep_training_layout(model)
        if cfg.quantization.bits == 4:
            storage = storage_dtype(cfg.quantization, sharded_engine)
            quantize_stacked_experts(model, cfg.quantization, storage, device if staging == "host" else None)
        if staging == "host":
            model.to(device)  # the k-bit linear layers carry their quantization state along
    return model


def _staging(
    skeleton: torch.nn.Module | None, cfg: ModelConfig, device: torch.device, info: DistInfo | None
) -> Staging:
    """Where the 4-bit model loads before its stacked experts are quantized (see `tuneforge.model.staging`); the
    same on every rank (each rank's model must be the same), decided on the least free memory of any rank."""
    settings = cfg.quantization
    if device.type == "cpu":  # host RAM is the device's memory
        return "device"
    if skeleton is None:
        if settings.stage_experts == "host":
            raise UserError(
                "model.quantization.stage_experts=host: the model's shapes cannot be read without loading it "
                "(its remote code does not build on the meta device); use auto or device"
            )
        if info is None or info.is_main:
            print("model: its shapes cannot be read before loading (remote code): loading onto the GPU")
        return "device"
    stacked = stacked_numel(skeleton, settings)
    if not stacked:
        return "device"
    linear = sum(module.weight.numel() for _, module in quantized_linears(skeleton, settings))
    rest = sum(p.numel() for p in skeleton.parameters()) - stacked - linear
    kbit = kbit_bytes(settings.bits, settings.double_quant)
    on_device = device_load_bytes(stacked, linear, rest, DTYPES[cfg.dtype].itemsize, kbit)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else float("inf")
    host = available_host_bytes()
    if info is not None:  # one decision for all ranks
        free, host = (min(values) for values in zip(*gather_objects((free, host), info), strict=True))
    staging = choose_staging(settings.stage_experts, on_device, free)
    if staging == "host":
        check_host_room(settings.stage_experts, on_device, free, host, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if staging == "host" and (info is None or info.is_main):
        print(
            f"model: loading into host RAM first (model.quantization.stage_experts={settings.stage_experts}): on "
            f"{device} it would take {on_device / 2**30:.1f} GiB with the stacked experts in {cfg.dtype}, "
            f"{free / 2**30:.1f} GiB are free; each expert stack is quantized on {device} alone"
        )
    return staging


def build_model(
    cfg: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    seed: int,
    info: DistInfo | None = None,
    base_dir: Path | None = None,
    sharded_engine: bool = False,
    scalar_head: bool = False,
) -> PreTrainedModel:
    """A fresh model is initialised under `seed`, so the same config gives the same weights where it is
    initialised on the same device: on a GPU, DDP and single runs initialise there and sharded engines on the
    host, whose random streams differ (start both from a saved model to compare them). A fresh model
    trained with adapters is first written to `base_dir` (by rank 0): export, chat and quantized loading need
    its base weights on disk. `scalar_head`: a reward model (see `model_class`), its score head new unless the
    checkpoint has one; the tokenizer's pad token tells its score position (the last token that is not one)."""
    info = info or DistInfo(0, 1, 0, torch.device("cpu"))
    if cfg.architecture is not None:
        torch.manual_seed(seed)
        # Random initialisation of billions of weights takes a minute on host cores and a second on a GPU; a
        # sharded engine places its shards itself, so it starts from host memory.
        init_device = info.device if info.device.type == "cuda" and not sharded_engine else torch.device("cpu")
        with init_device:
            config = _fresh_config(cfg, tokenizer)
            if scalar_head:
                config.num_labels = 1
            model = model_class(scalar_head, is_vision_config(config)).from_config(
                config, dtype=DTYPES[cfg.dtype], attn_implementation=cfg.attn_implementation
            )
        if cfg.lora is not None:
            if base_dir is None:
                raise ValueError("a fresh model with adapters needs a base_dir")
            if info.is_main:
                model.save_pretrained(base_dir, safe_serialization=True)
                tokenizer.save_pretrained(base_dir)
            barrier(info)
            model.name_or_path = str(base_dir.resolve())
            if cfg.quantization is not None:
                model = _load(str(base_dir), cfg, info.device, sharded_engine, info, scalar_head)
    elif cfg.vision is not None and cfg.vision.tower_path is not None:
        check_model_code(cfg)
        torch.manual_seed(seed)  # the new projector's initialisation
        model = compose_llava(
            cfg.path,
            cfg.vision.tower_path,
            tokenizer,
            DTYPES[cfg.dtype],
            cfg.attn_implementation,
            cfg.trust_remote_code,
        )
        if not sharded_engine:
            model.to(info.device)
    else:
        check_model_code(cfg)
        model = _load(cfg.path, cfg, info.device, sharded_engine, info, scalar_head)
        if info.is_main and (unloaded := recall(model)) is not None:
            kept = "the base keeps them" if cfg.lora is not None else "checkpoints and merged exports copy them"
            print(f"model: {unloaded.describe()} in {cfg.path}: they do not train; {kept} unchanged")
    if cfg.vision is not None and cfg.vision.projector_weights is not None:
        parts = VisionParts.of(model)
        if parts is None:
            raise UserError("model.vision.projector_weights: this model is a text model")
        if info.is_main:
            print(load_projector(model.get_submodule(parts.projector), cfg.vision.projector_weights))
        else:
            load_projector(model.get_submodule(parts.projector), cfg.vision.projector_weights)
    if cfg.attn_implementation == "sdpa" and model._can_set_attn_implementation():
        # A masked SDPA computes every packed row's whole square (and on GPUs loses the flash kernel): attend
        # within each sample instead, samples batched by length.
        model.set_attn_implementation(packed_attention.register())
    if scalar_head:
        model.config.pad_token_id = tokenizer.pad_token_id  # transformers' scoring position needs it
        if cfg.lora is not None and cfg.path is not None and base_dir is not None:
            model.name_or_path = reward_base(cfg.path, base_dir, tokenizer.pad_token_id, info)
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        raise UserError(
            f"model.tokenizer: the tokenizer has {len(tokenizer)} tokens but the model embeds only "
            f"{model.get_input_embeddings().num_embeddings}; use the model's own tokenizer"
        )
    return model


def reward_base(path: str, base_dir: Path, pad_token_id: int | None, info: DistInfo) -> str:
    """The directory a reward model's adapters name as their base (PEFT records the model's `name_or_path`):
    the model at `path` as tuneforge trains it, one label and the tokenizer's pad token in its config.json, its
    other files links to `path`'s own. Loaders that build the base from its config alone (PEFT's
    `AutoPeftModelForSequenceClassification`) then make the same one-row score head and read each score at the
    same token; the causal LM's config says neither. `path` is never written to; a hub id is left as it is."""
    source = Path(path)
    if not source.is_dir() or source.resolve() == base_dir.resolve():
        return path
    if info.is_main:
        _write_reward_base(source.resolve(), base_dir, pad_token_id)
    barrier(info)
    return str(base_dir.resolve())


def _write_reward_base(source: Path, base_dir: Path, pad_token_id: int | None) -> None:
    base_dir.mkdir(parents=True, exist_ok=True)
    for old in base_dir.iterdir():  # an earlier run's links (a resumed run writes them again)
        if old.is_symlink():
            old.unlink()
    for entry in source.iterdir():
        if entry.name == "config.json":
            continue
        link = base_dir / entry.name
        if link.is_dir():
            shutil.rmtree(link)
        elif link.exists():
            link.unlink()
        link.symlink_to(entry)
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    config.pop("num_labels", None)  # transformers counts the labels from id2label
    config.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}, pad_token_id=pad_token_id)
    (base_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def build_frozen_copy(
    cfg: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    seed: int,
    info: DistInfo,
    base_dir: Path,
    sharded_engine: bool = False,
) -> PreTrainedModel:
    """The model training starts from, loaded a second time, without adapters (DPO's frozen reference). A fresh
    model is initialised again under the same seed on the same device (the same weights); a fresh base for
    adapters is read back from `base_dir`, where the policy's load wrote it."""
    if cfg.architecture is not None and cfg.lora is not None:
        cfg = cfg.model_copy(update={"architecture": None, "path": str(base_dir)})
    model = build_model(cfg.model_copy(update={"lora": None}), tokenizer, seed, info, None, sharded_engine)
    if cfg.quantization is not None:
        from peft import prepare_model_for_kbit_training

        # What the policy's k-bit preparation does to its base (its weights left in 16 bits cast to fp32), so
        # the copy computes what the base with disabled adapters would; no checkpointing without a backward.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return model


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(stored_numel(p) for p in model.parameters() if p.requires_grad)
    total = sum(stored_numel(p) for p in model.parameters())
    return trainable, total
