"""Conversations in the OpenAI `messages` format, read from JSONL with located errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuneforge.errors import UserError

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    train: bool
    """Whether this message's tokens carry labels."""


@dataclass(frozen=True)
class Conversation:
    messages: tuple[Message, ...]
    origin: str
    """`file:line` of the record, for error messages and reports."""


def _loss_flag(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise UserError(f'{where}: `loss` must be true or false (or the strings "true"/"false"), got {value!r}')


def parse_messages(record: Any, origin: str) -> Conversation:
    """Validate one `{"messages": [...]}` record. By default only assistant messages are trained."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        raise UserError(f'{origin}: expected an object with a "messages" list')
    messages = []
    for i, raw in enumerate(record["messages"]):
        where = f"{origin}: messages[{i}]"
        if not isinstance(raw, dict):
            raise UserError(f"{where}: expected an object with `role` and `content`")
        role, content = raw.get("role"), raw.get("content")
        if role not in ROLES:
            raise UserError(f"{where}: role must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise UserError(f"{where}: `content` must be a string, got {type(content).__name__}")
        train = _loss_flag(raw["loss"], where) if "loss" in raw else role == "assistant"
        messages.append(Message(role, content, train))
    _check_order(messages, origin)
    return Conversation(tuple(messages), origin)


def _check_order(messages: list[Message], origin: str) -> None:
    body = messages[1:] if messages and messages[0].role == "system" else messages
    expected = "user"
    for i, message in enumerate(body, start=len(messages) - len(body)):
        if message.role != expected:
            raise UserError(
                f"{origin}: messages[{i}] has role {message.role!r} where {expected!r} was expected "
                "(an optional system message first, then user and assistant alternating)"
            )
        expected = "assistant" if expected == "user" else "user"
    if not body or body[-1].role != "assistant":
        raise UserError(f"{origin}: a conversation must end with an assistant message")


def read_jsonl(path: str | Path) -> Iterator[tuple[str, Any]]:
    """Yield (`file:line`, parsed object) for each non-blank line."""
    path = Path(path)
    try:
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{path}: cannot read data file ({exc.strerror})") from None
    with handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            origin = f"{path}:{number}"
            try:
                yield origin, json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{origin}: not valid JSON ({exc.msg} at column {exc.colno})") from None


def load_conversations(paths: list[str]) -> list[Conversation]:
    return [parse_messages(record, origin) for path in paths for origin, record in read_jsonl(path)]
