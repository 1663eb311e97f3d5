"""Conversations -> token ids and labels, with the over-length policy applied, into flat arrays."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from transformers import PreTrainedTokenizerBase

from tuneforge.data.conversation import Conversation, SampleError
from tuneforge.data.report import DropLog
from tuneforge.data.templates import IGNORE_INDEX, ChatTemplate, Encoded

if TYPE_CHECKING:
    from tuneforge.data.image_tokens import ImageTokens

TOO_LONG = "longer than data.max_length"
NO_TARGET = "no trained tokens"


Sample = tuple
"""(input_ids, labels, origin) or (input_ids, labels, origin, images): a kept sample, `images` its image
sources in the order of their tokens."""


@dataclass
class TokenizedData:
    """Samples stored back to back: sample i is `input_ids[offsets[i]:offsets[i+1]]` (labels alike, unshifted),
    its images `images[image_offsets[i]:image_offsets[i+1]]` (sources, in the order of their tokens)."""

    input_ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    origins: list[str]
    images: list[str] = field(default_factory=list)
    image_offsets: np.ndarray | None = None
    """None: no sample has images (a text dataset)."""
    answers: list[str] | None = None
    """Online RL's prompts: the answer each prompt's completions are rewarded against; None otherwise."""
    prompts: list[list[dict[str, str]]] | None = None
    """Online RL's prompts as OpenAI-style messages (system, user and assistant turns, ending with the user's):
    what a reward model reads, rendered with its own template; None otherwise."""

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

    def images_of(self, index: int) -> list[str]:
        if self.image_offsets is None:
            return []
        return self.images[self.image_offsets[index] : self.image_offsets[index + 1]]

    @property
    def has_images(self) -> bool:
        return self.image_offsets is not None and len(self.images) > 0

    def subset(self, indices: list[int]) -> TokenizedData:
        subset = TokenizedData.from_samples(
            [(*self.sample(i), self.origins[i], tuple(self.images_of(i))) for i in indices],
            with_images=self.image_offsets is not None,
        )
        if self.answers is not None:
            subset.answers = [self.answers[i] for i in indices]
        if self.prompts is not None:
            subset.prompts = [self.prompts[i] for i in indices]
        return subset

    @staticmethod
    def from_samples(samples: list[Sample], with_images: bool | None = None) -> TokenizedData:
        """`with_images`: keep image offsets even when no sample has an image (a vision-language model's text
        split); by default, when any sample comes with its images."""
        offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        np.cumsum([len(sample[0]) for sample in samples], out=offsets[1:])

        def flat(column: int) -> np.ndarray:
            parts = [np.asarray(sample[column], dtype=np.int32) for sample in samples]
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)

        images_per_sample = [tuple(sample[3]) if len(sample) > 3 else () for sample in samples]
        if with_images is None:
            with_images = any(len(sample) > 3 for sample in samples)
        image_offsets = None
        if with_images:
            image_offsets = np.zeros(len(samples) + 1, dtype=np.int64)
            np.cumsum([len(images) for images in images_per_sample], out=image_offsets[1:])
        images = [source for images in images_per_sample for source in images]
        return TokenizedData(flat(0), flat(1), offsets, [sample[2] for sample in samples], images, image_offsets)


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
    images: ImageTokens | None = None,
) -> tuple[list[Sample], int]:
    """Tokenize in chunks (one batched tokenizer call each); dropped samples are counted in `drops`.
    Returns the kept samples and how many were truncated. With `images` (a vision-language model), each
    sample's images become their tokens (a sample is never cut inside an image: cuts fall between turns) and
    kept samples carry their images' sources."""
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
            starts: list[int] = []
            if images is not None:
                try:
                    encoded, starts = images.expand(conversation, encoded)
                except SampleError as exc:
                    drops.add(exc.reason, f"{conversation.origin}: {exc.detail}" if exc.detail else conversation.origin)
                    continue
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
            if images is None:
                kept.append((fitted.input_ids, fitted.labels, conversation.origin))
            else:
                kept_images = conversation.images[: sum(start < len(fitted.input_ids) for start in starts)]
                kept.append((fitted.input_ids, fitted.labels, conversation.origin, kept_images))
    return kept, truncated
