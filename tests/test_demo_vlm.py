"""The vision-language demo as users run it: a fresh LLaVA learns to name the colour of a shape in a picture."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import train_here, tuneforge_here

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_vision_demo_learns_held_out_pictures_and_chats_about_one(tmp_path):
    result = train_here(REPO / "configs" / "demo_vlm.yaml", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    accuracy = float(re.search(r"demo accuracy: ([0-9.]+)", result.stdout).group(1))
    assert accuracy >= 0.9
    record = json.loads((REPO / "configs" / "data" / "shapes_heldout.jsonl").read_text().splitlines()[0])
    image = REPO / "configs" / "data" / record["messages"][0]["content"][0]["image"]
    answer = record["messages"][-1]["content"]
    chat = tuneforge_here(
        "chat", str(tmp_path / "run" / "checkpoints" / "final"), "--image", str(image), "--prompt", "Colour?"
    )
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.strip() == answer
