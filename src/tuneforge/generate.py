"""Greedy chat replies with the training template: for sample chats, accuracy checks and `tuneforge chat`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TextStreamer

from tuneforge.data.conversation import Conversation, Message
from tuneforge.data.templates import Template, render, stop_strings
from tuneforge.data.tokenize import encode_segments
from tuneforge.train.loss import autocast


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase, template: Template, history: list[Message], system: str | None
) -> list[int]:
    """Token ids of `history` (ending with a user message) followed by the open assistant turn."""
    conversation = Conversation(tuple(history), origin="<prompt>")
    segments = render(
        template, conversation, tokenizer.bos_token, tokenizer.eos_token, system, add_generation_prompt=True
    )
    return encode_segments(tokenizer, [segments])[0][0]


def _stop_token_ids(tokenizer: PreTrainedTokenizerBase, template: Template) -> list[int]:
    ids = {tokenizer.eos_token_id}
    for word in template.stop_words:
        encoded = tokenizer(word, add_special_tokens=False)["input_ids"]
        if len(encoded) == 1:
            ids.add(encoded[0])
    return sorted(ids)


def _cut_at_stop(text: str, stops: list[str]) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=len(text))
    return text[:cut]


@torch.no_grad()
def generate_replies(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    template: Template,
    histories: list[list[Message]],
    system: str | None,
    max_new_tokens: int,
    precision: str = "fp32",
    batch_size: int = 32,
    streamer: TextStreamer | None = None,
    on_batch: Callable[[], None] | None = None,
) -> list[str]:
    """Greedy replies, `batch_size` prompts at a time, left-padded so every row ends at its prompt."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    stops = stop_strings(template, tokenizer.eos_token)
    replies: list[str] = []
    try:
        for start in range(0, len(histories), batch_size):
            prompts = [prompt_ids(tokenizer, template, h, system) for h in histories[start : start + batch_size]]
            width = max(len(p) for p in prompts)
            input_ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
            for row, ids in enumerate(prompts):
                input_ids[row, width - len(ids) :] = torch.tensor(ids)
                attention_mask[row, width - len(ids) :] = 1
            with autocast(precision, device):
                output = model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=_stop_token_ids(tokenizer, template),
                    pad_token_id=tokenizer.pad_token_id,
                    streamer=streamer,
                )
            for row in output[:, width:]:
                replies.append(_cut_at_stop(tokenizer.decode(row, skip_special_tokens=True), stops))
            if on_batch is not None:
                on_batch()
    finally:
        model.train(was_training)
    return replies
