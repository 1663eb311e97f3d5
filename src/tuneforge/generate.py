"""Greedy chat replies with the training template: for sample chats, accuracy checks and `tuneforge chat`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase, TextStreamer

from tuneforge.data.conversation import Conversation
from tuneforge.data.image_tokens import ImageTokens
from tuneforge.data.images import open_image
from tuneforge.data.templates import ChatTemplate, Encoded
from tuneforge.errors import UserError
from tuneforge.keyed_sampling import KeyedSampler
from tuneforge.model.precision import autocast


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, stops: list[str]) -> list[int]:
    ids = {tokenizer.eos_token_id}
    for word in stops:
        encoded = tokenizer(word, add_special_tokens=False)["input_ids"]
        if len(encoded) == 1:
            ids.add(encoded[0])
    return sorted(ids)


def _cut_at_stop(text: str, stops: list[str]) -> str:
    cut = min((text.find(s) for s in stops if s and s in text), default=len(text))
    return text[:cut]


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) of prompts padded on the left, so that every row ends where generation starts."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


@torch.no_grad()
def generate_replies(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    template: ChatTemplate,
    prompts: list[Conversation],
    system: str | None,
    max_new_tokens: int,
    precision: str = "fp32",
    batch_size: int = 32,
    streamer: TextStreamer | None = None,
    synced: bool = False,
    on_batch: Callable[[], None] | None = None,
    images: ImageTokens | None = None,
) -> list[str]:
    """Greedy replies to conversations whose last turn is open, `batch_size` at a time, left-padded so every
    row ends at its prompt. `synced`: the model is sharded across ranks, so every rank keeps stepping until
    all are done (ranks whose replies end early would otherwise leave the others in an all-gather). `images`: a
    vision-language model's image tokens, for prompts with images."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    stops = template.stop_strings(tokenizer)
    stop_ids = stop_token_ids(tokenizer, stops)
    replies: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            ids = [template.prompt_ids(p, tokenizer, system) for p in batch]
            pixels: dict = {}
            if images is not None:
                ids, pixels = _with_images(images, batch, ids, device)
            input_ids, attention_mask = left_padded(ids, tokenizer.pad_token_id)
            width = input_ids.size(1)
            with autocast(precision, device):
                output = model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=stop_ids,
                    pad_token_id=tokenizer.pad_token_id,
                    streamer=streamer,
                    synced_gpus=synced,
                    **pixels,
                )
            for row in output[:, width:]:
                replies.append(_cut_at_stop(tokenizer.decode(row, skip_special_tokens=True), stops))
            if on_batch is not None:
                on_batch()
    finally:
        model.train(was_training)
    return replies


def _with_images(
    images: ImageTokens, prompts: list[Conversation], ids: list[list[int]], device: torch.device
) -> tuple[list[list[int]], dict]:
    """Prompt ids with each image placeholder expanded into its image's tokens, and the batch's pixel inputs
    (none when no prompt has an image)."""
    expanded, loaded = [], []
    for prompt, prompt_ids in zip(prompts, ids, strict=True):
        encoded, _ = images.expand(prompt, Encoded(list(prompt_ids), list(prompt_ids)))
        expanded.append(encoded.input_ids)
        loaded += [open_image(source, images.pixel_limit) for source in prompt.images]
    if not loaded:
        return expanded, {}
    return expanded, {name: value.to(device) for name, value in images.pixels(loaded).items()}


NEUTRAL_GENERATION = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "min_length": 0,
    "guidance_scale": 1.0,
    "renormalize_logits": False,
    "remove_invalid_values": False,
    "suppress_tokens": [],
    "begin_suppress_tokens": [],
}
"""Settings of a model's `generation_config` that would reshape each step's logits under greedy search, at
values that leave them as they are. Transformers fills what a passed config leaves unset from the model's."""

RESHAPING_WITHOUT_NEUTRAL = (
    "bad_words_ids",
    "sequence_bias",
    "forced_eos_token_id",
    "exponential_decay_length_penalty",
)
"""Settings that reshape the logits and have no neutral value to write over the model's: a model that sets one
is refused for rollouts."""


def rollout_generation_config(
    model_settings: GenerationConfig | None, max_new_tokens: int, stop_ids: list[int], pad_id: int
) -> GenerationConfig:
    """Greedy search over the keyed sampler's output, with none of the model's own generation defaults (Qwen2.5
    ships a repetition penalty): the completions come from exactly the distribution the loss assumes."""
    shaping = [name for name in RESHAPING_WITHOUT_NEUTRAL if getattr(model_settings, name, None) is not None]
    if shaping:
        raise UserError(
            f"the model's generation_config.json sets {', '.join(shaping)}, which would change the distribution "
            "rollouts sample from away from the one the loss assumes; remove it from the model's "
            "generation_config.json for GRPO"
        )
    neutral = dict(NEUTRAL_GENERATION)
    if getattr(model_settings, "min_new_tokens", None) is not None:  # set only then: transformers warns of both
        neutral["min_new_tokens"] = 0
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
        use_cache=True,
        **neutral,
    )


@torch.no_grad()
def sample_completions(
    model: PreTrainedModel,
    prompts: list[list[int]],
    generations: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop_ids: list[int],
    pad_id: int,
    keys: torch.Tensor,
    precision: str = "fp32",
    synced: bool = False,
) -> tuple[list[list[int]], list[bool]]:
    """`generations` sampled completions of each prompt, prompt by prompt (the first prompt's group first), in the
    model's current weights (adapters active, KV cache on), and whether each was cut at `max_new_tokens` before a
    stop token. A completion ends with its stop token. `keys` (one per completion, `completion_keys`) decide its
    draws, so it does not depend on the other rows. `synced`: sharded weights, every rank steps until all are
    done."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    input_ids, attention_mask = left_padded(prompts, pad_id)
    width = input_ids.size(1)
    settings = rollout_generation_config(model.generation_config, max_new_tokens, stop_ids, pad_id)
    sampler = KeyedSampler(keys.to(device), width, temperature, top_p)
    try:
        with autocast(precision, device):
            output = model.generate(
                input_ids=input_ids.repeat_interleave(generations, dim=0).to(device),
                attention_mask=attention_mask.repeat_interleave(generations, dim=0).to(device),
                generation_config=settings,
                logits_processor=LogitsProcessorList([sampler]),
                synced_gpus=synced,
            )
    finally:
        model.train(was_training)
    completions, truncated = [], []
    stops = set(stop_ids)
    for row in output[:, width:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in stops), None)
        completions.append(row[:end] if end is not None else row)
        truncated.append(end is None)
    return completions, truncated
