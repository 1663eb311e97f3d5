"""Which Python callables a pickle would import, read without running it.

Unpickling runs code: every global a pickle names (GLOBAL, STACK_GLOBAL, INST) is imported and may be called.
Engines' own resume loaders unpickle (DeepSpeed's `torch.load(weights_only=False)`, PyTorch distributed
checkpoint's `.metadata`), so before they run, every pickle in the files they will read is scanned opcode by
opcode (`pickletools`, nothing executed) and the files are refused unless each global they name is on an
allowlist of data types: tensors, dtypes, containers and the engine's own record classes.
"""

from __future__ import annotations

import pickletools
import re
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

from tuneforge.errors import UserError

UNRESOLVED = "<a global built at load time>"
"""A STACK_GLOBAL whose module and name are not plain strings in the pickle: never allowed."""

_STRING_PUSHES = {
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "BINUNICODE8",
    "UNICODE",
    "SHORT_BINSTRING",
    "BINSTRING",
    "STRING",
}
_MEMO_GETS = {"GET", "BINGET", "LONG_BINGET"}
_MEMO_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_EXTENSIONS = {"EXT1", "EXT2", "EXT4"}

# Always data, whatever file they come from.
_DATA_GLOBALS = {
    "collections.OrderedDict",
    "builtins.set",
    "builtins.frozenset",
    "builtins.slice",
    "builtins.complex",
    "builtins.bytearray",
    "_codecs.encode",  # how protocol 2 stores bytes
    "torch.Size",
    "torch.Tensor",
    "torch.device",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_tensor",
    "torch._utils._rebuild_parameter",
    "torch._utils._rebuild_parameter_with_state",
    "torch._utils._rebuild_meta_tensor_no_storage",
    "torch._tensor._rebuild_from_type_v2",
    "torch.serialization._get_layout",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
}


_PLAIN_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_NUMPY_DTYPE = re.compile(r"numpy\.dtypes\.[A-Za-z0-9]+DType")


def _torch_data_type(name: str) -> bool:
    """torch dtypes, layouts, memory formats and storage classes: named `torch.X`, built without side effects."""
    module, _, attribute = name.rpartition(".")
    if module != "torch" or not _PLAIN_NAME.fullmatch(attribute):
        return False
    import torch

    value = getattr(torch, attribute, None)
    if attribute.endswith("Storage"):
        return isinstance(value, type)
    return isinstance(value, torch.dtype | torch.layout | torch.memory_format)


def data_global(name: str) -> bool:
    """Exact names only: from protocol 4 a dotted name is followed attribute by attribute, so a prefix rule
    (`numpy.dtypes.`) would let `numpy.dtypes.__loader__...` through."""
    return name in _DATA_GLOBALS or _torch_data_type(name) or bool(_NUMPY_DTYPE.fullmatch(name))


def pickle_globals(data: bytes) -> set[str]:
    """Every global `data` would import when unpickled, as `module.name`; `UNRESOLVED` for one whose name is
    computed at load time, and the extension code for the copyreg registry (both refused by any allowlist)."""
    found: set[str] = set()
    memo: dict[int, str | None] = {}
    recent: list[str | None] = []  # values pushed by the opcodes just before, for STACK_GLOBAL
    for opcode, argument, _ in pickletools.genops(data):
        name = opcode.name
        if name in ("GLOBAL", "INST"):
            module, _, attribute = str(argument).partition(" ")
            found.add(f"{module}.{attribute}")
        elif name == "STACK_GLOBAL":
            pair = recent[-2:]
            resolved = len(pair) == 2 and all(isinstance(part, str) for part in pair)
            found.add(f"{pair[0]}.{pair[1]}" if resolved else UNRESOLVED)
        elif name in _EXTENSIONS:
            found.add(f"<copyreg extension {argument}>")
        if name in _STRING_PUSHES:
            recent.append(str(argument))
        elif name in _MEMO_GETS:
            recent.append(memo.get(int(argument)))
        elif name == "MEMOIZE":
            memo[len(memo)] = recent[-1] if recent else None
        elif name in _MEMO_PUTS:
            memo[int(argument)] = recent[-1] if recent else None
        elif name not in ("FRAME", "PROTO"):
            recent.append(None)
        del recent[:-2]
    return found


ZIP_MAGIC = b"PK\x03\x04"


def starts_as_zip(path: Path) -> bool:
    with path.open("rb") as handle:
        return handle.read(4) == ZIP_MAGIC


def file_pickles(path: Path, single_pickle: bool = False) -> Iterable[tuple[str, bytes]]:
    """(where, pickle bytes) of a file, decided as torch.load decides: a zip archive when it starts as one (each
    `.pkl` member, every member name once), else, with `single_pickle`, the file as the one pickle its reader
    takes. Any other file is refused: torch's legacy format holds several pickles and raw storage bytes."""
    if not starts_as_zip(path):
        if not single_pickle:
            raise ValueError("not in PyTorch's zip format (its legacy format is not read)")
        yield str(path), path.read_bytes()
        return
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            names = [member.filename for member in members]
            if len(names) != len(set(names)):
                raise ValueError("the archive names a member twice")
            for member in members:
                if member.filename.endswith(".pkl"):
                    yield f"{path}:{member.filename}", archive.read(member)
    except zipfile.BadZipFile as exc:
        raise ValueError(f"not a readable archive ({exc})") from None


def refuse_unsafe_pickles(
    paths: Iterable[Path], allowed: Callable[[str], bool], what: str, remedy: str = "", single_pickle: bool = False
) -> None:
    """UserError naming the first file that would import a global outside `data_global` and `allowed`.
    `single_pickle`: the files are one plain pickle each (DCP's `.metadata`), not torch.save archives."""
    for path in paths:
        try:
            pickles = list(file_pickles(path, single_pickle))
        except (OSError, ValueError) as exc:
            raise UserError(f"{what}: {path} is not readable as a checkpoint file ({exc})") from None
        for where, data in pickles:
            try:
                names = pickle_globals(data)
            except ValueError as exc:  # not a pickle, or cut short
                raise UserError(f"{what}: {where} is not a readable pickle ({exc}); it is damaged") from None
            unsafe = sorted(n for n in names if not (data_global(n) or allowed(n)))
            if unsafe:
                shown = ", ".join(unsafe[:5]) + (f" and {len(unsafe) - 5} more" if len(unsafe) > 5 else "")
                raise UserError(
                    f"{what}: {where} would import {shown} when loaded, which can run any code; tuneforge only "
                    f"loads files that hold data. {remedy}".rstrip()
                )
