"""What a checkpoint directory records beside its weights, as its readers read it: tuneforge's record of the
chat template and adapter base (`CHAT_META`) and the manifest of its files. Below training and loading alike, so
that what reads a checkpoint does not depend on what writes one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tuneforge.errors import UserError, first_line

CHAT_META = "tuneforge.json"
"""Written beside the weights: the chat template and system prompt the model was trained with, and for an
adapter how to rebuild its base (`adapter`)."""

QUANTIZED_EXPERTS = "quantized_experts"
"""Key in the `adapter` part of `CHAT_META`: how many experts modules of the base held their stacked weights in
4 bits while the adapter trained. Absent: written before tuneforge quantized them (they were full precision)."""

MANIFEST = "manifest.json"
"""Every file of a committed checkpoint with its size: resume tells a complete checkpoint from one truncated or
partly copied since (sizes, not checksums: reading back hundreds of GB at every resume costs too much)."""


def checkpoint_problems(checkpoint: Path) -> list[str]:
    """What is missing or of another size than when `checkpoint` was written ([] when it is whole, or when it
    predates manifests)."""
    path = checkpoint / MANIFEST
    if not path.exists():
        return []
    try:
        files = json.loads(path.read_text())["files"]
        entries = list(files.items())
    except (ValueError, KeyError, TypeError, AttributeError):
        return [f"{path} is unreadable"]
    for name, size in entries:
        inside = isinstance(name, str) and not Path(name).is_absolute() and ".." not in Path(name).parts
        if not inside or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            # Never followed: a hand-made manifest would otherwise have tuneforge report other files' sizes.
            return [
                f"{path} names {name!r} with size {size!r}, not a file of this checkpoint: it was not written "
                "by tuneforge"
            ]
    problems = []
    for name, size in entries:
        file = checkpoint / name
        if not file.exists():
            problems.append(f"{file} is missing")
        elif (now := file.stat().st_size) != size:
            problems.append(f"{file} has {now:,} bytes, {size:,} when written (truncated or overwritten)")
    return problems


META_TYPES = {"template": (str, dict), "system": (str,), "adapter": (dict,), "step": (int,)}
"""What each key of `CHAT_META` holds (None allowed for all): a file handed over is checked before it is used."""


def read_chat_meta(checkpoint: Path) -> dict[str, Any] | None:
    path = checkpoint / CHAT_META
    if not path.exists():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        reason = first_line(exc)
        raise UserError(f"{path}: not readable ({reason}); the checkpoint is damaged, take another one") from None
    if not isinstance(meta, dict):
        raise UserError(f"{path}: holds {type(meta).__name__}, not tuneforge's record of the checkpoint")
    for key, types in META_TYPES.items():
        value = meta.get(key)
        if value is not None and not isinstance(value, types):
            raise UserError(
                f"{path}: {key} is {value!r}, not {' or '.join(t.__name__ for t in types)}; the file was edited or "
                "is not tuneforge's; fix it, or pass --template NAME (and --system) to chat"
            )
    return meta
