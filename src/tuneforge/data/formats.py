"""Record formats -> ``Conversation``: OpenAI `messages`, ShareGPT `conversations`, Alpaca.

Each converter raises ``SampleError`` with a stable reason for a record that cannot be trained
on; the pipeline drops it and counts it under that reason.

Images are recorded, never opened here: each one's place is an ``IMAGE_MARK`` in a user message's text, and its
source (a path or a `data:` URI, as written) is in ``Conversation.images``. OpenAI messages give them as content
parts; ShareGPT (the LLaVA form), Alpaca and OpenAI records may give them under an `image` or `images` key, with
marks already in the text or, when there are none, put at the start of the first user message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tuneforge.data.conversation import IMAGE_MARK, Conversation, SampleError, Turn

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
}


def detect_format(record: Any) -> str | None:
    """The format a record looks like, from its keys; None when it matches none."""
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        return "openai"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    return None


def _text(value: Any, where: str, images: list[str] | None = None) -> str:
    """Message content: a string, or OpenAI content parts. With `images`, image parts are allowed too: each
    becomes an IMAGE_MARK in the text and its source is appended to `images`; without, only text parts are."""
    if isinstance(value, str):
        return value
    if value is None:
        raise SampleError("missing content", f"{where} has no content")
    if not isinstance(value, list) or not value:
        raise SampleError(
            "missing content",
            f"{where}: content is {type(value).__name__} {_short(value)}, not text; write it as a string",
        )
    allowed = {"text"} if images is None else {"text", *IMAGE_PARTS}
    kinds = sorted({_kind(part) for part in value} - allowed)
    if kinds:
        trained = "text parts" if images is None else "text and image parts"
        raise SampleError(
            "non-text content",
            f"{where} has content parts of type {', '.join(kinds)}; only {trained} are trained: drop the others",
        )
    pieces = []
    for index, part in enumerate(value):
        if part["type"] == "text":
            pieces.append(str(part.get("text", "")))
        else:
            assert images is not None  # image parts are refused above without it
            images.append(_image_part_source(part, f"{where} part {index}"))
            pieces.append(IMAGE_MARK)
    return "".join(pieces)


IMAGE_PARTS = ("image", "image_url")
"""Content part types that carry an image."""


def _kind(part: Any) -> str:
    return str(part.get("type")) if isinstance(part, dict) else type(part).__name__


def _image_part_source(part: dict, where: str) -> str:
    """The source of an image part: `{"type": "image", "image" (or "path", "url"): SOURCE}` or
    `{"type": "image_url", "image_url": {"url": SOURCE}}` (or `"image_url": SOURCE`)."""
    if part["type"] == "image_url":
        value = part.get("image_url")
        source = value.get("url") if isinstance(value, dict) else value
    else:
        source = next((part[key] for key in ("image", "path", "url") if part.get(key) is not None), None)
    return _source(source, where)


def _source(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise SampleError(
            "malformed record", f"{where}: an image source must be a path or a data: URI, not {_short(value)}"
        )
    return value


def _record_images(record: dict) -> list[str]:
    """The sources under a record's `image` or `images` key: a string or a list of strings. A null is an absent
    key: Arrow writes one into every row of a column that only some rows set."""
    keys = [key for key in ("image", "images") if record.get(key) is not None]
    if len(keys) > 1:
        raise SampleError("malformed record", "the record has both `image` and `images`; give one")
    if not keys:
        return []
    value = record[keys[0]]
    if not isinstance(value, list):
        return [_source(value, f"`{keys[0]}`")]
    return [_source(item, f"`{keys[0]}`[{index}]") for index, item in enumerate(value)]


def _place_images(triples: list[tuple[str, str, bool]], images: int) -> list[tuple[str, str, bool]]:
    """`triples` with one mark per image at the start of the first user message when no text marks a place (as
    LLaVA does); as they are otherwise: a count that differs is refused with the conversation."""
    if not images or any(IMAGE_MARK in content for _, content, _ in triples):
        return triples
    first = next((i for i, (role, _, _) in enumerate(triples) if role == "user"), None)
    if first is None:
        return triples
    role, content, train = triples[first]
    return [*triples[:first], (role, f"{IMAGE_MARK}\n" * images + content, train), *triples[first + 1 :]]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _loss_flag(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise SampleError("invalid loss flag", f'{where}: `loss` must be true/false or "true"/"false", got {value!r}')


def _turns_from_messages(messages: list[tuple[str, str, bool]]) -> tuple[Turn, ...]:
    """(role, content, train) triples -> turns. A system message applies to the next turn; consecutive user
    messages are joined with a newline; a reply must follow a user message."""
    turns: list[Turn] = []
    system, pending = "", []
    for index, (role, content, train) in enumerate(messages):
        if role == "system":
            system = content
        elif role == "user":
            pending.append(content)
        elif not pending:
            where = "first message" if index == 0 else f"message {index}"
            raise SampleError("assistant without a user turn", f"{where} is an assistant reply with no user message")
        else:
            turns.append(Turn("\n".join(pending), content, train, system))
            system, pending = "", []
    if pending:
        raise SampleError("ends on a user turn", "the last user message has no reply")
    if not turns:
        raise SampleError("empty conversation")
    return tuple(turns)


def message_triples(messages: list, key: str, images: list[str] | None = None) -> list[tuple[str, str, bool]]:
    """(role, content, train) of each OpenAI-style message of the list under `key` (named in errors). With
    `images`, image content parts are marked in the text and their sources appended to it; without, refused."""
    triples = []
    for i, message in enumerate(messages):
        where = f"{key}[{i}]"
        if not isinstance(message, dict):
            raise SampleError("malformed record", f"{where} is not an object")
        role = message.get("role")
        if role not in ("system", "user", "assistant"):
            raise SampleError("unknown role", f"{where} has role {role!r} (expected system, user or assistant)")
        content = _text(message.get("content"), where, images)
        # A null flag is an absent one: Arrow (parquet, saved datasets) writes one into every message of a column
        # that only some messages set.
        train = _loss_flag(message["loss"], where) if role == "assistant" and message.get("loss") is not None else True
        triples.append((role, content, train))
    return triples


Converted = tuple[tuple[Turn, ...], list[str]]
"""A record's turns, and the sources of the images marked in them, in order."""


def from_openai(record: dict) -> Converted:
    messages = record.get("messages")
    if not isinstance(messages, list):
        raise SampleError("malformed record", '"messages" is not a list')
    images: list[str] = []
    triples = message_triples(messages, "messages", images)
    given = _record_images(record)
    if given and images:
        raise SampleError("malformed record", "images given both as content parts and under the record's image key")
    if given:
        triples, images = _place_images(triples, len(given)), given
    return _turns_from_messages(triples), images


def from_sharegpt(record: dict) -> Converted:
    conversations = record.get("conversations")
    if not isinstance(conversations, list):
        raise SampleError("malformed record", '"conversations" is not a list')
    triples = []
    if isinstance(record.get("system"), str) and record["system"]:
        triples.append(("system", record["system"], True))
    for i, message in enumerate(conversations):
        where = f"conversations[{i}]"
        if not isinstance(message, dict):
            raise SampleError("malformed record", f"{where} is not an object")
        role = SHAREGPT_ROLES.get(str(message.get("from", "")).lower())
        if role is None:
            raise SampleError("unknown role", f"{where} is from {message.get('from')!r}")
        train = _loss_flag(message["loss"], where) if role == "assistant" and message.get("loss") is not None else True
        triples.append((role, _text(message.get("value"), where), train))
    images = _record_images(record)
    return _turns_from_messages(_place_images(triples, len(images))), images


def from_alpaca(record: dict) -> Converted:
    instruction, extra, output = record.get("instruction"), record.get("input") or "", record.get("output")
    if not isinstance(instruction, str) or not instruction or not isinstance(output, str):
        raise SampleError("missing content", "an Alpaca record needs string `instruction` and `output`")
    if not isinstance(extra, str):
        raise SampleError("malformed record", "`input` must be a string")
    system = record.get("system") if isinstance(record.get("system"), str) else ""
    images = _record_images(record)
    if images and not any(IMAGE_MARK in text for text in (instruction, extra, output, system)):
        instruction = f"{IMAGE_MARK}\n" * len(images) + instruction
    user = f"{instruction}\n{extra}" if extra else instruction
    return (Turn(user, output, True, system),), images


CONVERTERS: dict[str, Callable[[dict], Converted]] = {
    "openai": from_openai,
    "sharegpt": from_sharegpt,
    "alpaca": from_alpaca,
}


def to_conversation(record: Any, format_name: str, origin: str) -> Conversation:
    if not isinstance(record, dict):
        raise SampleError("malformed record", f"expected a JSON object, got {type(record).__name__}")
    turns, images = CONVERTERS[format_name](record)
    return Conversation(turns, origin, tuple(images))  # a conversation with images checks its marks
