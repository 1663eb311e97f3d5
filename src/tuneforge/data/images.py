"""Reading a sample's images safely: where a source points, its size from the header, and the decoded RGB pixels.

A bad image is a bad sample: every failure is a ``SampleError`` whose reason the data report counts (missing,
unreadable, corrupt, oversized or empty image, or an image URL). Sources are paths or base64 `data:` URIs; nothing
is downloaded. Sizes are checked from the header before anything is decoded, against the caller's pixel limit,
without touching PIL's process-wide ``Image.MAX_IMAGE_PIXELS`` (other threads may be decoding).
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO
from urllib.parse import unquote

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from tuneforge.data.conversation import SampleError

URL_SCHEMES = ("http", "https", "ftp", "s3", "gs")
"""Remote sources named in the refusal's hint; any other `scheme://` source but `file://` is refused alike."""

DATA_URI = re.compile(r"data:image/[A-Za-z0-9.+-]+(;[A-Za-z0-9_.+-]+=[^;,]*)*;base64,", re.IGNORECASE)
"""The header of a base64 image `data:` URI; the image's bytes follow the comma."""

READ_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF", "AVIF", "JPEG2000", "PPM")
"""The formats PIL may read a sample's image as: photos and pictures. Not all it knows: decoding EPS, for one,
runs Ghostscript."""

TRANSPOSED = {5, 6, 7, 8}
"""EXIF orientations that turn the image a quarter: width and height swap once applied."""


def resolve_source(source: str, root: Path) -> str:
    """An absolute path for a path source (relative ones are under `root`, `~` is expanded, `file://` stripped),
    or a `data:` URI unchanged once its header is checked. URLs are refused: training downloads nothing."""
    if source[:5].lower() == "data:":
        _data_header(source)
        return source
    if source[:7].lower() == "file://":
        source = _file_uri_path(source)
    elif "://" in source:
        raise SampleError(
            "image url", f"{source}: a URL; nothing is downloaded during training: download it and give its path"
        )
    path = Path(source).expanduser()
    return str(path if path.is_absolute() else (Path(root).expanduser() / path).absolute())


def _file_uri_path(source: str) -> str:
    """The path of a `file://` URI: what follows the scheme (and a `localhost` host), its %-escapes decoded."""
    path = source[len("file://") :]
    if path[: len("localhost/")].lower() == "localhost/":
        path = path[len("localhost") :]
    return unquote(path)


def _data_header(source: str) -> int:
    """Where a `data:` URI's base64 payload starts; a URI that is not base64 image data is refused."""
    header = DATA_URI.match(source)
    if header is None:
        raise SampleError(
            "unreadable image", f"{_name(source)}: not base64 image data (expected data:image/TYPE;base64,...)"
        )
    return header.end()


def _name(source: str) -> str:
    """A source as errors name it: a data URI by its header and length, not its whole payload."""
    if source[:5].lower() != "data:":
        return source
    return f"{source[: source.find(',') + 1 or 40]}... ({len(source)} characters)"


def image_size(source: str) -> tuple[int, int]:
    """(width, height) of a resolved source as `open_image` returns it (EXIF orientation applied), from the header
    alone: nothing is decoded (a PNG's EXIF written after its pixels, which only a decode finds, is not seen)."""
    with _opened(source) as image:
        width, height = image.size
        try:
            # PIL's PNG reader decodes the whole image to look for EXIF past the header; the base reader does not.
            orientation = Image.Image.getexif(image).get(0x0112)
        except Exception as exc:  # PIL raises many types on a damaged EXIF block
            raise SampleError("corrupt image", f"{_name(source)}: damaged EXIF data ({exc})") from exc
    return (height, width) if orientation in TRANSPOSED else (width, height)


def open_image(source: str, pixel_limit: int) -> Image.Image:
    """The decoded RGB image of a resolved source (a path or a `data:` URI), turned as its EXIF orientation says
    (what a viewer shows) and with any transparency composited on white. Refused before decoding when its header
    gives more than `pixel_limit` pixels."""
    with _opened(source) as image:
        width, height = image.size
        if width == 0 or height == 0:
            raise SampleError("empty image", f"{_name(source)}: {width}x{height} pixels")
        if width * height > pixel_limit:
            raise SampleError(
                "oversized image", f"{_name(source)}: {width}x{height} pixels, over the limit of {pixel_limit}"
            )
        try:
            image.load()
            turned = ImageOps.exif_transpose(image)
        except Image.DecompressionBombError as exc:
            raise SampleError("oversized image", f"{_name(source)}: {exc}") from exc
        except MemoryError:
            raise  # the host's problem, not the image's
        except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, struct.error... on damaged data
            raise SampleError("corrupt image", f"{_name(source)}: {type(exc).__name__}: {exc}") from exc
    try:
        return _rgb(turned)
    except ValueError as exc:  # a colour mode PIL has no conversion for
        raise SampleError("unreadable image", f"{_name(source)}: {turned.mode} pixels: {exc}") from exc


def blank_image(width: int, height: int) -> Image.Image:
    """A black RGB image: a filler where a batch needs an image and the sample has none."""
    return Image.new("RGB", (width, height))


@functools.cache
def _formats() -> tuple[str, ...]:
    """READ_FORMATS this PIL has a reader for (AVIF and JPEG 2000 need optional libraries)."""
    Image.init()
    return tuple(name for name in READ_FORMATS if name in Image.OPEN)


@contextmanager
def _opened(source: str) -> Iterator[Image.Image]:
    """The source opened by PIL, header read and pixels not yet decoded; the file is closed on leaving."""
    with _handle(source) as handle:
        try:
            image = Image.open(handle, formats=_formats())
        except Image.DecompressionBombError as exc:
            raise SampleError("oversized image", f"{_name(source)}: {exc}") from exc
        except UnidentifiedImageError as exc:
            known = ", ".join(_formats())
            raise SampleError(
                "unreadable image", f"{_name(source)}: not an image in a format read here ({known})"
            ) from exc
        except OSError as exc:
            # A failed read of the file has an errno; PIL's own errors on damaged headers have none.
            reason = "unreadable image" if exc.errno else "corrupt image"
            raise SampleError(reason, f"{_name(source)}: {exc}") from exc
        with image:
            yield image


@contextmanager
def _handle(source: str) -> Iterator[IO[bytes]]:
    """A binary file object over the source's bytes: a data URI's decoded payload, or a regular file."""
    if source[:5].lower() == "data:":
        payload = "".join(source[_data_header(source) :].split())  # line breaks in wrapped base64 are harmless
        try:
            data = base64.b64decode(payload, validate=True)
        except binascii.Error as exc:
            raise SampleError("unreadable image", f"{_name(source)}: bad base64 data ({exc})") from exc
        yield io.BytesIO(data)
        return
    with os.fdopen(_open_regular(source), "rb") as handle:
        yield handle


def _open_regular(path: str) -> int:
    """A descriptor of the regular file at `path`. Opened without blocking and checked once open (no race with a
    swap): a FIFO would wait for a writer forever and a device like /dev/zero never ends."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        descriptor = os.open(path, flags)
    except (FileNotFoundError, NotADirectoryError) as exc:
        dangling = os.path.lexists(path) and isinstance(exc, FileNotFoundError)
        what = "a symbolic link to a missing file" if dangling else "no such file"
        raise SampleError("missing image", f"{path}: {what}") from exc
    except IsADirectoryError as exc:
        raise SampleError("missing image", f"{path}: a directory, not an image file") from exc
    except OSError as exc:
        raise SampleError("unreadable image", f"{path}: {exc.strerror or exc}") from exc
    mode = os.fstat(descriptor).st_mode
    if stat.S_ISREG(mode):
        return descriptor
    os.close(descriptor)
    if stat.S_ISDIR(mode):
        raise SampleError("missing image", f"{path}: a directory, not an image file")
    raise SampleError("unreadable image", f"{path}: not a regular file")


def _rgb(image: Image.Image) -> Image.Image:
    """`image` as 8-bit RGB: deep grey scaled down rather than clipped, transparency composited on white."""
    if image.mode in ("I", "F") or image.mode.startswith("I;"):
        image = _eight_bit(image)
    if image.mode == "RGB":
        return image
    if image.has_transparency_data:
        rgba = image.convert("RGBA")
        white = Image.new("RGB", rgba.size, (255, 255, 255))
        white.paste(rgba, mask=rgba.getchannel("A"))
        return white
    return image.convert("RGB")


def _eight_bit(image: Image.Image) -> Image.Image:
    """A 16-bit, 32-bit integer or float grey image as 8-bit grey (PIL's own conversion clips at 255)."""
    values = np.asarray(image).astype(np.float64)
    if image.mode == "F":
        peak = 1.0 if values.size and values.max() <= 1.0 else 255.0
    else:
        peak = 255.0 if values.size and values.max() <= 255 else 65535.0
    scaled = np.clip(np.rint(values * (255.0 / peak)), 0, 255).astype(np.uint8)
    return Image.fromarray(scaled)
