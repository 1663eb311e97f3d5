"""Write the VLM demo's synthetic data: a picture of one coloured shape -> that colour's hex code.

    python configs/data/make_shapes.py     # rewrites shapes/*.png, shapes_train.jsonl and shapes_heldout.jsonl

Each picture is SIDE x SIDE pixels: a circle, square or triangle of random size and position, in one colour of
PALETTE, on a white or grey background. The question never names the colour: the answer can only be read from the
picture. Records are chats in the OpenAI `messages` format, the image a content part whose path is relative to
this folder.

Deterministic: a fixed seed, shapes rasterised here (no antialiasing: each pixel is the shape's colour or the
background's) and PNGs encoded here too, as 1-bit palette images in stored (uncompressed) deflate blocks, so the
bytes depend neither on Pillow's drawing nor on the zlib build. No held-out picture equals a training one.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
import struct
import zlib
from pathlib import Path

SIDE = 28
"""Pixels on each side: the vision tower's `image_size` in configs/demo_vlm.yaml."""

LEVELS = (0x00, 0x80, 0xFF)
PALETTE = tuple(c for c in itertools.product(LEVELS, repeat=3) if c != (0xFF, 0xFF, 0xFF))
"""26 colours: every channel 00, 80 or ff, white left out (it would vanish on the white background)."""

BACKGROUNDS = ((0xFF, 0xFF, 0xFF), (0xC0, 0xC0, 0xC0))
SHAPES = ("circle", "square", "triangle")
QUESTION = "Colour?"
TRAIN_SIZE = 1600
HELDOUT_SIZE = 200
SEED = 1234
IMAGE_DIR = "shapes"


def hex_code(colour: tuple[int, int, int]) -> str:
    return "#" + "".join(f"{c:02x}" for c in colour)


def shape_mask(shape: str, rng: random.Random) -> list[list[bool]]:
    """Which pixels the shape covers: a size between a third and four fifths of the side, anywhere inside the
    picture; each pixel is tested at its centre."""
    size = rng.randint(SIDE // 3, SIDE * 4 // 5)
    left, top = rng.randint(0, SIDE - size), rng.randint(0, SIDE - size)
    if shape == "square":
        return [[left <= x < left + size and top <= y < top + size for x in range(SIDE)] for y in range(SIDE)]
    if shape == "circle":
        cx, cy, r2 = left + size / 2, top + size / 2, (size / 2) ** 2
        return [[(x + 0.5 - cx) ** 2 + (y + 0.5 - cy) ** 2 <= r2 for x in range(SIDE)] for y in range(SIDE)]
    # An isosceles triangle, point up or down: inside when on the same side of all three edges.
    apex_up = rng.random() < 0.5
    apex_y, base_y = (top, top + size) if apex_up else (top + size, top)
    corners = ((left + size / 2, apex_y), (left, base_y), (left + size, base_y))

    def inside(px: float, py: float) -> bool:
        signs = []
        for (ax, ay), (bx, by) in zip(corners, corners[1:] + corners[:1], strict=True):
            signs.append((bx - ax) * (py - ay) - (by - ay) * (px - ax) >= 0)
        return all(signs) or not any(signs)

    return [[inside(x + 0.5, y + 0.5) for x in range(SIDE)] for y in range(SIDE)]


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(mask: list[list[bool]], background: tuple[int, int, int], colour: tuple[int, int, int]) -> bytes:
    """A 1-bit palette PNG: index 0 the background, 1 the shape; the pixel rows in one stored deflate block."""
    rows = b""
    for row in mask:
        bits = "".join("1" if covered else "0" for covered in row).ljust(-(-SIDE // 8) * 8, "0")
        rows += b"\x00" + int(bits, 2).to_bytes(len(bits) // 8, "big")  # filter type 0, then the packed pixels
    assert len(rows) < 65536
    stored = b"\x01" + struct.pack("<HH", len(rows), len(rows) ^ 0xFFFF) + rows  # final block, uncompressed
    deflate = b"\x78\x01" + stored + struct.pack(">I", zlib.adler32(rows))
    header = struct.pack(">IIBBBBB", SIDE, SIDE, 1, 3, 0, 0, 0)  # width, height, 1 bit, palette, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"PLTE", bytes(background) + bytes(colour))
        + _chunk(b"IDAT", deflate)
        + _chunk(b"IEND", b"")
    )


def record(image: str, colour: tuple[int, int, int]) -> dict:
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]},
            {"role": "assistant", "content": hex_code(colour)},
        ]
    }


def make(directory: Path) -> None:
    rng = random.Random(SEED)
    images = directory / IMAGE_DIR
    if images.exists():
        shutil.rmtree(images)
    images.mkdir(parents=True)
    seen: set[bytes] = set()
    for name, count in (("train", TRAIN_SIZE), ("heldout", HELDOUT_SIZE)):
        lines = []
        while len(lines) < count:
            colour, background = rng.choice(PALETTE), rng.choice(BACKGROUNDS)
            data = png(shape_mask(rng.choice(SHAPES), rng), background, colour)
            if data in seen:  # every picture once: held-out ones are never trained on
                continue
            seen.add(data)
            path = f"{IMAGE_DIR}/{name}_{len(lines):04d}.png"
            (directory / path).write_bytes(data)
            lines.append(json.dumps(record(path, colour)))
        (directory / f"shapes_{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    make(Path(__file__).parent)
