"""Images in records (content parts, the LLaVA form) and reading them safely: each refusal's reason, decoding."""

from __future__ import annotations

import base64
import io
import os
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from tuneforge.data.conversation import IMAGE_MARK, Conversation, SampleError, Turn, prompt_conversation
from tuneforge.data.formats import detect_format, message_triples, to_conversation
from tuneforge.data.images import blank_image, image_size, open_image, resolve_source

LIMIT = 1_000_000


def convert(record: dict) -> Conversation:
    return to_conversation(record, detect_format(record), "f.jsonl:3")


def refusal(call) -> tuple[str, str]:
    with pytest.raises(SampleError) as info:
        call()
    return info.value.reason, info.value.detail


def user(*content) -> dict:
    return {"role": "user", "content": list(content)}


def reply(content="ok") -> dict:
    return {"role": "assistant", "content": content}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def png_bytes(width: int, height: int, rows: bytes = b"\0\0") -> bytes:
    """A grey PNG whose header says `width` x `height`, whatever pixel rows follow it."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def saved(image: Image.Image, path: Path, **options) -> str:
    image.save(path, **options)
    return str(path)


def pixels(image: Image.Image) -> list[tuple[int, ...]]:
    """An RGB image's pixels, row by row."""
    return [tuple(p) for p in np.asarray(image).reshape(-1, 3).tolist()]


def data_uri(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


# Records -> conversations


def test_content_parts_become_marks_in_order_with_their_sources():
    record = {
        "messages": [
            user(
                {"type": "image", "image": "a.png"},
                text("Compare "),
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                text("and"),
                {"type": "image_url", "image_url": "c.jpg"},
            ),
            reply("Same."),
            user({"type": "image", "path": "/d.png"}, {"type": "image", "url": "file:///e.png"}, text("\nAnd?")),
            reply("Different."),
        ]
    }
    conversation = convert(record)
    assert conversation.images == ("a.png", "data:image/png;base64,AAAA", "c.jpg", "/d.png", "file:///e.png")
    assert [t.user for t in conversation.turns] == ["<image>Compare <image>and<image>", "<image><image>\nAnd?"]
    assert conversation.messages()[0] == {"role": "user", "content": "<image>Compare <image>and<image>"}
    assert hash(conversation) == hash(convert(record))


def test_messages_with_parts_splits_user_messages_at_their_marks():
    conversation = Conversation(
        (Turn("<image>What is it?", "A cat.", system="Be brief."), Turn("And <image><image>", "Dogs.")),
        "m",
        ("a.png", "b.png", "c.png"),
    )
    assert conversation.messages_with_parts() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "image"}, {"type": "image"}]},
        {"role": "assistant", "content": "Dogs."},
    ]
    plain = Conversation((Turn("Hi", "Hello"),), "m")
    assert plain.messages_with_parts() == plain.messages()


def test_a_prompt_carries_its_images():
    prompt = prompt_conversation([("<image>What?", "A cat.")], "And <image>?", images=("a.png", "b.png"))
    assert prompt.images == ("a.png", "b.png") and prompt.turns[-1].assistant is None
    assert prompt_conversation([], "Hi").images == ()
    assert refusal(lambda: prompt_conversation([], "Hi", images=("a.png",)))[0] == "image count mismatch"


@pytest.mark.parametrize(
    ("messages", "reason", "words"),
    [
        (
            [user({"type": "image", "image": "a.png"}, text("<image>")), reply()],
            "image count mismatch",
            "2 <image> marks for 1 images",
        ),
        (
            [user(text("Hi")), {"role": "assistant", "content": [{"type": "image", "image": "a.png"}]}],
            "image outside a user message",
            "the assistant message holds an image",
        ),
        (
            [{"role": "system", "content": [{"type": "image_url", "image_url": "a.png"}]}, user(text("Hi")), reply()],
            "image outside a user message",
            "the system message holds an image",
        ),
        ([user({"type": "image"}, text("Hi")), reply()], "malformed record", "messages[0] part 0: an image source"),
        ([user({"type": "image_url", "image_url": {"url": ""}}), reply()], "malformed record", "not ''"),
        (
            [user(text("Hi"), {"type": "input_audio"}, {"type": "image", "image": "a.png"}), reply()],
            "non-text content",
            "content parts of type input_audio; only text and image parts are trained",
        ),
    ],
)
def test_image_parts_that_cannot_train(messages, reason, words):
    got, detail = refusal(lambda: convert({"messages": messages}))
    assert got == reason and words in detail


def test_preference_pairs_still_take_text_parts_only():
    parts = [user({"type": "image", "image": "a.png"}, text("Hi"))]
    reason, detail = refusal(lambda: message_triples(parts, "prompt"))
    assert reason == "non-text content" and "of type image; only text parts are trained" in detail


def sharegpt(human: str, **extra) -> dict:
    return {"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": "A cat."}], **extra}


@pytest.mark.parametrize(
    ("record", "first_user", "images"),
    [
        (sharegpt("<image>\nWhat is it?", image="a.png"), "<image>\nWhat is it?", ("a.png",)),
        (sharegpt("What is it?", image="a.png"), "<image>\nWhat is it?", ("a.png",)),
        (
            sharegpt("Left <image> right <image>", image=["a.png", "b.png"]),
            "Left <image> right <image>",
            ("a.png", "b.png"),
        ),
        (sharegpt("Which?", images=["a.png", "b.png"]), "<image>\n<image>\nWhich?", ("a.png", "b.png")),
        (sharegpt("What is it?", image=None), "What is it?", ()),
        (sharegpt("What is it?", image=[]), "What is it?", ()),
        (
            {"instruction": "Describe.", "input": "Briefly.", "output": "A cat.", "image": "a.png"},
            "<image>\nDescribe.\nBriefly.",
            ("a.png",),
        ),
        (
            {"instruction": "Describe", "input": "this: <image>", "output": "A cat.", "images": ["a.png"]},
            "Describe\nthis: <image>",
            ("a.png",),
        ),
        (
            {"messages": [{"role": "user", "content": "<image>What?"}, reply()], "images": ["a.png"]},
            "<image>What?",
            ("a.png",),
        ),
        ({"messages": [{"role": "user", "content": "What?"}, reply()], "image": "a.png"}, "<image>\nWhat?", ("a.png",)),
    ],
)
def test_records_with_an_image_key(record, first_user, images):
    conversation = convert(record)
    assert conversation.turns[0].user == first_user and conversation.images == images


@pytest.mark.parametrize(
    ("record", "reason", "words"),
    [
        (sharegpt("<image> and <image>", image="a.png"), "image count mismatch", "2 <image> marks for 1 images"),
        (sharegpt("<image> only", image=["a.png", "b.png"]), "image count mismatch", "1 <image> marks for 2 images"),
        (
            {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "<image>"}], "image": "a"},
            "image outside a user message",
            "turn 1: the assistant message",
        ),
        (sharegpt("Hi", image=""), "malformed record", "`image`: an image source must be a path or a data: URI"),
        (sharegpt("Hi", image=["a.png", 3]), "malformed record", "`image`[1]: an image source"),
        (sharegpt("Hi", image="a.png", images=["b.png"]), "malformed record", "both `image` and `images`"),
        (
            {"messages": [user({"type": "image", "image": "a.png"}), reply()], "images": ["b.png"]},
            "malformed record",
            "images given both as content parts and under the record's image key",
        ),
    ],
)
def test_records_whose_images_do_not_add_up(record, reason, words):
    got, detail = refusal(lambda: convert(record))
    assert got == reason and words in detail


@pytest.mark.parametrize(
    "record",
    [
        {"messages": [user(text("a <image> tag")), reply()]},
        sharegpt("What is <image>?"),
        {"instruction": "Hi <image>", "output": "x"},
    ],
)
def test_a_literal_mark_in_a_text_record_is_text(record):
    """A text model trains on `<image>` as written; a vision-language run drops such a sample (the pipeline's
    check), where the processor's template would read the mark as an image."""
    conversation = convert(record)
    assert conversation.images == () and IMAGE_MARK in conversation.turns[0].user


# Sources


def test_resolve_source_gives_absolute_paths_and_keeps_data_uris(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    root = tmp_path / "data"
    assert resolve_source("img/a.png", root) == str(root / "img" / "a.png")
    assert resolve_source("/abs/a.png", root) == "/abs/a.png"
    assert resolve_source("~/a.png", root) == str(tmp_path / "home" / "a.png")
    assert resolve_source("file:///abs/my%20a.png", root) == "/abs/my a.png"
    assert resolve_source("file://localhost/abs/a.png", root) == "/abs/a.png"
    assert resolve_source("file://img/a.png", root) == str(root / "img" / "a.png")
    monkeypatch.chdir(tmp_path)
    assert resolve_source("a.png", Path("data")) == str(root / "a.png")
    uri = "data:image/png;base64,iVBORw0KGgo="
    assert resolve_source(uri, root) == uri


@pytest.mark.parametrize(
    "source",
    ["http://x.org/a.png", "https://x.org/a.png", "ftp://x/a.png", "s3://bucket/a.png", "gs://b/a"],
)
def test_urls_are_refused(source, tmp_path):
    assert refusal(lambda: resolve_source(source, tmp_path)) == (
        "image url",
        f"{source}: a URL; nothing is downloaded during training: download it and give its path",
    )


def test_a_data_uri_that_is_not_base64_image_data_is_unreadable(tmp_path):
    for source in ("data:text/plain;base64,aGk=", "data:image/png,rawbytes", "data:image/png;base64"):
        reason, detail = refusal(lambda source=source: resolve_source(source, tmp_path))
        assert reason == "unreadable image" and "not base64 image data" in detail
    reason, detail = refusal(lambda: open_image("data:image/png;base64,@@@@", LIMIT))
    assert reason == "unreadable image" and detail.startswith("data:image/png;base64,... (26 characters): bad base64")


# Reading


def test_a_data_uri_round_trips():
    pixels = np.arange(4 * 3 * 3, dtype=np.uint8).reshape(3, 4, 3)
    image = open_image(data_uri(Image.fromarray(pixels)), LIMIT)
    assert image.mode == "RGB" and np.array_equal(np.asarray(image), pixels)
    assert image_size(data_uri(Image.fromarray(pixels))) == (4, 3)


def test_missing_images(tmp_path):
    absent, directory, dangling = tmp_path / "absent.png", tmp_path / "dir.png", tmp_path / "link.png"
    directory.mkdir()
    dangling.symlink_to(tmp_path / "gone.png")
    assert refusal(lambda: open_image(str(absent), LIMIT)) == ("missing image", f"{absent}: no such file")
    assert refusal(lambda: open_image(str(tmp_path / "absent" / "a.png"), LIMIT))[0] == "missing image"
    assert refusal(lambda: open_image(str(directory), LIMIT)) == (
        "missing image",
        f"{directory}: a directory, not an image file",
    )
    assert refusal(lambda: image_size(str(dangling))) == (
        "missing image",
        f"{dangling}: a symbolic link to a missing file",
    )


def test_unreadable_images(tmp_path):
    text_file, eps, fifo = tmp_path / "a.png", tmp_path / "b.eps", tmp_path / "fifo.png"
    text_file.write_text("not an image")
    eps.write_text("%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n")  # PIL would run Ghostscript on it
    for path in (text_file, eps):
        reason, detail = refusal(lambda path=path: open_image(str(path), LIMIT))
        assert reason == "unreadable image" and detail.startswith(f"{path}: not an image in a format read here (PNG,")
    os.mkfifo(fifo)  # opening one for reading would wait for a writer
    started = time.monotonic()
    assert refusal(lambda: open_image(str(fifo), LIMIT)) == ("unreadable image", f"{fifo}: not a regular file")
    assert refusal(lambda: image_size("/dev/zero")) == ("unreadable image", "/dev/zero: not a regular file")
    assert time.monotonic() - started < 1


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_an_image_without_read_permission_is_unreadable(tmp_path):
    path = Path(saved(Image.new("RGB", (2, 2)), tmp_path / "a.png"))
    path.chmod(0)
    assert refusal(lambda: open_image(str(path), LIMIT)) == ("unreadable image", f"{path}: Permission denied")


def test_damaged_images_are_corrupt(tmp_path):
    noise = np.random.default_rng(0).integers(0, 256, (128, 128, 3), dtype=np.uint8)
    for name in ("a.jpg", "a.png"):
        whole = Path(saved(Image.fromarray(noise), tmp_path / name)).read_bytes()
        cut = tmp_path / f"cut-{name}"
        cut.write_bytes(whole[: len(whole) * 6 // 10])
        reason, detail = refusal(lambda cut=cut: open_image(str(cut), LIMIT))
        assert reason == "corrupt image" and detail.startswith(f"{cut}: ")
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    header_only = tmp_path / "header.jpg"  # cut inside its header: PIL fails while opening it
    header_only.write_bytes((tmp_path / "a.jpg").read_bytes()[:300])
    assert refusal(lambda: open_image(str(header_only), LIMIT))[0] == "corrupt image"


def test_oversized_images_are_refused_from_their_header(tmp_path):
    before = Image.MAX_IMAGE_PIXELS
    claims = tmp_path / "claims.png"
    claims.write_bytes(png_bytes(2000, 1000))  # one row of data: decoding would fail, so it is never tried
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_bytes(100_000, 100_000))  # past PIL's own limit: refused when opened
    started = time.monotonic()
    assert refusal(lambda: open_image(str(claims), LIMIT)) == (
        "oversized image",
        f"{claims}: 2000x1000 pixels, over the limit of {LIMIT}",
    )
    reason, detail = refusal(lambda: open_image(str(bomb), 10**12))
    assert reason == "oversized image" and detail.startswith(f"{bomb}: Image size (10000000000 pixels)")
    assert image_size(str(claims)) == (2000, 1000)
    assert time.monotonic() - started < 1
    assert before == Image.MAX_IMAGE_PIXELS


def test_an_image_with_no_pixels_is_empty(tmp_path, monkeypatch):
    # PIL itself refuses to open a file whose header says 0 pixels wide; an image it opens so is refused after.
    zero = tmp_path / "zero.png"
    zero.write_bytes(png_bytes(0, 5))
    assert refusal(lambda: open_image(str(zero), LIMIT))[0] == "unreadable image"
    real = saved(Image.new("L", (1, 5)), tmp_path / "a.png")
    monkeypatch.setattr(Image, "open", lambda handle, formats=None: Image.new("L", (0, 5)))
    assert refusal(lambda: open_image(real, LIMIT)) == ("empty image", f"{real}: 0x5 pixels")


def test_transparency_is_composited_on_white(tmp_path):
    rgba = Image.new("RGBA", (2, 1), (255, 0, 0, 255))
    rgba.putpixel((1, 0), (255, 0, 0, 128))
    assert pixels(open_image(saved(rgba, tmp_path / "a.png"), LIMIT)) == [(255, 0, 0), (255, 127, 127)]
    la = Image.new("LA", (1, 1), (0, 0))
    assert open_image(saved(la, tmp_path / "la.png"), LIMIT).getpixel((0, 0)) == (255, 255, 255)
    palette = Image.new("P", (2, 1), 0)
    palette.putpalette([0, 0, 255, 0, 255, 0])
    palette.putpixel((1, 0), 1)
    decoded = open_image(saved(palette, tmp_path / "p.png", transparency=0), LIMIT)
    assert pixels(decoded) == [(255, 255, 255), (0, 255, 0)]


@pytest.mark.parametrize(
    ("image", "suffix", "first"),
    [
        (Image.new("1", (2, 2), 1), "png", (255, 255, 255)),
        (Image.new("L", (2, 2), 7), "png", (7, 7, 7)),
        (Image.new("CMYK", (2, 2), (0, 0, 0, 0)), "tiff", (255, 255, 255)),
        (Image.fromarray(np.full((2, 2), 65535, dtype=np.uint16)), "png", (255, 255, 255)),
        (Image.fromarray(np.full((2, 2), 32896, dtype=np.uint16)), "png", (128, 128, 128)),
        (Image.fromarray(np.full((2, 2), 0.5, dtype=np.float32)), "tiff", (128, 128, 128)),
    ],
)
def test_every_mode_reads_as_rgb(image, suffix, first, tmp_path):
    decoded = open_image(saved(image, tmp_path / f"a.{suffix}"), LIMIT)
    assert decoded.mode == "RGB" and decoded.size == (2, 2) and decoded.getpixel((0, 0)) == first


def test_exif_orientation_is_applied(tmp_path):
    image = Image.new("RGB", (4, 2), (0, 0, 255))
    for y in range(2):
        image.putpixel((0, y), (255, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned a quarter clockwise: the left column becomes the top row
    path = saved(image, tmp_path / "a.png", exif=exif)
    turned = open_image(path, LIMIT)
    assert turned.size == (2, 4) and image_size(path) == (2, 4)
    assert [turned.getpixel((x, 0)) for x in range(2)] == [(255, 0, 0)] * 2
    assert turned.getpixel((0, 1)) == (0, 0, 255)


def test_blank_image():
    image = blank_image(3, 2)
    assert image.mode == "RGB" and image.size == (3, 2) and set(pixels(image)) == {(0, 0, 0)}


def test_image_size_reads_the_header_only(tmp_path):
    path = tmp_path / "big.png"
    path.write_bytes(png_bytes(5000, 3000))  # its rows are missing: a decode would fail
    assert image_size(str(path)) == (5000, 3000)
    assert IMAGE_MARK == "<image>"
