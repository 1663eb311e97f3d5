"""Read records from JSONL, JSON arrays, parquet files and saved Hugging Face datasets, with origins.

JSON and JSONL are parsed line by line here rather than through Arrow: chat records mix types
(`loss` as a boolean in one message and a string in another), which breaks Arrow's schema
inference, and a bad line must be reported as `file:line`. Parquet files and saved datasets
go through the `datasets` library.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuneforge.errors import UserError, first_line

MALFORMED_JSON = "malformed JSON"
NESTED_TOO_DEEP = "nested deeper than Python's JSON reader goes; no chat sample is"


@dataclass(frozen=True)
class RawRecord:
    origin: str
    value: Any
    error: str | None = None
    """Set (and `value` None) for an unparsable line kept only to be counted."""


def _snippet(text: str, limit: int = 80) -> str:
    """The start of a line for a message: control characters (a NUL, an escape sequence) shown escaped, never
    sent to the terminal."""
    text = text.strip()
    text = text if len(text) <= limit else text[:limit] + "..."
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


NOT_UTF8_FIX = "re-encode the file as UTF-8 (for example `iconv -f latin1 -t utf-8 IN > OUT`)"


def _not_utf8(exc: UnicodeDecodeError) -> str:
    return f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at column {exc.start + 1})"


def _read_jsonl(path: Path, on_error: str) -> Iterator[RawRecord]:
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            origin = f"{path}:{number}"
            try:
                # A byte-order mark (Windows editors write one) is not part of the first record.
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                if on_error == "raise":
                    raise UserError(
                        f"{origin}: {_not_utf8(exc)}; {NOT_UTF8_FIX}, or set data.on_error=skip to drop and count "
                        "such lines"
                    ) from None
                yield RawRecord(origin, None, "not UTF-8 text")
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as exc:
                why = (
                    f"{exc.msg.removesuffix(' at')} at column {exc.colno}"
                    if isinstance(exc, json.JSONDecodeError)
                    else NESTED_TOO_DEEP
                )
                message = f"not valid JSON ({why}): {_snippet(line)}"
                if on_error == "raise":
                    raise UserError(
                        f"{origin}: {message}; fix the line, or set data.on_error=skip to drop and count such lines"
                    ) from None
                yield RawRecord(origin, None, message)
                continue
            yield RawRecord(origin, record)


def _json_problem(exc: json.JSONDecodeError) -> str:
    # Some of the reader's messages end in "at" themselves ("Invalid control character at").
    return f"{exc.msg.removesuffix(' at')} at column {exc.colno}"


def _read_json(path: Path, on_error: str) -> Iterator[RawRecord]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: {_not_utf8(exc)}; {NOT_UTF8_FIX}") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise UserError(f"{path}: not readable as JSON ({NESTED_TOO_DEEP})") from None
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # one object per line in a .json file: read it as JSONL
            yield from _read_jsonl(path, on_error)
            return
        raise UserError(
            f"{path}:{exc.lineno}: not valid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})"
        ) from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a JSON array of records, got {type(data).__name__}")
    for index, record in enumerate(data):
        yield RawRecord(f"{path}[{index}]", record)


def _read_rows(dataset: Any, name: str) -> Iterator[RawRecord]:
    for index, row in enumerate(dataset):
        yield RawRecord(f"{name}#row{index}", row)


def _read_parquet(path: Path) -> Iterator[RawRecord]:
    # pyarrow directly, a batch of rows at a time: no copy in a datasets cache and no progress bar for a read.
    import pyarrow.parquet as parquet

    def unreadable(exc: Exception) -> UserError:
        return UserError(
            f"{path}: not a readable parquet file ({first_line(exc)}); check the file, or give it its real suffix"
        )

    try:
        batches = parquet.ParquetFile(str(path)).iter_batches(batch_size=1024)
    except Exception as exc:  # pyarrow raises several types for a file that is not parquet
        raise unreadable(exc) from None
    index = 0
    while True:
        try:
            batch = next(batches, None)
        except Exception as exc:  # a damaged page further in
            raise unreadable(exc) from None
        if batch is None:
            return
        for row in batch.to_pylist():
            yield RawRecord(f"{path}#row{index}", row)
            index += 1


def _read_saved_dataset(path: Path, split: str) -> Iterator[RawRecord]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # a partly copied or foreign directory
        first = first_line(exc)
        raise UserError(f"{path}: not a readable saved dataset ({first}); save it again with save_to_disk") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise UserError(f"{path}: no split {split!r} in this dataset (it has {', '.join(loaded)})")
        loaded = loaded[split]
    yield from _read_rows(loaded, str(path))


def read_records(path: str, on_error: str = "raise", split: str = "train") -> Iterator[RawRecord]:
    """Every record of one source, in file order. `split` picks the split of a saved DatasetDict."""
    source = Path(path)
    if not source.exists():
        raise UserError(f"{source}: data file not found")
    if source.is_dir():
        if not ((source / "dataset_info.json").exists() or (source / "dataset_dict.json").exists()):
            raise UserError(f"{source}: a directory must be a dataset saved with `datasets` (save_to_disk)")
        yield from _read_saved_dataset(source, split)
        return
    suffix = source.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        yield from _read_jsonl(source, on_error)
    elif suffix == ".json":
        yield from _read_json(source, on_error)
    elif suffix == ".parquet":
        yield from _read_parquet(source)
    else:
        raise UserError(f"{source}: unsupported file type {suffix!r}; use .jsonl, .json, .parquet or a saved dataset")
