from __future__ import annotations

import importlib.util
import json

from conftest import REPO


def test_generator_reproduces_the_bundled_files_and_keeps_heldout_apart(tmp_path):
    spec = importlib.util.spec_from_file_location("make_hex_rgb", REPO / "configs" / "data" / "make_hex_rgb.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make(tmp_path)
    for name in ("hex_rgb_train.jsonl", "hex_rgb_heldout.jsonl"):
        assert (tmp_path / name).read_text() == (REPO / "configs" / "data" / name).read_text()
    prompts = {
        name: {json.loads(line)["messages"][0]["content"] for line in (tmp_path / name).open()}
        for name in ("hex_rgb_train.jsonl", "hex_rgb_heldout.jsonl")
    }
    assert len(prompts["hex_rgb_heldout.jsonl"]) == 200
    assert not prompts["hex_rgb_train.jsonl"] & prompts["hex_rgb_heldout.jsonl"]
    sample = json.loads((tmp_path / "hex_rgb_heldout.jsonl").open().readline())
    colour = sample["messages"][0]["content"].split("#")[1][:6]
    rgb = tuple(int(colour[i : i + 2], 16) for i in (0, 2, 4))
    assert sample["messages"][1]["content"] == str(rgb)
