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


def spans(tokenizer: PreTrainedTokenizerBase, data: TokenizedData, index: int) -> list[tuple[str, bool]]:
    """(text, trained) runs of one sample, decoded run by run so the text reads as the model sees it."""
    ids, labels = data.sample(index)
    runs = []
    for trained, group in groupby(zip(ids.tolist(), labels.tolist(), strict=True), key=lambda p: p[1] != IGNORE_INDEX):
        runs.append((tokenizer.decode([token for token, _ in group]), trained))
    return runs


def show(tokenizer: PreTrainedTokenizerBase, data: TokenizedData, count: int, console: Console) -> None:
    for index in range(min(count, len(data))):
        ids, labels = data.sample(index)
        trained = int((labels != IGNORE_INDEX).sum())
        console.print(f"--- {safe_text(data.origins[index])}: {len(ids)} tokens, {trained} trained ---", markup=False)
        text = Text()
        for text_run, is_trained in spans(tokenizer, data, index):
            run = safe_text(text_run)  # the data's own bytes: shown, never acted on by the terminal
            if console.is_terminal:
                text.append(run, style="bold green" if is_trained else "dim")
            else:
                text.append(f"{OPEN}{run}{CLOSE}" if is_trained else run)
        console.print(text, soft_wrap=True)
    if not console.is_terminal:
        console.print(f"(trained text is between {OPEN} and {CLOSE})", markup=False)
