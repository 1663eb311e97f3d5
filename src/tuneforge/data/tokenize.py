"""Conversations -> token ids and labels, with the over-length policy applied, into flat arrays."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedTokenizerBase

from tuneforge.data.conversation import Conversation
from tuneforge.data.report import DropLog
from tuneforge.data.templates import IGNORE_INDEX, ChatTemplate, Encoded

TOO_LONG = "longer than data.max_length"
NO_TARGET = "no trained tokens"


@dataclass
class TokenizedData:
    """Samples stored back to back: sample i is `input_ids[offsets[i]:offsets[i+1]]` (labels alike, unshifted)."""

    input_ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    origins: list[str]

    def __len__(self) -> int:
        return len(self.origins)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def target_counts(self) -> np.ndarray:
        """Trained tokens per sample: labels other than IGNORE_INDEX after each sample's first position (targets
        are the labels shifted by one inside the sample)."""
        trained = self.labels != IGNORE_INDEX
        trained[self.offsets[:-1][self.lengths > 0]] = False
        running = np.concatenate([[0], np.cumsum(trained, dtype=np.int64)])
        return running[self.offsets[1:]] - running[self.offsets[:-1]]

    def signature(self) -> str:
        """Changes when samples are added, removed, reordered by length or change length: what a resumed run's
        data position depends on. Read from the offsets only, so it costs nothing on billions of tokens."""
        digest = hashlib.sha256(np.ascontiguousarray(self.offsets, dtype=np.int64).tobytes()).hexdigest()[:16]
        return f"{len(self)}:{digest}"

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = self.offsets[index], self.offsets[index + 1]
        return self.input_ids[start:end], self.labels[start:end]

    def subset(self, indices: list[int]) -> TokenizedData:
        return TokenizedData.from_samples([(*self.sample(i), self.origins[i]) for i in indices])

    @staticmethod
    def from_samples(samples: list[tuple[np.ndarray | list[int], np.ndarray | list[int], str]]) -> TokenizedData:
        offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        np.cumsum([len(ids) for ids, _, _ in samples], out=offsets[1:])

        def flat(column: int) -> np.ndarray:
            parts = [np.asarray(sample[column], dtype=np.int32) for sample in samples]
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)

        return TokenizedData(flat(0), flat(1), offsets, [origin for _, _, origin in samples])


def apply_length_policy(encoded: Encoded, max_length: int, truncation: str) -> Encoded | None:
    """`drop`: None when too long. `truncate`: keep the longest run of whole leading turns that fits."""
    if len(encoded.input_ids) <= max_length:
        return encoded
    if truncation == "drop":
        return None
    fitting = [end for end in encoded.turn_ends if end <= max_length]
    if not fitting:
        return None
    end = fitting[-1]
    return Encoded(encoded.input_ids[:end], encoded.labels[:end], encoded.turn_ends[: len(fitting)])


CHARS_PER_TOKEN_BOUND = 256
"""No tokenizer averages this many characters per token over a sample: one with more characters than
`data.max_length` times this is too long whatever the tokenizer, and is dropped without being tokenized (a
50-million-character line took 9.6 GB and 107 s to tokenize, and Ctrl-C waited for it)."""


def _characters(conversation, truncation: str) -> int:
    """The characters that must fit: the whole sample when over-long samples are dropped, the first turn when
    they are cut to whole turns (a first turn too long leaves nothing)."""
    turns = conversation.turns if truncation == "drop" else conversation.turns[:1]
    return sum(len(t.system) + len(t.user) + len(t.assistant or "") for t in turns)


def has_target(labels: list[int] | np.ndarray) -> bool:
    """The first token is never predicted, so a label there alone trains nothing (and would give a NaN loss)."""
    return any(label != IGNORE_INDEX for label in labels[1:])


def tokenize(
    conversations: list[Conversation],
    tokenizer: PreTrainedTokenizerBase,
    template: ChatTemplate,
    max_length: int,
    truncation: str,
    default_system: str | None,
    drops: DropLog,
    chunk_size: int = 2048,
) -> tuple[list[tuple[list[int], list[int], str]], int]:
    """Tokenize in chunks (one batched tokenizer call each); dropped samples are counted in `drops`.
    Returns the kept samples and how many were truncated."""
    kept = []
    truncated = 0
    bound = max_length * CHARS_PER_TOKEN_BOUND
    fits = []
    for conversation in conversations:
        if (count := _characters(conversation, truncation)) > bound:
            drops.add(TOO_LONG, f"{conversation.origin} ({count:,} characters, not tokenized)")
        else:
            fits.append(conversation)
    conversations = fits
    for start in range(0, len(conversations), chunk_size):
        chunk = conversations[start : start + chunk_size]
        for conversation, encoded in zip(chunk, template.encode(chunk, tokenizer, default_system), strict=True):
            fitted = apply_length_policy(encoded, max_length, truncation)
            if fitted is None:
                drops.add(TOO_LONG, f"{conversation.origin} ({len(encoded.input_ids)} tokens)")
                continue
            if not has_target(fitted.labels):
                if fitted is not encoded:  # cut to its leading turns, none of which trains: dropped for its length
                    drops.add(TOO_LONG, f"{conversation.origin} ({len(encoded.input_ids)} tokens)")
                else:
                    drops.add(NO_TARGET, conversation.origin)
                continue
            truncated += fitted is not encoded  # counted among the kept samples only
            kept.append((fitted.input_ids, fitted.labels, conversation.origin))
    return kept, truncated
