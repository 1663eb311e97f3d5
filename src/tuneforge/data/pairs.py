"""Preference pairs: a prompt with a chosen and a rejected answer -> two conversations sharing the prompt.

Rows are read in the conversational form TRL and xtuner use, `{"prompt": [messages], "chosen": [messages],
"rejected": [messages]}`, or with `chosen` and `rejected` as whole conversations that share their first messages
(the shared part is the prompt; a `prompt` field beside them must repeat it). Plain strings stand for one user
message (`prompt`) or one assistant reply (`chosen`, `rejected`). Only the answers train: assistant messages
inside the prompt are history. Both answers are given the same way: one a whole conversation (with its own user
message) and the other only an answer would train them after two different prompts, so such a row is dropped.
"""

from __future__ import annotations

from typing import Any

from tuneforge.config.schema import DataConfig
from tuneforge.data.conversation import Conversation, SampleError
from tuneforge.data.formats import _turns_from_messages, detect_format, message_triples
from tuneforge.data.report import DropLog
from tuneforge.data.sources import MALFORMED_JSON, read_records
from tuneforge.errors import UserError

CHOSEN, REJECTED = "chosen", "rejected"


def answer_origin(where: str) -> str:
    """The origin of one answer of a pair (`file:line (chosen)`) at the start of a drop's `where` text."""
    # The last marker: a directory of the file's path may hold one too (`prefs (chosen)/x.jsonl`).
    ends = [where.rfind(f" ({side})") + len(f" ({side})") for side in (CHOSEN, REJECTED) if f" ({side})" in where]
    return where[: max(ends)] if ends else where


def is_pair_record(record: Any) -> bool:
    return isinstance(record, dict) and CHOSEN in record and REJECTED in record


def _messages(value: Any, key: str, role: str) -> list[tuple[str, str, bool]]:
    """(role, content, train) triples of one field; a string is one message of `role`."""
    if isinstance(value, str):
        return [(role, value, True)]
    if not isinstance(value, list):
        raise SampleError("malformed record", f"`{key}` is {type(value).__name__}, not a list of messages or a string")
    return message_triples(value, key)


def _shared_prefix(first: list[tuple[str, str, bool]], second: list[tuple[str, str, bool]]) -> int:
    shared = 0
    while shared < min(len(first), len(second)) and first[shared][:2] == second[shared][:2]:
        shared += 1
    return shared


def _repeats(given: list[tuple[str, str, bool]], prompt: list[tuple[str, str, bool]]) -> bool:
    """Whether a `prompt` field says what the shared messages say: the same messages, or the text of their user
    messages (the string column many datasets carry beside whole conversations)."""
    if [m[:2] for m in given] == [m[:2] for m in prompt]:
        return True
    users = [content.strip() for role, content, _ in prompt if role == "user"]
    return len(given) == 1 and given[0][1].strip() in [*users[-1:], "\n".join(users)]


def _answer(messages: list[tuple[str, str, bool]], key: str) -> list[tuple[str, str, bool]]:
    if not messages:
        raise SampleError("missing answer", f"`{key}` has no message after the prompt")
    if messages[-1][0] != "assistant":
        raise SampleError("missing answer", f"`{key}` does not end with an assistant message")
    return messages


def _has_user(messages: list[tuple[str, str, bool]]) -> bool:
    return any(role == "user" for role, _, _ in messages)


def _same_form(chosen: list[tuple[str, str, bool]], rejected: list[tuple[str, str, bool]]) -> None:
    """Both answers whole conversations, or both only answers: a whole conversation beside a bare answer would
    train the one after its own question and the other after `prompt` (or after no question at all)."""
    if _has_user(chosen) != _has_user(rejected):
        whole, bare = (CHOSEN, REJECTED) if _has_user(chosen) else (REJECTED, CHOSEN)
        raise SampleError(
            "conflicting prompt",
            f"`{whole}` is a whole conversation with its own user message, `{bare}` only an answer; give both the "
            "same way (both only the answers after `prompt`, or both whole conversations)",
        )


def _blank(messages: list[tuple[str, str, bool]], reason: str, what: str) -> None:
    """A user or assistant message with no text: nothing to prefer, or no question to answer. (An empty system
    message, which many datasets carry, is only no system prompt.)"""
    if any(role != "system" and not content.strip() for role, content, _ in messages):
        raise SampleError(reason, f"{what} is empty or only whitespace; write it, or remove the row")


def pair_conversations(record: Any, origin: str) -> tuple[Conversation, Conversation]:
    """(chosen, rejected) conversations of one pair row; SampleError names what is wrong with it."""
    if not isinstance(record, dict):
        raise SampleError("malformed record", f"expected a JSON object, got {type(record).__name__}")
    if not is_pair_record(record):
        present = ", ".join(f"`{k}`" for k in (CHOSEN, REJECTED) if k in record) or "neither"
        raise SampleError("not a pair", f"a pair needs both `chosen` and `rejected` (this row has {present})")
    chosen = _messages(record[CHOSEN], CHOSEN, "assistant")
    rejected = _messages(record[REJECTED], REJECTED, "assistant")
    given = _messages(record["prompt"], "prompt", "user") if record.get("prompt") is not None else None
    # An answer missing is said before how the answers are given: the row lacks one either way.
    _answer(chosen, CHOSEN)
    _answer(rejected, REJECTED)
    _same_form(chosen, rejected)
    whole = _has_user(chosen)
    if given is not None and not whole:
        prompt = given
    else:
        # Whole conversations: the prompt is the messages they share, up to the last shared user message (a
        # shared assistant message is history). A `prompt` field beside them must repeat it, not add to it.
        shared = _shared_prefix(chosen, rejected)
        while shared and chosen[shared - 1][0] != "user":
            shared -= 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if given is not None and not _repeats(given, prompt):
            raise SampleError(
                "conflicting prompt",
                "`chosen` and `rejected` are whole conversations and `prompt` is not their shared first messages; "
                "drop `prompt`, or give only the answers in `chosen` and `rejected`",
            )
    if not _has_user(prompt):
        raise SampleError(
            "missing prompt",
            "no user message before the answers (give `prompt`, or start both "
            "`chosen` and `rejected` with the same user message)",
        )
    chosen, rejected = _answer(chosen, CHOSEN), _answer(rejected, REJECTED)
    _blank(prompt, "empty prompt", "`prompt`" if given is not None and not whole else "the shared prompt")
    _blank(chosen, "empty answer", f"`{CHOSEN}`")
    _blank(rejected, "empty answer", f"`{REJECTED}`")
    if [m[:2] for m in chosen] == [m[:2] for m in rejected]:
        raise SampleError("identical answers", "`chosen` and `rejected` are the same; the pair teaches nothing")
    history = [(role, content, False) for role, content, _ in prompt]
    return (
        Conversation(_turns_from_messages(history + chosen), f"{origin} ({CHOSEN})"),
        Conversation(_turns_from_messages(history + rejected), f"{origin} ({REJECTED})"),
    )


def read_pairs(
    cfg: DataConfig, files: list[str], drops: DropLog
) -> tuple[list[tuple[Conversation, Conversation]], int]:
    """Every usable pair of `files` as (chosen, rejected) conversations, and how many rows were read. A file whose
    first row is a conversation rather than a pair stops here, before any model loads."""
    pairs = []
    read = 0
    for path in files:
        first = True
        for record in read_records(path, cfg.on_error, cfg.split):
            read += 1
            if record.error is not None:
                drops.add(MALFORMED_JSON, f"{record.origin}: {record.error}")
                continue
            if first and not is_pair_record(record.value):
                found = detect_format(record.value)
                keys = ", ".join(map(str, record.value)) if isinstance(record.value, dict) else "none"
                raise UserError(
                    f"{record.origin}: train.objective trains on preference pairs, rows with `chosen` and `rejected` "
                    f"answers (and a `prompt`), but this row has keys {keys}"
                    + (f" (a {found} conversation: train on it with train.objective: sft)" if found else "")
                )
            first = False
            try:
                pairs.append(pair_conversations(record.value, record.origin))
            except SampleError as exc:
                drops.add(exc.reason, f"{record.origin}: {exc.detail}" if exc.detail else record.origin)
    return pairs, read
