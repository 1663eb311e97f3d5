"""Why a checkpoint could not be written, from whatever error the writer raised.

Writers wrap the operating system's error in their own: torch.save raises `RuntimeError: [enforce fail at
inline_container.cc] unexpected pos` or `file write failed`, C++ streams `basic_ios::clear: iostream error`,
safetensors `IoError(Os { code: 28, ... })`. The errno is read where the message carries it; where it does not,
the file system is asked (free space, the process's file-size limit, a probe write), so a full disk, a file-size
limit or a directory made unwritable are told apart from a bug.
"""

from __future__ import annotations

import errno
import os
import re
import resource
import shutil
import uuid
from enum import IntEnum
from pathlib import Path


class WriteFault(IntEnum):
    """Index of each fault in the vote every rank takes part in (one all-reduce tells all ranks all faults)."""

    NO_SPACE = 0
    FILE_TOO_LARGE = 1
    NOT_WRITABLE = 2
    OTHER = 3


FAULT_ERRNOS = {
    errno.ENOSPC: WriteFault.NO_SPACE,
    errno.EDQUOT: WriteFault.NO_SPACE,
    errno.EFBIG: WriteFault.FILE_TOO_LARGE,
    errno.EACCES: WriteFault.NOT_WRITABLE,
    errno.EPERM: WriteFault.NOT_WRITABLE,
    errno.EROFS: WriteFault.NOT_WRITABLE,
}
_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]|os error (\d+)|code: (\d+)")
LOW_SPACE_BYTES = 16 * 2**20
"""Below this much free space a write failure without an errno is taken for a full disk."""


def _errnos(exc: BaseException) -> list[int]:
    """The errno of `exc` and of the errors it wraps, and any errno its message quotes."""
    found: list[int] = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            found.append(exc.errno)
        found += [int(next(g for g in match.groups() if g)) for match in _ERRNO_IN_TEXT.finditer(str(exc))]
        for wrapped in getattr(exc, "failures", {}).values():  # DCP's CheckpointException: (error, trace) per rank
            wrapped = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
            if isinstance(wrapped, BaseException):
                found += _errnos(wrapped)
        exc = exc.__cause__ or exc.__context__
    return found


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (where a write into `path` would meet the file system)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe(directory: Path) -> int | None:
    """The errno a small write into `directory` (or the nearest existing parent) fails with; None if it works."""
    directory = nearest_existing(directory)
    probe = directory / f".tuneforge-probe-{uuid.uuid4().hex[:8]}"
    try:
        with probe.open("wb") as handle:
            handle.write(b"\0" * 65536)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        return exc.errno
    finally:
        probe.unlink(missing_ok=True)
    return None


def file_size_limit() -> int | None:
    """The process's file-size limit in bytes (`ulimit -f`), None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def classify(exc: BaseException, written_into: Path) -> WriteFault:
    """What stopped a write into `written_into`: a known fault, or OTHER (a bug, or an error of another kind)."""
    for number in _errnos(exc):
        if number in FAULT_ERRNOS:
            return FAULT_ERRNOS[number]
    if not isinstance(exc, OSError | RuntimeError) and not hasattr(exc, "failures"):
        return WriteFault.OTHER
    # The writer kept the errno to itself: ask the file system what a write there meets now.
    if shutil.disk_usage(nearest_existing(written_into)).free < LOW_SPACE_BYTES:
        return WriteFault.NO_SPACE
    probed = _probe(written_into)
    if probed is not None:
        return FAULT_ERRNOS.get(probed, WriteFault.OTHER)
    # The only other limit a write meets: the file-size limit (a write crossing it fails whole, so the file
    # stops short of it by up to one write's size).
    return WriteFault.FILE_TOO_LARGE if file_size_limit() is not None else WriteFault.OTHER
