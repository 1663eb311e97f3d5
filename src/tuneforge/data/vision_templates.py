"""Chat templates for vision-language models: the processor's own Jinja template, which renders image content
parts with the family's placeholder, or a built-in template with the processor's placeholder put where each
image mark is. Either way, each image is one placeholder token in the rendered text, which `ImageTokens`
expands into the image's tokens."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jinja2

from tuneforge.data.conversation import IMAGE_MARK, Conversation
from tuneforge.data.templates import ChatTemplate, TokenizerTemplate
from tuneforge.errors import UserError


class ProcessorTemplate(TokenizerTemplate):
    """The processor's `chat_template`, given OpenAI content parts (`{"type": "image"}`) for the images. Reply
    spans are found as for the tokenizer's template (by rendering prefixes)."""

    def __init__(self, processor: Any):
        self.processor = processor

    def _messages(self, conversation: Conversation, default_system: str | None) -> list[dict[str, Any]]:
        messages = conversation.messages_with_parts()
        if default_system and (not messages or messages[0]["role"] != "system"):
            messages.insert(0, {"role": "system", "content": default_system})
        return messages

    def _apply(self, tokenizer, messages, generation_prompt: bool) -> str:
        try:
            return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except jinja2.TemplateError as exc:
            raise UserError(
                f"the processor's chat_template cannot be rendered ({type(exc).__name__}: {exc}); fix it in the "
                "checkpoint's chat_template.jinja, or name a built-in template (data.template)"
            ) from None

    def _check(self, tokenizer) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise UserError(
                f"{type(tokenizer).__name__} is not a fast tokenizer, which the loss mask needs (the character "
                "offsets of its tokens); pick a built-in template (data.template)"
            )

    def encode(self, conversations, tokenizer, default_system):
        self._check(tokenizer)
        return self._encode_rendered(conversations, tokenizer, default_system)


class MarkedTemplate:
    """A built-in (or inline) template for a vision-language model: each image mark in a user message becomes the
    processor's placeholder before rendering."""

    def __init__(self, inner: ChatTemplate, placeholder: str):
        self.inner = inner
        self.placeholder = placeholder

    def _marked(self, conversation: Conversation) -> Conversation:
        if not conversation.images:
            return conversation
        turns = tuple(replace(t, user=t.user.replace(IMAGE_MARK, self.placeholder)) for t in conversation.turns)
        # The marks are gone from the text: the copy carries no images (the original keeps them for the caller).
        return Conversation(turns, conversation.origin)

    def encode(self, conversations, tokenizer, default_system):
        return self.inner.encode([self._marked(c) for c in conversations], tokenizer, default_system)

    def render(self, conversation, tokenizer, default_system):
        return self.inner.render(self._marked(conversation), tokenizer, default_system)

    def prompt_ids(self, conversation, tokenizer, default_system):
        return self.inner.prompt_ids(self._marked(conversation), tokenizer, default_system)

    def stop_strings(self, tokenizer):
        return self.inner.stop_strings(tokenizer)
