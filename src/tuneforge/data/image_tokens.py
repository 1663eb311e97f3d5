"""A vision-language model's images as tokens: each image's placeholder in a tokenized sample becomes the
processor's expansion for that image (its image tokens, with whatever start and end tokens the family uses),
labelled as context.

The expansion comes from the model's own processor (`replace_image_token` on the image processor's output), so
the count always agrees with what the model's forward will compute from the pixels, for every family the
processor knows. Every image is decoded once here, while the data is prepared: a missing, corrupt or oversized
image is dropped and counted with its sample before training starts, never met mid-epoch. The expansion
depends on the image's size only, so it is computed once per size.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from tuneforge.data.conversation import Conversation, SampleError
from tuneforge.data.images import blank_image, open_image
from tuneforge.data.templates import IGNORE_INDEX, Encoded
from tuneforge.errors import UserError

PLACEHOLDER_MISMATCH = "image placeholder mismatch"
IMAGE_SHARE_OF_ROW = 4
"""The default pixel budget keeps one image within 1/4 of `data.max_length` tokens."""
PROBE_SIZES = ((37, 23), (640, 480))
"""Images whose tokens stand for the processor's expansion rule in the data cache's key."""


@dataclass
class ImageTokens:
    """`processor`: the model's `transformers` processor (image processor, tokenizer, `image_token`).
    `image_kwargs`: what the image processor is called with besides the images (the pixel budget)."""

    processor: Any
    image_kwargs: dict[str, Any] = field(default_factory=dict)
    pixel_limit: int = 100_000_000
    _by_size: dict[tuple[int, int], list[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        token = getattr(self.processor, "image_token", None)
        tokenizer = self.tokenizer
        ids = tokenizer(token, add_special_tokens=False)["input_ids"] if token else []
        if len(ids) != 1:
            raise UserError(
                f"the model's processor ({type(self.processor).__name__}) has no single-token image placeholder "
                f"(image_token {token!r}); tuneforge cannot place its images"
            )
        self.placeholder = token
        self.placeholder_id = ids[0]
        # The processor's own defaults for its image processor (InternVL crops tiles): what its own call uses, so
        # the tokens here are what a model served with this processor sees.
        defaults = getattr(type(self.processor), "images_kwargs", None)
        defaults = {k: v for k, v in defaults.items() if k != "return_tensors"} if isinstance(defaults, dict) else {}
        self.image_kwargs = {**defaults, **self.image_kwargs}
        # The id standing for each token of an image's features: the placeholder itself, except where the
        # placeholder opens an image (Gemma 3's begin-of-image) and the tokenizer names the feature token.
        named = getattr(tokenizer, "image_token", None)
        self.image_token_id = tokenizer.convert_tokens_to_ids(named) if isinstance(named, str) else ids[0]

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.processor.tokenizer

    def pixels(self, images: list) -> dict[str, Any]:
        """The image processor's tensors for `images` (PIL images), as the model's forward takes them."""
        return dict(self.processor.image_processor(images, return_tensors="pt", **self.image_kwargs))

    def expansion(self, image) -> list[int]:
        """Token ids that stand for `image` (a PIL image) in the text."""
        size = image.size
        if size not in self._by_size:
            processed = self.processor.image_processor([image], return_tensors="pt", **self.image_kwargs)
            text = self.processor.replace_image_token(processed, 0)
            self._by_size[size] = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self._by_size[size]

    def expand(self, conversation: Conversation, encoded: Encoded) -> tuple[Encoded, list[int]]:
        """`encoded` with each image placeholder replaced by its image's tokens (labels ignored), and where
        each image's tokens start. Raises SampleError for an image that cannot be read or a template that
        placed another number of placeholders than the sample has images."""
        places = [i for i, token in enumerate(encoded.input_ids) if token == self.placeholder_id]
        if len(places) != len(conversation.images):
            raise SampleError(
                PLACEHOLDER_MISMATCH,
                f"the chat template placed {len(places)} image placeholders ({self.placeholder}) for "
                f"{len(conversation.images)} images",
            )
        if not places:
            return encoded, []
        expansions = [self.expansion(open_image(source, self.pixel_limit)) for source in conversation.images]
        ids: list[int] = []
        labels: list[int] = []
        starts: list[int] = []
        growth = [0]  # growth[k]: how far indices after the k-th placeholder moved
        previous = 0
        for place, tokens in zip(places, expansions, strict=True):
            ids += encoded.input_ids[previous:place]
            labels += encoded.labels[previous:place]
            starts.append(len(ids))
            ids += tokens
            labels += [IGNORE_INDEX] * len(tokens)
            growth.append(growth[-1] + len(tokens) - 1)
            previous = place + 1
        ids += encoded.input_ids[previous:]
        labels += encoded.labels[previous:]
        # A turn ends after its placeholders (they are in its user message): it moves by all of them.
        turn_ends = [end + growth[bisect.bisect_left(places, end)] for end in encoded.turn_ends]
        return Encoded(ids, labels, turn_ends), starts

    def fingerprint(self) -> str:
        """Changes with anything that changes an image's tokens: the image processor's settings, the budget,
        the placeholder."""
        settings = self.processor.image_processor.to_dict()
        settings.pop("processor_class", None)
        # The processor's own rule (LLaVA's patch size, its class token) shows in the tokens of probe images.
        probes = [self.expansion(blank_image(*size)) for size in PROBE_SIZES]
        text = json.dumps(
            [settings, self.image_kwargs, self.placeholder, self.pixel_limit, probes], sort_keys=True, default=str
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]
