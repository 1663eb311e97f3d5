"""The normalized conversation every data format is converted to, and the reasons a sample is dropped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

IMAGE_MARK = "<image>"
"""An image's place in a turn's text; the conversation's `images` are its marks' sources, in order."""


@dataclass(frozen=True)
class Turn:
    """One user message and the assistant's reply. `system` is the system prompt given before this turn."""

    user: str
    assistant: str | None
    """None only for the open turn of a generation prompt."""
    train: bool = True
    """Whether the reply (and its end-of-turn token) carries labels."""
    system: str = ""


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]
    origin: str
    """Where the sample came from (`file:line`, `file#row`), for reports and errors."""
    images: tuple[str, ...] = ()
    """The image sources, as the record wrote them (a path or a `data:` URI), in the order of their marks."""

    def __post_init__(self) -> None:
        # Text-only conversations are not checked: there a literal "<image>" (a chat prompt, a preference pair) is
        # text, and the converters refuse it in records themselves.
        if self.images:
            check_image_marks(self.turns, len(self.images))

    def messages(self) -> list[dict[str, str]]:
        """OpenAI-style messages, for Jinja chat templates."""
        out: list[dict[str, str]] = []
        for turn in self.turns:
            if turn.system:
                out.append({"role": "system", "content": turn.system})
            out.append({"role": "user", "content": turn.user})
            if turn.assistant is not None:
                out.append({"role": "assistant", "content": turn.assistant})
        return out

    def messages_with_parts(self) -> list[dict[str, Any]]:
        """OpenAI-style messages where a user message holding images is a list of image and text parts, split at
        its marks: what a processor's chat template (Qwen2.5-VL, LLaVA) renders. Other messages stay strings."""
        out: list[dict[str, Any]] = self.messages()
        if self.images:
            for message in out:
                if message["role"] == "user" and IMAGE_MARK in message["content"]:
                    message["content"] = content_parts(message["content"])
        return out


def content_parts(text: str) -> list[dict[str, str]]:
    """`text` split at its image marks into `{"type": "image"}` and `{"type": "text"}` parts, without empty texts."""
    parts: list[dict[str, str]] = []
    for index, piece in enumerate(text.split(IMAGE_MARK)):
        if index:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def check_image_marks(turns: tuple[Turn, ...], images: int) -> None:
    """Refuse turns whose image marks are not one per image, or not all in user messages."""
    marks = sum(
        t.user.count(IMAGE_MARK) + t.system.count(IMAGE_MARK) + (t.assistant or "").count(IMAGE_MARK) for t in turns
    )
    if marks != images:
        hint = "give one mark per image" if images else f"a literal {IMAGE_MARK} in text-only data reads as an image"
        raise SampleError("image count mismatch", f"{marks} {IMAGE_MARK} marks for {images} images; {hint}")
    for index, turn in enumerate(turns):
        for role, text in (("system", turn.system), ("assistant", turn.assistant or "")):
            if IMAGE_MARK in text:
                raise SampleError(
                    "image outside a user message",
                    f"turn {index + 1}: the {role} message holds an image; only user messages may",
                )


def prompt_conversation(
    history: list[tuple[str, str]], user: str, system: str = "", images: tuple[str, ...] = ()
) -> Conversation:
    """A conversation whose last turn is open for generation; `history` holds earlier (user, reply) pairs, and
    `images` the sources of the image marks in the user messages, in order."""
    turns = [Turn(u, a, system=system if i == 0 else "") for i, (u, a) in enumerate(history)]
    turns.append(Turn(user, None, system=system if not history else ""))
    return Conversation(tuple(turns), origin="<prompt>", images=tuple(images))


class SampleError(Exception):
    """A record that cannot be trained on. It is dropped and counted under `reason`."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
