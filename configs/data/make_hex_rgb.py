"""Write the demo's synthetic chat data: hex colour code -> RGB triple, in the OpenAI `messages` format.

    python configs/data/make_hex_rgb.py            # rewrites hex_rgb_train.jsonl and hex_rgb_heldout.jsonl

Deterministic (fixed seed); the held-out colours never appear in the training file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TRAIN_SIZE = 20_000
HELDOUT_SIZE = 200
SEED = 1234


def conversation(colour: int) -> dict:
    red, green, blue = (colour >> 16) & 255, (colour >> 8) & 255, colour & 255
    return {
        "messages": [
            # The bare code: 24 tokens a sample instead of the 40 of "Convert #... to RGB.", and the attention
            # finds the six digits where they always are; the demo learns in a third of the time.
            {"role": "user", "content": f"#{colour:06x}"},
            {"role": "assistant", "content": f"({red}, {green}, {blue})"},
        ]
    }


def make(directory: Path) -> None:
    colours = random.Random(SEED).sample(range(1 << 24), TRAIN_SIZE + HELDOUT_SIZE)
    for name, chosen in (
        ("hex_rgb_train.jsonl", colours[:TRAIN_SIZE]),
        ("hex_rgb_heldout.jsonl", colours[TRAIN_SIZE:]),
    ):
        lines = [json.dumps(conversation(c)) for c in chosen]
        (directory / name).write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    make(Path(__file__).parent)
