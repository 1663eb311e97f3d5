"""Online RL's data: prompts, each with the answer its completions are rewarded against.

A record is `{"messages": [...], "answer": "..."}` (the messages up to the last user turn are the prompt; a
trailing assistant message, the SFT answer of a reused dataset, is left out) or `{"prompt": "...", "answer":
"..."}`. A prompt is stored as the token ids of the conversation with its last turn open, where the
completion starts; it trains no token itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from tuneforge.config.schema import DataConfig
from tuneforge.data.conversation import Conversation, SampleError
from tuneforge.data.formats import _turns_from_messages, message_triples
from tuneforge.data.report import DropLog
from tuneforge.data.sources import MALFORMED_JSON, read_records
from tuneforge.data.templates import IGNORE_INDEX, ChatTemplate
from tuneforge.data.tokenize import TOO_LONG, TokenizedData
from tuneforge.errors import UserError

NO_ANSWER = "no answer"


def to_prompt(record: Any, origin: str) -> tuple[Conversation, str]:
    """(the prompt as a conversation whose last turn is open, the answer) of one record."""
    if not isinstance(record, dict):
        raise SampleError("malformed record", f"expected a JSON object, got {type(record).__name__}")
    answer = record.get("answer")
    if answer is None:
        raise SampleError(NO_ANSWER, 'the record has no "answer" to reward completions against')
    if not isinstance(answer, str | int | float) or isinstance(answer, bool):
        raise SampleError("malformed record", f'"answer" is {type(answer).__name__}; give it as a string')
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list):
            raise SampleError("malformed record", '"messages" is not a list')
        triples = message_triples(messages, "messages")
        while triples and triples[-1][0] == "assistant":  # the reused dataset's own reply is not the prompt
            triples.pop()
    elif isinstance(record.get("prompt"), str):
        triples = [("user", record["prompt"], True)]
    else:
        raise SampleError("malformed record", 'a prompt record has "messages" or a string "prompt", and "answer"')
    if not triples or triples[-1][0] != "user":
        raise SampleError("no prompt", "the messages hold no user turn to answer")
    turns = _turns_from_messages([*triples, ("assistant", "", True)])
    open_turn = replace(turns[-1], assistant=None)
    return Conversation((*turns[:-1], open_turn), origin), str(answer)


def read_prompts(cfg: DataConfig, files: list[str], drops: DropLog) -> tuple[list[tuple[Conversation, str]], int]:
    prompts, read = [], 0
    for path in files:
        for record in read_records(path, cfg.on_error, cfg.split):
            read += 1
            if record.error is not None:
                drops.add(MALFORMED_JSON, f"{record.origin}: {record.error}")
                continue
            try:
                prompts.append(to_prompt(record.value, record.origin))
            except SampleError as exc:
                drops.add(exc.reason, f"{record.origin}: {exc.detail}" if exc.detail else record.origin)
    return prompts, read


def tokenize_prompts(
    prompts: list[tuple[Conversation, str]],
    tokenizer: PreTrainedTokenizerBase,
    template: ChatTemplate,
    longest: int,
    default_system: str | None,
    drops: DropLog,
) -> TokenizedData:
    """Prompt ids (labels all ignored: a prompt trains nothing) with their answers; a prompt longer than
    `longest` (the room `data.max_length` leaves a completion) is dropped and counted."""
    samples, answers, messages = [], [], []
    for conversation, answer in prompts:
        ids = template.prompt_ids(conversation, tokenizer, default_system)
        if len(ids) > longest:
            drops.add(TOO_LONG, f"{conversation.origin} ({len(ids)} prompt tokens, {longest} fit)")
            continue
        samples.append((ids, [IGNORE_INDEX] * len(ids), conversation.origin))
        answers.append(answer)
        messages.append(conversation.messages())
    data = TokenizedData.from_samples(samples)
    data.answers, data.prompts = answers, messages
    return data


def prompt_conversation_of(messages: list[dict[str, str]], origin: str) -> Conversation:
    """A kept prompt's messages (`TokenizedData.prompts`) as the conversation they were read as, its last turn open."""
    return to_prompt({"messages": messages, "answer": ""}, origin)[0]


def prompt_room(max_length: int, max_completion_tokens: int) -> int:
    """The longest prompt that leaves room for a whole completion within `data.max_length`."""
    room = max_length - max_completion_tokens
    if room < 1:
        raise UserError(
            f"data.max_length ({max_length}) leaves no room for a prompt before rl.max_completion_tokens "
            f"({max_completion_tokens}); raise data.max_length"
        )
    return room


def room_for(cfg) -> int | None:
    """The prompts' room of a run (`cfg`: a Config) whose objective learns from prompts; None for other data."""
    if not cfg.objective.prompted:
        return None
    return prompt_room(cfg.data.max_length, cfg.rl.max_completion_tokens)


def prompt_lookup(data: TokenizedData) -> Callable[[int], Conversation]:
    """Data index -> the prompt's conversation, built when asked (a reward model reads a step's few)."""
    assert data.prompts is not None, "prompt data keeps its messages"

    def conversation(index: int) -> Conversation:
        return prompt_conversation_of(data.prompts[index], data.origins[index])

    return conversation
