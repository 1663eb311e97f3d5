"""Write the GRPO demo's prompts: hex colour code -> RGB triple as `{"prompt": ..., "answer": ...}` records, the
answer being what a completion must equal to earn the exact-match reward.

    python configs/data/make_hex_rgb_prompts.py    # rewrites hex_rgb_prompts_{train,heldout}.jsonl

Read from the SFT demo's files (configs/data/make_hex_rgb.py writes them): the training prompts are the first
TRAIN_SIZE colours of hex_rgb_train.jsonl, the held-out ones all of hex_rgb_heldout.jsonl, so no held-out colour
is ever a training prompt. (The demo's `eval.exact_match` reads hex_rgb_heldout.jsonl itself; the held-out prompts
are there to score other rewards against.)
"""

from __future__ import annotations

import json
from pathlib import Path

TRAIN_SIZE = 4_000


def prompt(record: dict) -> dict:
    user, assistant = record["messages"]
    return {"prompt": user["content"], "answer": assistant["content"]}


def make(directory: Path, source: Path | None = None) -> None:
    source = source or Path(__file__).parent
    for name, wanted, size in (
        ("hex_rgb_prompts_train.jsonl", "hex_rgb_train.jsonl", TRAIN_SIZE),
        ("hex_rgb_prompts_heldout.jsonl", "hex_rgb_heldout.jsonl", None),
    ):
        lines = (source / wanted).read_text(encoding="utf-8").splitlines()[:size]
        records = [json.dumps(prompt(json.loads(line))) for line in lines]
        (directory / name).write_text("\n".join(records) + "\n", encoding="utf-8")


if __name__ == "__main__":
    make(Path(__file__).parent)
