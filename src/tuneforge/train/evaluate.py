"""Exact-match accuracy of greedy replies against the reference answers of a held-out file."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tuneforge.config.schema import DataConfig
from tuneforge.data.image_tokens import ImageTokens
from tuneforge.data.pipeline import read_conversations
from tuneforge.data.report import DropLog
from tuneforge.data.templates import ChatTemplate
from tuneforge.errors import UserError
from tuneforge.generate import generate_replies


@dataclass
class ExactMatchResult:
    label: str
    accuracy: float
    correct: int
    total: int
    mistakes: list[dict] = field(default_factory=list)
    """Up to 20 wrong answers with their prompt and reference, for a quick look."""


def exact_match(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    template: ChatTemplate,
    file: str,
    label: str,
    system: str | None,
    max_new_tokens: int,
    batch_size: int,
    precision: str,
    synced: bool = False,
    on_batch: Callable[[], None] | None = None,
    images: ImageTokens | None = None,
) -> ExactMatchResult:
    """Each conversation's last assistant message is the reference; everything before it is the prompt."""
    drops = DropLog()
    conversations, _ = read_conversations(DataConfig(train_files=[file]), [file], drops, vision=images is not None)
    if drops.total:
        raise UserError(f"{file}: eval.exact_match.file has unusable records: {drops.examples}")
    if not conversations:
        raise UserError(f"{file}: eval.exact_match.file holds no conversations")
    prompts = [replace(c, turns=(*c.turns[:-1], replace(c.turns[-1], assistant=None))) for c in conversations]
    references = [c.turns[-1].assistant for c in conversations]
    replies = generate_replies(
        model,
        tokenizer,
        template,
        prompts,
        system,
        max_new_tokens,
        precision,
        batch_size,
        synced=synced,
        on_batch=on_batch,
        images=images,
    )
    correct = 0
    mistakes = []
    for conv, reply, reference in zip(conversations, replies, references, strict=True):
        if reply.strip() == reference.strip():
            correct += 1
        elif len(mistakes) < 20:
            mistakes.append({"origin": conv.origin, "prompt": conv.turns[-1].user, "expected": reference, "got": reply})
    return ExactMatchResult(label, correct / len(conversations), correct, len(conversations), mistakes)


def write_result(result: ExactMatchResult, path: Path) -> None:
    path.write_text(json.dumps(asdict(result), indent=2, ensure_ascii=False), encoding="utf-8")
