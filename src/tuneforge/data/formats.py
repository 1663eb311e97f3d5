"""Record formats -> ``Conversation``: OpenAI `messages`, ShareGPT `conversations`, Alpaca.

Each converter raises ``SampleError`` with a stable reason for a record that cannot be trained
on; the pipeline drops it and counts it under that reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tuneforge.data.conversation import Conversation, SampleError, Turn

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


def _text(value: Any, where: str) -> str:
    """Message content: a string, or OpenAI content parts of type text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text", "")) for p in value)
    if value is None:
        raise SampleError("missing content", f"{where} has no content")
    if isinstance(value, list) and value:
        kinds = sorted({str(p.get("type")) if isinstance(p, dict) else type(p).__name__ for p in value} - {"text"})
        raise SampleError(
            "non-text content",
            f"{where} has content parts of type {', '.join(kinds)}; only text parts are trained: drop the others",
        )
    raise SampleError(
        "missing content", f"{where}: content is {type(value).__name__} {_short(value)}, not text; write it as a string"
    )


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


def message_triples(messages: list, key: str) -> list[tuple[str, str, bool]]:
    """(role, content, train) of each OpenAI-style message of the list under `key` (named in errors)."""
    triples = []
    for i, message in enumerate(messages):
        where = f"{key}[{i}]"
        if not isinstance(message, dict):
            raise SampleError("malformed record", f"{where} is not an object")
        role = message.get("role")
        if role not in ("system", "user", "assistant"):
            raise SampleError("unknown role", f"{where} has role {role!r} (expected system, user or assistant)")
        content = _text(message.get("content"), where)
        # A null flag is an absent one: Arrow (parquet, saved datasets) writes one into every message of a column
        # that only some messages set.
        train = _loss_flag(message["loss"], where) if role == "assistant" and message.get("loss") is not None else True
        triples.append((role, content, train))
    return triples


def from_openai(record: dict) -> tuple[Turn, ...]:
    messages = record.get("messages")
    if not isinstance(messages, list):
        raise SampleError("malformed record", '"messages" is not a list')
    return _turns_from_messages(message_triples(messages, "messages"))


def from_sharegpt(record: dict) -> tuple[Turn, ...]:
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
    return _turns_from_messages(triples)


def from_alpaca(record: dict) -> tuple[Turn, ...]:
    instruction, extra, output = record.get("instruction"), record.get("input") or "", record.get("output")
    if not isinstance(instruction, str) or not instruction or not isinstance(output, str):
        raise SampleError("missing content", "an Alpaca record needs string `instruction` and `output`")
    if not isinstance(extra, str):
        raise SampleError("malformed record", "`input` must be a string")
    user = f"{instruction}\n{extra}" if extra else instruction
    system = record.get("system") if isinstance(record.get("system"), str) else ""
    return (Turn(user, output, True, system),)


CONVERTERS: dict[str, Callable[[dict], tuple[Turn, ...]]] = {
    "openai": from_openai,
    "sharegpt": from_sharegpt,
    "alpaca": from_alpaca,
}


def to_conversation(record: Any, format_name: str, origin: str) -> Conversation:
    if not isinstance(record, dict):
        raise SampleError("malformed record", f"expected a JSON object, got {type(record).__name__}")
    return Conversation(CONVERTERS[format_name](record), origin)
