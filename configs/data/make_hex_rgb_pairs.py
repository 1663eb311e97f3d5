"""Write the DPO demo's synthetic preference pairs: hex colour code -> RGB triple in the house style (chosen)
or in a bare style (rejected), as `prompt`/`chosen`/`rejected` rows.

    python configs/data/make_hex_rgb_pairs.py      # rewrites hex_rgb_pairs_train.jsonl and hex_rgb_pairs_heldout.jsonl

Deterministic (fixed seed); the held-out colours never appear in the training file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TRAIN_SIZE = 2_000
HELDOUT_SIZE = 200
SEED = 4321


def pair(colour: int, rng: random.Random) -> dict:
    red, green, blue = (colour >> 16) & 255, (colour >> 8) & 255, colour & 255
    bare = rng.choice([f"{red} {green} {blue}", f"rgb {red},{green},{blue}", f"{red}/{green}/{blue}"])
    return {
        "prompt": [{"role": "user", "content": f"Convert #{colour:06x} to RGB."}],
        "chosen": [{"role": "assistant", "content": f"({red}, {green}, {blue})"}],
        "rejected": [{"role": "assistant", "content": bare}],
    }


def make(directory: Path) -> None:
    rng = random.Random(SEED)
    colours = rng.sample(range(1 << 24), TRAIN_SIZE + HELDOUT_SIZE)
    for name, chosen in (
        ("hex_rgb_pairs_train.jsonl", colours[:TRAIN_SIZE]),
        ("hex_rgb_pairs_heldout.jsonl", colours[TRAIN_SIZE:]),
    ):
        lines = [json.dumps(pair(c, rng)) for c in chosen]
        (directory / name).write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    make(Path(__file__).parent)
