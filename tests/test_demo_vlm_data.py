from __future__ import annotations

import hashlib
import importlib.util
import json
import re

import numpy as np
import pytest
import yaml
from PIL import Image

from conftest import REPO

DATA = REPO / "configs" / "data"
FILES = ("shapes_train.jsonl", "shapes_heldout.jsonl")


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("make_shapes", DATA / "make_shapes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def records(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).open(encoding="utf-8")]


def image_and_answer(record: dict) -> tuple[str, str]:
    user, assistant = record["messages"]
    (image,) = [part["image"] for part in user["content"] if part["type"] == "image"]
    return image, assistant["content"]


def test_generator_reproduces_the_bundled_files_byte_for_byte(generator, tmp_path):
    generator.make(tmp_path)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name
    made = sorted(p.name for p in (tmp_path / "shapes").iterdir())
    assert made == sorted(p.name for p in (DATA / "shapes").iterdir())
    for name in made:
        assert (tmp_path / "shapes" / name).read_bytes() == (DATA / "shapes" / name).read_bytes(), name


def test_each_image_shows_one_shape_in_the_answer_colour(generator):
    side = yaml.safe_load((REPO / "configs" / "demo_vlm.yaml").read_text())["model"]["size"]["vision_config"][
        "image_size"
    ]
    backgrounds = {tuple(c) for c in generator.BACKGROUNDS}
    for name in FILES:
        for record in records(name):
            image, answer = image_and_answer(record)
            assert re.fullmatch(r"#[0-9a-f]{6}", answer)
            # The question is the same for every picture: the colour can only be read from the image.
            assert [p["text"] for p in record["messages"][0]["content"] if p["type"] == "text"] == ["Colour?"]
            with Image.open(DATA / image) as picture:
                pixels = np.asarray(picture.convert("RGB"))
            assert pixels.shape == (side, side, 3)
            colours, counts = np.unique(pixels.reshape(-1, 3), axis=0, return_counts=True)
            found = {tuple(int(v) for v in c): int(n) for c, n in zip(colours, counts, strict=True)}
            shape = tuple(int(answer[i : i + 2], 16) for i in (1, 3, 5))
            assert len(found) == 2 and shape in found and (found.keys() - {shape}) <= backgrounds, (image, found)
            assert found[shape] >= 20, (image, found)  # a visible shape, not a stray pixel


def test_heldout_pictures_are_not_in_training_and_cover_the_palette(generator):
    def pictures(name: str) -> dict[str, str]:
        out = {}
        for record in records(name):
            image, answer = image_and_answer(record)
            with Image.open(DATA / image) as picture:
                out[hashlib.sha256(picture.convert("RGB").tobytes()).hexdigest()] = answer
        return out

    train, heldout = pictures("shapes_train.jsonl"), pictures("shapes_heldout.jsonl")
    assert len(train) == generator.TRAIN_SIZE and len(heldout) == generator.HELDOUT_SIZE  # no picture twice
    assert not train.keys() & heldout.keys()
    palette = {generator.hex_code(c) for c in generator.PALETTE}
    assert set(train.values()) == palette and set(heldout.values()) <= palette
