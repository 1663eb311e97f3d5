"""`tuneforge data preview`: rendered samples with the trained tokens marked."""

from __future__ import annotations

from itertools import groupby

from rich.console import Console
from rich.text import Text
from transformers import PreTrainedTokenizerBase

from tuneforge.data.templates import IGNORE_INDEX
from tuneforge.data.tokenize import TokenizedData
from tuneforge.terminal import safe_text

OPEN, CLOSE = "[[", "]]"
"""Markers around trained text when the output is not a terminal."""


def spans(
    tokenizer: PreTrainedTokenizerBase, data: TokenizedData, index: int, image_token: int | None = None
) -> list[tuple[str, bool]]:
    """(text, trained) runs of one sample, decoded run by run so the text reads as the model sees it; a run of
    an image's tokens (`image_token`) shows as one `<image: N tokens>`."""
    ids, labels = data.sample(index)
    runs = []
    for trained, group in groupby(zip(ids.tolist(), labels.tolist(), strict=True), key=lambda p: p[1] != IGNORE_INDEX):
        tokens = [token for token, _ in group]
        text = ""
        for is_image, piece in groupby(tokens, key=lambda token: token == image_token):
            piece = list(piece)
            text += f"<image: {len(piece)} tokens>" if is_image else tokenizer.decode(piece)
        runs.append((text, trained))
    return runs


def show(
    tokenizer: PreTrainedTokenizerBase,
    data: TokenizedData,
    count: int,
    console: Console,
    image_token: int | None = None,
) -> None:
    for index in range(min(count, len(data))):
        ids, labels = data.sample(index)
        trained = int((labels != IGNORE_INDEX).sum())
        images = data.images_of(index)
        seen = f", {len(images)} image(s): {', '.join(images)}" if images else ""
        header = f"--- {data.origins[index]}: {len(ids)} tokens, {trained} trained{seen} ---"
        console.print(safe_text(header), markup=False, soft_wrap=True)
        text = Text()
        for text_run, is_trained in spans(tokenizer, data, index, image_token):
            run = safe_text(text_run)  # the data's own bytes: shown, never acted on by the terminal
            if console.is_terminal:
                text.append(run, style="bold green" if is_trained else "dim")
            else:
                text.append(f"{OPEN}{run}{CLOSE}" if is_trained else run)
        console.print(text, soft_wrap=True)
    if not console.is_terminal:
        console.print(f"(trained text is between {OPEN} and {CLOSE})", markup=False)
