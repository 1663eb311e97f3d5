"""Loading what training wrote: a full model checkpoint, or an adapter on top of its base model.

An adapter's base is rebuilt the way it was trained (recorded in `tuneforge.json`): a QLoRA adapter is
applied to the same 4-bit weights it learned against, or to their dequantized values when merging, so
the result computes what the training model computed.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from tuneforge.checkpoint_records import QUANTIZED_EXPERTS, checkpoint_problems, read_chat_meta
from tuneforge.config.schema import QuantizationConfig
from tuneforge.errors import UserError, first_line
from tuneforge.model.adapters import exact_targets
from tuneforge.model.build import DTYPES, model_class, native_architecture
from tuneforge.model.expert_lora import grouped_layers
from tuneforge.model.portable_adapter import ADAPTER_CONFIG
from tuneforge.model.quantize import bitsandbytes_config, keep_training_layout, storage_dtype
from tuneforge.model.quantized_experts import (
    dequantize_stacked_experts,
    plain_for_peft,
    quantizable_experts,
    quantize_stacked_experts,
)
from tuneforge.model.unloaded_weights import load_keeping_unloaded, recall, remember
from tuneforge.model.vision import is_vision_config
from tuneforge.pickle_guard import refuse_unsafe_pickles, starts_as_zip

ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass
class Trained:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    meta: dict[str, Any]
    base: str | None
    """The base model directory of an adapter checkpoint (None for a full model)."""
    processor: Any = None
    """A vision-language model's processor (its image processor and chat template); None for a text model."""


def is_vision_checkpoint(path: str | Path) -> bool:
    """Whether the model at `path` (a checkpoint, or an adapter's base) is a vision-language model."""
    try:
        return is_vision_config(AutoConfig.from_pretrained(path, trust_remote_code=False))
    except (OSError, ValueError):
        return False


def load_processor(checkpoint: Path) -> Any:
    """A vision-language checkpoint's processor, saved with it by training."""
    from transformers import AutoProcessor

    with loading("processor", checkpoint):
        return AutoProcessor.from_pretrained(checkpoint, trust_remote_code=False)


def is_adapter(checkpoint: Path) -> bool:
    return (checkpoint / ADAPTER_CONFIG).exists()


def is_reward_model(checkpoint: Path) -> bool:
    """A reward model (`train.objective: reward`): a score head, no LM head; it scores, it does not generate."""
    try:  # a damaged file is reported by the loader that reads it next, with its own message
        if is_adapter(checkpoint):
            config = json.loads((checkpoint / ADAPTER_CONFIG).read_text(encoding="utf-8"))
            return isinstance(config, dict) and config.get("task_type") == "SEQ_CLS"
        config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    architectures = config.get("architectures") if isinstance(config, dict) else None
    return isinstance(architectures, list) and any(str(a).endswith("ForSequenceClassification") for a in architectures)


def check_checkpoint(checkpoint: Path) -> None:
    if not checkpoint.is_dir():
        raise UserError(f"{checkpoint}: no such checkpoint directory")
    if not (checkpoint / "config.json").exists() and not is_adapter(checkpoint):
        raise UserError(
            f"{checkpoint}: not a model checkpoint (neither config.json nor {ADAPTER_CONFIG}); pass a "
            "checkpoints/step-N or checkpoints/final directory"
        )
    if problems := checkpoint_problems(checkpoint):
        raise UserError(f"{checkpoint}: damaged since it was written: {'; '.join(problems)}")
    weights = _weight_files(checkpoint)
    if weights == []:  # PyTorch's pickle format: loaded by transformers with weights_only, scanned first to say why
        bins = sorted(checkpoint.glob("pytorch_model*.bin"))
        # Legacy-format files are left to transformers' weights-only loader, which refuses code the same way.
        zipped = [b for b in bins if starts_as_zip(b)]
        refuse_unsafe_pickles(zipped, lambda _: False, str(checkpoint))
    if weights is None:
        expected = ADAPTER_WEIGHTS if is_adapter(checkpoint) else "model.safetensors"
        raise UserError(f"{checkpoint}: no {expected} here: the checkpoint is incomplete; take another one")
    for file in weights:
        try:
            with safe_open(file, framework="pt"):  # reads the header and checks the size it announces
                pass
        except Exception as exc:  # safetensors raises its own error type for a truncated or foreign file
            reason = first_line(exc)
            raise UserError(f"{file}: not readable ({reason}): the checkpoint is damaged; take another one") from None


def _weight_files(checkpoint: Path) -> list[Path] | None:
    """The safetensors files holding a checkpoint's weights (every shard an index names); [] for weights in
    PyTorch's own format (not checked here), None when there are none."""
    if is_adapter(checkpoint):
        return [checkpoint / ADAPTER_WEIGHTS] if (checkpoint / ADAPTER_WEIGHTS).exists() else None
    index = checkpoint / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        missing = [name for name in shards if not (checkpoint / name).exists()]
        if missing:
            raise UserError(f"{checkpoint}: shard {missing[0]} named by {index.name} is missing; take another one")
        return [checkpoint / name for name in shards]
    single = checkpoint / "model.safetensors"
    if single.exists():
        return [single]
    return [] if any(checkpoint.glob("pytorch_model*.bin")) else None


def adapter_base(checkpoint: Path, base: Path | None = None) -> str:
    recorded = json.loads((checkpoint / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    path = str(base) if base is not None else recorded
    if not path or not Path(path).exists():
        raise UserError(
            f"{checkpoint}: the adapter's base model {path!r} (from {ADAPTER_CONFIG}) is not here; "
            "pass --base DIR with the model it was trained on"
        )
    return path


def allow_remote_code(path: str, trust_remote_code: bool, recorded: bool = False) -> bool:
    """Whether to run the Python code of model directory `path`: only where transformers lacks the architecture
    and the user said so (`--trust-remote-code`). What a received checkpoint records (`recorded`: it trained with
    model.trust_remote_code) only words the refusal; a file never turns remote code on."""
    if (trust_remote_code or recorded) and native_architecture(path):
        return False  # as in training: transformers' own implementation where it has one
    if trust_remote_code:
        return True
    try:
        AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, OSError) as exc:
        if "trust_remote_code" not in str(exc) and "auto_map" not in str(exc):
            reason = first_line(exc, 300)
            raise UserError(f"{path}: the model's config.json cannot be read ({reason})") from None
        trained = " (it was trained with model.trust_remote_code: true)" if recorded else ""
        raise UserError(
            f"{path}: transformers does not implement this model's architecture; loading it runs the Python "
            f"files in that directory{trained}. If you trust them, pass --trust-remote-code"
        ) from None
    return False


def _load_base(
    path: str, adapter_meta: dict[str, Any], dequantize: bool, trust_remote_code: bool = False, scored: bool = False
) -> PreTrainedModel:
    """`scored`: the adapters are a reward model's (their own score head replaces the one made here)."""
    remote = allow_remote_code(path, trust_remote_code, bool(adapter_meta.get("trust_remote_code", False)))
    quantization = adapter_meta.get("quantization")
    head = {"num_labels": 1} if scored else {}
    vision = is_vision_checkpoint(path)
    if quantization is None:
        options = {"dtype": torch.float32, "trust_remote_code": remote, **head}
        return load_keeping_unloaded(model_class(scored, vision), path, **options)
    settings = QuantizationConfig.model_validate(quantization)
    model = load_keeping_unloaded(
        model_class(scored, vision),
        path,
        dtype=torch.float32,
        trust_remote_code=remote,
        **head,
        quantization_config=bitsandbytes_config(settings, sharded_engine=False),
        device_map={"": "cpu"},
    )
    if settings.bits == 4:
        _quantize_experts_as_trained(model, settings, adapter_meta.get(QUANTIZED_EXPERTS), path)
    if dequantize:
        # The exact values the adapter was trained against, as plain float32 weights.
        unloaded = recall(model)
        model = model.dequantize()
        dequantize_stacked_experts(model)
        remember(model, unloaded)
        return model
    keep_training_layout(model)  # the same kernels as in training, so chat answers as the samples did
    return model


def _quantize_experts_as_trained(
    model: PreTrainedModel, settings: QuantizationConfig, recorded: int | None, path: str
) -> None:
    """Stores the stacked experts in 4 bits if the adapter trained against them so (`recorded`, from its
    `tuneforge.json`), so that it computes what the training model computed."""
    if recorded is None:
        if quantizable_experts(model, settings):
            print(
                "model: this adapter's tuneforge.json predates 4-bit stacked experts: its routed experts trained "
                "in full precision and are loaded so"
            )
        return
    count = quantize_stacked_experts(model, settings, storage_dtype(settings, sharded_engine=False))
    if count != recorded:
        raise UserError(
            f"{path}: {count} experts module(s) of this base are stored in 4 bits, but the adapter trained with "
            f"{recorded}: it is not the base the adapter was trained on, or it loads with other code than in "
            "training (another transformers version); pass --base DIR with that model, in the training's "
            "environment"
        )


@contextlib.contextmanager
def loading(what: str, path: Path | str) -> Iterator[None]:
    """What transformers raises for files it cannot read (a config that does not match the weights, a tokenizer
    file cut short), as one line naming the directory."""
    try:
        yield
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        reason = first_line(exc, 300)
        raise UserError(
            f"{path}: the {what} cannot be loaded ({type(exc).__name__}: {reason}); its files are damaged or do not "
            "belong together: take another checkpoint"
        ) from None


def load_trained(
    checkpoint: Path, base: Path | None = None, merge: bool = False, trust_remote_code: bool = False
) -> Trained:
    """The trained model in float32 on CPU. With `merge`, adapters are folded into (dequantized) base weights
    and a plain `transformers` model is returned. Python code shipped with a model runs only with
    `trust_remote_code` (the user's --trust-remote-code), never because a checkpoint asks for it."""
    from peft import PeftConfig, PeftModel

    transformers.utils.logging.disable_progress_bar()
    check_checkpoint(checkpoint)
    meta = read_chat_meta(checkpoint) or {}
    remote = not is_adapter(checkpoint) and allow_remote_code(str(checkpoint), trust_remote_code)
    with loading("tokenizer", checkpoint):
        tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=remote)
    processor = load_processor(checkpoint) if is_vision_checkpoint(checkpoint) else None
    if not is_adapter(checkpoint):
        scored = is_reward_model(checkpoint)
        with loading("model", checkpoint):
            model = load_keeping_unloaded(
                model_class(scored, processor is not None), checkpoint, dtype=torch.float32, trust_remote_code=remote
            )
        return Trained(model.eval(), tokenizer, meta, None, processor)
    base_path = adapter_base(checkpoint, base)
    config = PeftConfig.from_pretrained(checkpoint)
    scored = config.task_type == "SEQ_CLS"
    base_model = _load_base(base_path, meta.get("adapter", {}), merge, trust_remote_code, scored)
    if not merge and getattr(config, "target_parameters", None):
        # Adapters on stacked experts run as in training: grouped low-rank products, no W + B·A per token.
        layers, _ = grouped_layers(base_model, config.target_parameters)
        if layers:
            config._register_custom_module(layers)
    with exact_targets(base_model), plain_for_peft(base_model):
        model = PeftModel.from_pretrained(base_model, checkpoint, config=config)
    if merge:
        model = model.merge_and_unload()
    if processor is None and is_vision_checkpoint(base_path):
        processor = load_processor(Path(base_path))
    return Trained(model.eval(), tokenizer, meta, base_path, processor)


def base_dtype(path: str) -> torch.dtype:
    """The dtype a model directory's weights were saved in (float32 when not recorded)."""
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return DTYPES.get(name, torch.float32)


def model_values(path: str | Path) -> int:
    """Weight values of the model at `path` as it loads (an adapter's base and the adapter): from the safetensors
    headers, nothing loaded. 0 where they cannot be read (what loads it next says why)."""
    checkpoint = Path(path)
    try:
        files = _weight_files(checkpoint) or []
        if is_adapter(checkpoint):
            files += _weight_files(Path(adapter_base(checkpoint))) or []
        values = 0
        for file in files:
            with safe_open(file, "pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - a safetensors handle is not a mapping
                    values += math.prod(handle.get_slice(name).get_shape())
        return values
    except (OSError, ValueError, UserError):
        return 0
