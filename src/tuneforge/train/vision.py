"""The run's vision-language side, set up in one step: the processor, its chat template, the images' tokens and
pixel budget, and the micro-batches' pixel inputs; None for a text model. What tuneforge does not yet do with
a vision-language model is refused here, by name, before anything loads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tuneforge.config.schema import Config, DataConfig
from tuneforge.data.batching import MicroBatch
from tuneforge.data.image_batches import ImageBatches
from tuneforge.data.image_tokens import IMAGE_SHARE_OF_ROW, ImageTokens
from tuneforge.data.templates import TOKENIZER, ChatTemplate, get_template
from tuneforge.data.vision_templates import MarkedTemplate, ProcessorTemplate
from tuneforge.errors import UserError
from tuneforge.model.build import model_config
from tuneforge.model.vision import build_processor, is_vision_model
from tuneforge.model.vision_inputs import bidirectional_images

Say = Callable[[str], None]


@dataclass
class VisionRun:
    processor: Any
    tokens: ImageTokens
    batches: ImageBatches
    template: ChatTemplate

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def attach(self) -> Callable[[MicroBatch], MicroBatch]:
        return self.batches.attach


def refusals(cfg: Config) -> list[str]:
    """What a vision-language run cannot do yet, each naming its setting."""
    problems = []
    if cfg.paired or cfg.objective.prompted:
        problems.append(f"train.objective={cfg.train.objective}: vision-language models train with sft for now")
    if cfg.parallel.sequence_parallel > 1:
        problems.append("parallel.sequence_parallel: vision-language rows are not split across ranks; set it to 1")
    vision = cfg.model.vision
    if vision is not None and vision.tower_path is not None and cfg.model.path is None:
        problems.append("model.vision.tower_path: the language model to join it to is model.path; set it")
    return problems


def vision_run(cfg: Config, tokenizer, say: Say) -> VisionRun | None:
    if not is_vision_model(cfg.model):
        if cfg.model.vision is not None:
            raise UserError("model.vision: this model is a text model (it has no vision tower); remove the section")
        return None
    if problems := refusals(cfg):
        raise UserError("vision-language model: " + "; ".join(problems))
    processor = build_processor(cfg.model, tokenizer, model_config(cfg.model, tokenizer))
    if processor.tokenizer.pad_token is None:  # masked out of attention and loss, as for text models
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    kwargs, note = pixel_budget(cfg.data, processor.image_processor)
    if kwargs:  # the image processor's own setting: checkpoints save it, so chat and export resize alike
        processor.image_processor.size = kwargs["size"]
    tokens = ImageTokens(processor, {}, cfg.data.image_pixel_limit)
    batches = ImageBatches(tokens, processor.tokenizer.pad_token_id, cfg.data.image_pixel_limit)
    template = vision_template(cfg.data, processor, tokens.placeholder)
    say(
        f"vision: {type(processor).__name__}, {note}; a micro-batch without images carries a blank one "
        f"({len(batches.filler_ids)} tokens) so the tower runs on every rank"
    )
    return VisionRun(processor, tokens, batches, template)


def check_packing(cfg: Config, model) -> None:
    """A model whose image tokens attend both ways (Gemma 3) cannot take packed rows: the attention over packed
    samples is causal."""
    if cfg.data.packing and bidirectional_images(model):
        raise UserError(
            f"data.packing: {type(model).__name__} lets image tokens attend to each other both ways, which packed "
            "rows' causal attention cannot; set data.packing: false"
        )


def vision_template(cfg: DataConfig, processor, placeholder: str) -> ChatTemplate:
    """The processor's chat template unless `data.template` names another; a built-in template gets the
    processor's image placeholder where each image goes."""
    if "template" not in cfg.model_fields_set or cfg.template == TOKENIZER:
        if not getattr(processor, "chat_template", None):
            raise UserError("data.template: this model's processor has no chat template; name a built-in template")
        return ProcessorTemplate(processor)
    return MarkedTemplate(get_template(cfg.template), placeholder)


def pixel_budget(cfg: DataConfig, image_processor) -> tuple[dict[str, Any], str]:
    """The image processor's size keywords for the budget, and a line saying it. Only processors with a dynamic
    resolution (a `merge_size`, Qwen-VL's) take one; others resize every image to their own size."""
    patch, merge = getattr(image_processor, "patch_size", None), getattr(image_processor, "merge_size", None)
    size = dict(getattr(image_processor, "size", None) or {})
    if patch is None or merge is None or "longest_edge" not in size:
        if cfg.image_max_pixels or cfg.image_min_pixels:
            raise UserError(
                f"data.image_max_pixels / image_min_pixels: {type(image_processor).__name__} resizes every image "
                "to its own size, so a pixel budget does not apply; remove them"
            )
        return {}, "images resized to the processor's own size"
    per_token = (patch * merge) ** 2
    largest = cfg.image_max_pixels or min(size["longest_edge"], cfg.max_length // IMAGE_SHARE_OF_ROW * per_token)
    smallest = cfg.image_min_pixels or min(size.get("shortest_edge", per_token), largest)
    budget = {"shortest_edge": smallest, "longest_edge": largest}
    return {"size": budget}, f"images between {smallest:,} and {largest:,} pixels (up to {largest // per_token} tokens)"


def data_view(cfg: Config, tokenizer) -> tuple[Any, ChatTemplate, ImageTokens | None]:
    """(tokenizer, template, image tokens) the run prepares its data with: for `data check`, `data preview` and
    the doctor, which read the data as training will."""
    vision = vision_run(cfg, tokenizer, lambda _line: None)
    if vision is None:
        return tokenizer, get_template(cfg.data.template), None
    return vision.tokenizer, vision.template, vision.tokens
