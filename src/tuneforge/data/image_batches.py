"""A collated micro-batch's images as the model's pixel inputs, and a filler image for a micro-batch without any.

Every micro-batch of a vision-language model carries at least one image, so that every rank runs the vision
tower in every forward and backward: under ZeRO-3 or FSDP a rank whose micro-batch held only text would skip
the tower's parameter gathers while the others wait in them, the original report's hang in another form. The
filler goes after the last token of the first row, where nothing attends to it (it has no sample: sequence id
-1, no attention mask, no targets) and so where its gradient is exactly zero: the tower runs, trains on
nothing, and no real token's output changes.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tuneforge.data.batching import MicroBatch
from tuneforge.data.image_tokens import ImageTokens
from tuneforge.data.images import blank_image, open_image
from tuneforge.data.templates import IGNORE_INDEX
from tuneforge.errors import UserError

FILLER_SIZE = (32, 32)
"""The filler image's size: small; the processor scales it to its own minimum (a fixed-size processor such as
LLaVA's to its one size)."""


class ImageBatches:
    def __init__(self, tokens: ImageTokens, pad_id: int, pixel_limit: int):
        self.tokens = tokens
        self.pad_id = pad_id
        self.pixel_limit = pixel_limit
        self.filler = blank_image(*FILLER_SIZE)
        self.filler_ids = tokens.expansion(self.filler)

    def attach(self, batch: MicroBatch) -> MicroBatch:
        """`batch` with its pixel inputs (`vision`), and with a filler image when it has no image."""
        if batch.whole_rows is not None:
            raise UserError("sequence parallelism does not split vision-language rows; set parallel.sequence: 1")
        images = [open_image(source, self.pixel_limit) for source in batch.images]
        if not images:
            batch = self._with_filler(batch)
            images = [self.filler]
        self._check_counts(batch, images)
        batch.vision = self.tokens.pixels(images)
        return batch

    def _with_filler(self, batch: MicroBatch) -> MicroBatch:
        """Rows widened by the filler's tokens, which go after the last token of the first row."""
        rows, width = batch.input_ids.shape
        extra = len(self.filler_ids)
        last = int((batch.sequence_ids[0] >= 0).sum())

        def widened(tensor: torch.Tensor, fill: int) -> torch.Tensor:
            return torch.cat([tensor, torch.full((rows, extra), fill, dtype=tensor.dtype)], dim=1)

        input_ids = widened(batch.input_ids, self.pad_id)
        # The first row's padding moves after the filler; the filler follows its last real token.
        input_ids[0, last + extra :] = self.pad_id
        input_ids[0, last : last + extra] = torch.tensor(self.filler_ids)
        position_ids = widened(batch.position_ids, 0)
        for row in range(rows):  # padding (and the filler in it) is one run of positions, as `collate` makes it
            real = int((batch.sequence_ids[row] >= 0).sum())
            position_ids[row, real:] = torch.arange(width + extra - real)
        return replace(
            batch,
            input_ids=input_ids,
            attention_mask=widened(batch.attention_mask, 0),
            targets=widened(batch.targets, IGNORE_INDEX),
            position_ids=position_ids,
            sequence_ids=widened(batch.sequence_ids, -1),
            images=[],
        )

    def _check_counts(self, batch: MicroBatch, images: list) -> None:
        """The tokens the rows hold for the images against what the images give now: an image replaced by
        another of a different size since the data was prepared would shift every feature after it."""
        placeholder = self.tokens.placeholder_id
        held = int((batch.input_ids == placeholder).sum())
        wanted = sum(self.tokens.expansion(image).count(placeholder) for image in images)
        if held != wanted:
            shown = ", ".join(batch.images[:3]) or "the filler image"
            raise UserError(
                f"the images of {', '.join(batch.origins[:3])} ({shown}) give {wanted} image tokens where the "
                f"prepared data holds {held}: an image changed since the data was prepared; clear its entry in "
                "data.cache_dir (or set data.cache_dir: null) and start again"
            )
