"""Conversations -> token ids and labels. Labels are the ids of trained tokens, -100 elsewhere."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from tuneforge.data.conversation import Conversation
from tuneforge.data.templates import Segment, Template, render

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenizedSample:
    input_ids: list[int]
    labels: list[int]
    """Aligned with `input_ids` (not shifted): the label of a trained token is the token itself."""
    origin: str


@dataclass(frozen=True)
class TokenizeReport:
    kept: int
    dropped_too_long: int
    dropped_no_target: int
    longest_dropped: str | None
    """`origin (N tokens)` of the longest dropped sample, to point the user at the data."""


def encode_segments(
    tokenizer: PreTrainedTokenizerBase, segments: list[list[Segment]]
) -> list[tuple[list[int], list[int]]]:
    """Encode every segment separately (as xtuner does), all texts in one batched call."""
    texts = [seg.text for conv in segments for seg in conv if not seg.special]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else iter(())
    results = []
    for conv in segments:
        ids: list[int] = []
        labels: list[int] = []
        for seg in conv:
            piece = [tokenizer.convert_tokens_to_ids(seg.text)] if seg.special else next(encoded)
            ids.extend(piece)
            labels.extend(piece if seg.trained else [IGNORE_INDEX] * len(piece))
        results.append((ids, labels))
    return results


def tokenize_conversations(
    conversations: list[Conversation],
    tokenizer: PreTrainedTokenizerBase,
    template: Template,
    max_length: int,
    default_system: str | None = None,
) -> tuple[list[TokenizedSample], TokenizeReport]:
    """Tokenize all samples; over-length samples and samples with nothing to train are dropped and counted."""
    segments = [
        render(template, conv, tokenizer.bos_token, tokenizer.eos_token, default_system) for conv in conversations
    ]
    samples, too_long, no_target = [], 0, 0
    longest: tuple[int, str] | None = None
    for conv, (ids, labels) in zip(conversations, encode_segments(tokenizer, segments), strict=True):
        if len(ids) > max_length:
            too_long += 1
            if longest is None or len(ids) > longest[0]:
                longest = (len(ids), conv.origin)
            continue
        # The first token is never predicted, so a label there alone trains nothing.
        if all(label == IGNORE_INDEX for label in labels[1:]):
            no_target += 1
            continue
        samples.append(TokenizedSample(ids, labels, conv.origin))
    report = TokenizeReport(
        kept=len(samples),
        dropped_too_long=too_long,
        dropped_no_target=no_target,
        longest_dropped=f"{longest[1]} ({longest[0]} tokens)" if longest else None,
    )
    return samples, report
