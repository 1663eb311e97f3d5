"""Fresh (randomly initialised) vision-language models and their processors, built locally: no hub, no download.

A fresh VLM comes from `model.architecture` (a transformers model type such as `llava` or `qwen2_5_vl`) and
`model.size` (its config fields, nested: `{"text_config": {...}, "vision_config": {...}, ...}`), with a local
tokenizer (the byte tokenizer, or a directory's). Three pieces must agree, and this module makes them:

- the tokenizer holds the family's vision special tokens, named the way its processor reads them
  (`tokenizer.image_token`, `tokenizer.boi_token`, ...): `vision_tokenizer`;
- the config's token ids (`image_token_id`, ...) are those tokens' ids, and its text vocabulary is the
  tokenizer's: `fresh_vision_config`;
- the processor expands each image placeholder into as many tokens as the vision tower gives features:
  `fresh_processor`, its image processor sized from the vision config, with a chat template that renders
  OpenAI content parts.

Qwen-VL and InternVL processors hold a video processor, which transformers builds with torchvision only: without
torchvision their processors cannot be built (nor loaded by `AutoProcessor`), and `fresh_processor` says so.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
)
from transformers.utils import is_torchvision_available

from tuneforge.errors import UserError, first_line


@dataclass(frozen=True)
class Family:
    """What one VLM family needs of its tokenizer, config and chat template."""

    tokens: dict[str, str]
    """Tokenizer attribute -> special token, as the family's processor reads them (`tokenizer.image_token`)."""
    config_ids: dict[str, str]
    """Config field -> the tokenizer attribute whose token id it holds."""
    placeholder: str
    """What the chat template writes for one image; the processor expands it to the image's tokens."""
    video_processor: str | None = None
    """The transformers class of its processor's video processor (which needs torchvision), if it has one."""


_QWEN_TOKENS = {
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
}
_QWEN_IDS = {
    "image_token_id": "image_token",
    "video_token_id": "video_token",
    "vision_start_token_id": "vision_start_token",
    "vision_end_token_id": "vision_end_token",
}
_QWEN_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"

FAMILIES: dict[str, Family] = {
    "llava": Family({"image_token": "<image>"}, {"image_token_index": "image_token"}, "<image>\n"),
    "llava_next": Family({"image_token": "<image>"}, {"image_token_index": "image_token"}, "<image>\n"),
    "qwen2_5_vl": Family(_QWEN_TOKENS, _QWEN_IDS, _QWEN_PLACEHOLDER, "Qwen2VLVideoProcessor"),
    "qwen3_vl": Family(_QWEN_TOKENS, _QWEN_IDS, _QWEN_PLACEHOLDER, "Qwen3VLVideoProcessor"),
    "qwen3_vl_moe": Family(_QWEN_TOKENS, _QWEN_IDS, _QWEN_PLACEHOLDER, "Qwen3VLVideoProcessor"),
    "internvl": Family(
        {
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        },
        {"image_token_id": "context_image_token"},
        "<IMG_CONTEXT>\n",
        "InternVLVideoProcessor",
    ),
    "gemma3": Family(
        {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
        {"boi_token_index": "boi_token", "eoi_token_index": "eoi_token", "image_token_index": "image_token"},
        "<start_of_image>",
    ),
}
"""The supported model types."""

VISION_TOKENS: dict[str, dict[str, str]] = {name: dict(fam.tokens) for name, fam in FAMILIES.items()}
"""Model type -> {tokenizer attribute: special token} its processor needs."""

DEFAULT_MAX_IMAGE_TOKENS = 64
"""Qwen-VL: the most tokens one image becomes (its processor resizes larger images down); real checkpoints allow
about 1280, which a fresh demo model has no use for."""


MAX_INTERNVL_TILES = 12
"""InternVL: the most tiles an image is cut into, as its real checkpoints do."""


def family(model_type: str) -> Family:
    """The family of `model_type`, or a UserError naming the supported ones."""
    if model_type not in FAMILIES:
        close = difflib.get_close_matches(model_type, list(FAMILIES), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UserError(
            f"model.architecture: {model_type!r} is not a vision-language model type tuneforge builds fresh{hint}; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


# ---- tokenizer


def vision_tokenizer(tokenizer: PreTrainedTokenizerBase, model_type: str) -> PreTrainedTokenizerBase:
    """`tokenizer` with the family's vision tokens as named special tokens (`tokenizer.image_token`,
    `tokenizer.image_token_id`, saved in tokenizer_config.json); the same tokenizer where it has them all. Tokens it
    names already keep their strings and ids (a real checkpoint's tokenizer)."""
    missing = {name: token for name, token in family(model_type).tokens.items() if _named(tokenizer, name) is None}
    if not missing:
        return tokenizer
    with tempfile.TemporaryDirectory() as directory:
        tokenizer.save_pretrained(directory)
        # transformers 5 names model-specific special tokens through `extra_special_tokens` given as a dict at
        # load time: each becomes an attribute, is added to the vocabulary (in this order) and is saved.
        named = AutoTokenizer.from_pretrained(directory, extra_special_tokens=missing)
    # The dict replaces the tokenizer's list of unnamed special tokens (their ids stay): list them again.
    named.add_special_tokens(
        {"extra_special_tokens": tokenizer.extra_special_tokens}, replace_extra_special_tokens=False
    )
    return named


def _named(tokenizer: PreTrainedTokenizerBase, name: str) -> str | None:
    return getattr(tokenizer, name, None)  # a tokenizer without the attribute raises AttributeError


def token_ids(tokenizer: PreTrainedTokenizerBase, model_type: str) -> dict[str, int]:
    """Config field -> id, for the family's token ids (`image_token_id`, ...), from `tokenizer`."""
    ids = {}
    for field, name in family(model_type).config_ids.items():
        token = _named(tokenizer, name)
        token_id = tokenizer.convert_tokens_to_ids(token) if token is not None else None
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise UserError(f"model.tokenizer: the tokenizer has no {name} for {model_type} (see vision_tokenizer)")
        ids[field] = token_id
    return ids


# ---- config


def fresh_vision_config(model_type: str, size: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The config of a fresh `model_type` VLM: `size`'s fields over transformers' defaults, the text vocabulary and
    bos/eos/pad ids from `tokenizer` (which `vision_tokenizer` prepared), the vision token ids from it too, and the
    fields that must agree with others derived where `size` leaves them out (the Qwen-VL projector width and mrope
    split, InternVL's tokens per tile, LLaVA-NeXT's resolutions). Unknown fields and bad values are UserErrors."""
    family(model_type)
    _check_fields(model_type, size)
    kwargs = copy.deepcopy(size)
    text = kwargs.setdefault("text_config", {})
    text.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    kwargs.update(token_ids(tokenizer, model_type))
    try:
        config = AutoConfig.for_model(model_type, **kwargs)
        _DERIVE.get(model_type, _nothing)(config, size)
    except (StrictDataclassError, ValueError, TypeError) as exc:  # transformers 5 configs check each field
        raise UserError(f"model.size: {first_line(exc)}") from None
    return config


def _check_fields(model_type: str, size: dict[str, Any]) -> None:
    """Every key of `size` is a field of the config (or of its sub-config), as `_fresh_config` checks for text
    models: a misspelt field would otherwise be kept silently and change nothing."""
    if not isinstance(size, dict):
        raise UserError(f"model.size: expected a mapping of config fields, got {type(size).__name__}")
    sub_types = {
        k: {"model_type": v["model_type"]} for k, v in size.items() if isinstance(v, dict) and "model_type" in v
    }
    try:
        defaults = AutoConfig.for_model(model_type, **sub_types)
    except (ValueError, KeyError) as exc:  # a sub-config's model_type transformers lacks
        raise UserError(f"model.size: {first_line(exc)}") from None
    _check_keys(defaults, size, "model.size", model_type)


def _check_keys(defaults: PretrainedConfig, values: dict[str, Any], where: str, model_type: str) -> None:
    for key, value in values.items():
        if key == "model_type":
            continue
        if not hasattr(defaults, key):
            close = difflib.get_close_matches(key, list(defaults.to_dict()), n=1)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            raise UserError(f"{where}.{key}: not a field of the {model_type} config{hint}")
        sub = getattr(defaults, key)
        if isinstance(sub, PretrainedConfig):
            if not isinstance(value, dict):
                raise UserError(f"{where}.{key}: expected a mapping of {sub.model_type} config fields")
            _check_keys(sub, value, f"{where}.{key}", sub.model_type)


def _given(size: dict[str, Any], *path: str) -> bool:
    """Whether `size` sets the field at `path` (then it is the user's, never derived)."""
    for key in path:
        if not isinstance(size, dict) or key not in size:
            return False
        size = size[key]
    return True


def _nothing(config: PretrainedConfig, size: dict[str, Any]) -> None:
    pass


def _clip_cls_tokens(vision_config: PretrainedConfig) -> int:
    """Features a vision tower gives beyond its patches: CLIP's CLS token."""
    return 1 if vision_config.model_type == "clip_vision_model" else 0


def _llava_tokens(config: PretrainedConfig, image_size: int) -> int:
    """Tokens of one `image_size` square image (LLaVA, and LLaVA-NeXT's base image)."""
    vision = config.vision_config
    tokens = (image_size // vision.patch_size) ** 2 + _clip_cls_tokens(vision)
    return tokens - (1 if config.vision_feature_select_strategy == "default" else 0)


def _derive_llava(config: PretrainedConfig, size: dict[str, Any]) -> None:
    if not _given(size, "image_seq_length"):
        config.image_seq_length = _llava_tokens(config, config.vision_config.image_size)


def _derive_llava_next(config: PretrainedConfig, size: dict[str, Any]) -> None:
    _derive_llava(config, size)
    if not _given(size, "image_grid_pinpoints"):
        # The default resolutions are multiples of 336 px; a tower of another size needs its own multiples.
        side = config.vision_config.image_size
        config.image_grid_pinpoints = [[side, 2 * side], [2 * side, side], [2 * side, 2 * side]]


def _head_dim(text_config: PretrainedConfig) -> int:
    return getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads


def _derive_qwen(config: PretrainedConfig, size: dict[str, Any], spatial_share: float) -> None:
    """The projector's width is the language model's; mrope splits each head's rotary frequencies between time,
    height and width (`spatial_share` of them to each spatial axis, as the family's real checkpoints do)."""
    text, vision = config.text_config, config.vision_config
    if not _given(size, "vision_config", "out_hidden_size"):
        vision.out_hidden_size = text.hidden_size
    if not _given(size, "text_config", "rope_parameters", "mrope_section"):
        half = _head_dim(text) // 2
        spatial = max(1, int(half * spatial_share))
        text.rope_parameters = {**(text.rope_parameters or {}), "mrope_section": [half - 2 * spatial, spatial, spatial]}


def _derive_qwen2_5_vl(config: PretrainedConfig, size: dict[str, Any]) -> None:
    _derive_qwen(config, size, 3 / 8)  # [16, 24, 24] of 64


def _derive_qwen3_vl(config: PretrainedConfig, size: dict[str, Any]) -> None:
    _derive_qwen(config, size, 5 / 16)  # [24, 20, 20] of 64; interleaved, each spatial axis takes every 3rd
    vision, text = config.vision_config, config.text_config
    if not _given(size, "vision_config", "deepstack_visual_indexes"):
        # Deepstack feeds these vision layers' features to the first language layers: both must exist.
        vision.deepstack_visual_indexes = list(range(min(3, vision.depth, text.num_hidden_layers)))


def _derive_internvl(config: PretrainedConfig, size: dict[str, Any]) -> None:
    vision = config.vision_config
    patches = (vision.image_size[0] // vision.patch_size[0]) * (vision.image_size[1] // vision.patch_size[1])
    if not _given(size, "image_seq_length"):
        config.image_seq_length = int(patches * config.downsample_ratio**2)  # pixel shuffle merges patches


def _derive_gemma3(config: PretrainedConfig, size: dict[str, Any]) -> None:
    """Gemma3 average-pools the patch grid down to `mm_tokens_per_image` tokens: a square that divides it."""
    side = config.vision_config.image_size // config.vision_config.patch_size
    per_side = math.isqrt(config.mm_tokens_per_image)
    if per_side * per_side != config.mm_tokens_per_image or side % per_side:
        raise UserError(
            f"model.size.mm_tokens_per_image: {config.mm_tokens_per_image} must be a square whose side divides the "
            f"vision tower's {side}x{side} patch grid (image_size / patch_size)"
        )


_DERIVE: dict[str, Callable[[PretrainedConfig, dict[str, Any]], None]] = {
    "llava": _derive_llava,
    "llava_next": _derive_llava_next,
    "qwen2_5_vl": _derive_qwen2_5_vl,
    "qwen3_vl": _derive_qwen3_vl,
    "qwen3_vl_moe": _derive_qwen3_vl,
    "internvl": _derive_internvl,
    "gemma3": _derive_gemma3,
}


# ---- chat template


def vision_chat_template(model_type: str) -> str:
    """A ChatML-style Jinja template: each message `<|im_start|>ROLE\\n`, its content (a string, or OpenAI content
    parts: `{"type": "text", "text": ...}`, and `{"type": "image"}` as the family's image placeholder) and the
    tokenizer's EOS; `add_generation_prompt` opens an assistant turn. Each turn only appends, so rendering
    messages[:k] with a generation prompt is a prefix of rendering messages[:k+1] (the loss mask relies on it), and
    a reply ends in EOS, where generation stops."""
    placeholder = json.dumps(family(model_type).placeholder)
    return (
        "{%- for message in messages -%}"
        "{{ '<|im_start|>' ~ message['role'] ~ '\\n' }}"
        "{%- if message['content'] is string -%}{{ message['content'] }}"
        "{%- elif message['content'] is iterable -%}"
        "{%- for part in message['content'] -%}"
        "{%- if part['type'] in ['image', 'image_url'] -%}{{ " + placeholder + " }}"
        "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
        "{%- else -%}{{ raise_exception('content part of type ' ~ part['type'] ~ ' is not supported') }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- endif -%}"
        "{{ eos_token ~ '\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


# ---- processor


def _image_processor_class(name: str) -> type:
    """The torchvision build of an image processor where torchvision is installed, else its PIL build: the one
    `AutoProcessor` loads back in the same environment."""
    return getattr(transformers, name if is_torchvision_available() else f"{name}Pil")


def _square(value: int | list[int] | tuple[int, ...]) -> int:
    return value if isinstance(value, int) else value[0]


def _qwen_shape(config: PretrainedConfig) -> dict[str, int]:
    vision = config.vision_config
    return {
        "patch_size": vision.patch_size,
        "merge_size": vision.spatial_merge_size,
        "temporal_patch_size": vision.temporal_patch_size,
    }


def _qwen_token_pixels(config: PretrainedConfig) -> int:
    """Pixels of one image token: a merge x merge block of patches."""
    return (config.vision_config.patch_size * config.vision_config.spatial_merge_size) ** 2


def _internvl_tiles(config: PretrainedConfig, max_image_tokens: int) -> int:
    return min(MAX_INTERNVL_TILES, max(1, max_image_tokens // max(1, config.image_seq_length)))


def _llava_images(config: PretrainedConfig, max_image_tokens: int):
    side = _square(config.vision_config.image_size)
    return _image_processor_class("CLIPImageProcessor")(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )


def _llava_next_images(config: PretrainedConfig, max_image_tokens: int):
    side = _square(config.vision_config.image_size)
    return _image_processor_class("LlavaNextImageProcessor")(
        size={"shortest_edge": side},
        crop_size={"height": side, "width": side},
        image_grid_pinpoints=config.image_grid_pinpoints,
    )


def _qwen_images(config: PretrainedConfig, max_image_tokens: int):
    """Images are resized to multiples of a token's pixels, between one token and `max_image_tokens`."""
    pixels = _qwen_token_pixels(config)
    return _image_processor_class("Qwen2VLImageProcessor")(
        size={"shortest_edge": pixels, "longest_edge": pixels * max_image_tokens}, **_qwen_shape(config)
    )


def _internvl_images(config: PretrainedConfig, max_image_tokens: int):
    """Images are cut into tiles of the tower's size (plus a thumbnail where there are several), each
    `config.image_seq_length` tokens."""
    height, width = config.vision_config.image_size
    return _image_processor_class("GotOcr2ImageProcessor")(
        size={"height": height, "width": width},
        crop_to_patches=True,
        min_patches=1,
        max_patches=_internvl_tiles(config, max_image_tokens),
    )


def _gemma3_images(config: PretrainedConfig, max_image_tokens: int):
    side = config.vision_config.image_size
    return _image_processor_class("Gemma3ImageProcessor")(size={"height": side, "width": side})


_IMAGE_PROCESSORS: dict[str, Callable[[PretrainedConfig, int], Any]] = {
    "llava": _llava_images,
    "llava_next": _llava_next_images,
    "qwen2_5_vl": _qwen_images,
    "qwen3_vl": _qwen_images,
    "qwen3_vl_moe": _qwen_images,
    "internvl": _internvl_images,
    "gemma3": _gemma3_images,
}


def fresh_image_processor(
    model_type: str, config: PretrainedConfig, max_image_tokens: int = DEFAULT_MAX_IMAGE_TOKENS
) -> transformers.BaseImageProcessor:
    """The family's image processor sized from `config`'s vision tower (the one `fresh_processor` holds): it needs
    no torchvision, where the whole processor of some families does. `max_image_tokens` bounds the tokens of one
    image where the family's count depends on the image (Qwen-VL, InternVL tiles)."""
    family(model_type)
    return _IMAGE_PROCESSORS[model_type](config, max_image_tokens)


def _llava_processor(config: PretrainedConfig, images, tokenizer, template: str, max_image_tokens: int):
    processor_class = transformers.LlavaProcessor if config.model_type == "llava" else transformers.LlavaNextProcessor
    return processor_class(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=config.vision_config.patch_size,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=_clip_cls_tokens(config.vision_config),
        chat_template=template,
    )


def _qwen_processor(config: PretrainedConfig, images, tokenizer, template: str, max_image_tokens: int):
    temporal = config.vision_config.temporal_patch_size
    pixels = _qwen_token_pixels(config) * temporal  # a video token also spans `temporal` frames
    video_class = getattr(transformers, FAMILIES[config.model_type].video_processor)
    videos = video_class(
        size={"shortest_edge": pixels, "longest_edge": pixels * max_image_tokens}, **_qwen_shape(config)
    )
    processor_class = (
        transformers.Qwen2_5_VLProcessor if config.model_type == "qwen2_5_vl" else transformers.Qwen3VLProcessor
    )
    return processor_class(image_processor=images, tokenizer=tokenizer, video_processor=videos, chat_template=template)


def _internvl_processor(config: PretrainedConfig, images, tokenizer, template: str, max_image_tokens: int):
    height, width = config.vision_config.image_size
    return transformers.InternVLProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        video_processor=transformers.InternVLVideoProcessor(size={"height": height, "width": width}),
        image_seq_length=config.image_seq_length,
        chat_template=template,
    )


def _gemma3_processor(config: PretrainedConfig, images, tokenizer, template: str, max_image_tokens: int):
    return transformers.Gemma3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_length=config.mm_tokens_per_image, chat_template=template
    )


_PROCESSORS: dict[str, Callable[..., ProcessorMixin]] = {
    "llava": _llava_processor,
    "llava_next": _llava_processor,
    "qwen2_5_vl": _qwen_processor,
    "qwen3_vl": _qwen_processor,
    "qwen3_vl_moe": _qwen_processor,
    "internvl": _internvl_processor,
    "gemma3": _gemma3_processor,
}


def processor_problem(model_type: str) -> str | None:
    """Why this environment cannot build (or load) the family's processor; None where it can."""
    fam = family(model_type)
    if fam.video_processor is not None and not is_torchvision_available():
        return (
            f"model.architecture={model_type}: its processor holds a video processor ({fam.video_processor}), which "
            "transformers builds with torchvision only; install a torchvision that matches torch"
        )
    return None


def fresh_processor(
    model_type: str,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    max_image_tokens: int = DEFAULT_MAX_IMAGE_TOKENS,
) -> ProcessorMixin:
    """The family's processor for `config`: `fresh_image_processor`, `tokenizer` (from `vision_tokenizer`, the one
    `config`'s token ids come from) and `vision_chat_template`; a UserError where this environment cannot build
    it (`processor_problem`)."""
    family(model_type)
    if problem := processor_problem(model_type):
        raise UserError(problem)
    ids = token_ids(tokenizer, model_type)
    assert all(getattr(config, field) == value for field, value in ids.items()), (ids, config)
    images = fresh_image_processor(model_type, config, max_image_tokens)
    return _PROCESSORS[model_type](config, images, tokenizer, vision_chat_template(model_type), max_image_tokens)


def fresh_vlm(
    model_type: str,
    size: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    seed: int = 0,
    max_image_tokens: int = DEFAULT_MAX_IMAGE_TOKENS,
    **model_options: Any,
) -> tuple[PreTrainedModel, ProcessorMixin]:
    """A fresh `model_type` VLM initialised under `seed`, and its processor (whose tokenizer is `tokenizer` with
    the family's vision tokens). `model_options` go to `from_config` (`dtype`, `attn_implementation`)."""
    tokenizer = vision_tokenizer(tokenizer, model_type)
    config = fresh_vision_config(model_type, size, tokenizer)
    processor = fresh_processor(model_type, config, tokenizer, max_image_tokens)  # before the weights: it may refuse
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, **model_options)
    return model, processor
