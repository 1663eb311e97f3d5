"""A ring buffer of the collectives this rank issued, and the module running when it issued each one.

Every `torch.distributed` collective entry point that DDP, FSDP2 and DeepSpeed reach from Python is wrapped
once per process (`install`), so each call is numbered and kept with its op, tensor shapes and dtypes, and the
innermost module whose forward was running. Two ranks that issue the same program have the same sequence;
the first number at which they differ is where they diverged. DDP's bucket all-reduces run in C++ and are
recorded through a communication hook in the DDP engine instead.

Each record also keeps its call site: the innermost frame outside torch and DeepSpeed, that is the model,
engine or user code that issued it. A rank that gloo or NCCL aborts (SIGABRT) never writes a dump, so the
collective in flight is also kept in a small memory-mapped file (the black box, `arm_black_box`): the kernel
keeps its content when the process dies.

Module tracking uses the global forward hooks of `torch.nn` (no model code is touched): a stack of names,
pushed before and popped after each forward; in backward, a hook on each module's output tensor names the
module whose backward is about to run.
"""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

RING_SIZE = 512
WRAPPED = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "_all_gather_base",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "reduce",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
)


@dataclass
class CollectiveRecord:
    seq: int
    op: str
    shapes: list[list[int]]
    dtypes: list[str]
    module: str
    phase: str
    started: float
    """time.time() when issued."""
    seconds: float | None = None
    """How long the call took (None while in flight; asynchronous calls return at once)."""
    site: str = ""
    """`file:line in function` that issued it, outside torch and DeepSpeed ("" from autograd's own threads)."""

    def signature(self) -> tuple:
        """What must match across ranks for the collective to pair up."""
        return (self.op, tuple(map(tuple, self.shapes)), tuple(self.dtypes))

    def describe(self) -> str:
        tensors = ", ".join(f"{tuple(s)} {d}" for s, d in zip(self.shapes, self.dtypes, strict=False)) or "no tensors"
        return f"#{self.seq} {self.op}({tensors}) in {self.module or '-'} [{self.phase}]"


LIBRARY_PARTS = ("/torch/", "/deepspeed/", "tuneforge/diagnostics/recorder.py", "/functools.py", "/contextlib.py")
"""Frames that are plumbing between the code that asks for a collective and the collective itself."""
BLACK_BOX_BYTES = 4096


@functools.lru_cache(maxsize=4096)
def _is_library(filename: str) -> bool:
    return any(part in filename for part in LIBRARY_PARTS)


def call_site(skip: int = 2) -> str:
    """`file:line in function` of the innermost caller outside torch, DeepSpeed and this module."""
    frame = sys._getframe(skip)
    while frame is not None and _is_library(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return ""
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def read_black_box(path: Path) -> dict | None:
    """The collective a rank had in flight when it died (None if it had none, or never armed the box)."""
    try:
        text = path.read_bytes().rstrip(b"\0 ").decode()
        return json.loads(text) if text else None
    except (OSError, ValueError):
        return None


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


class CollectiveRecorder:
    def __init__(self, size: int = RING_SIZE):
        self.records: deque[CollectiveRecord] = deque(maxlen=size)
        self.seq = 0
        self.phase = "startup"
        self.in_flight: CollectiveRecord | None = None
        """The oldest collective not yet complete: the one a rank that stopped is waiting in."""
        self._outstanding: list[CollectiveRecord] = []
        self._paused = threading.local()
        self._modules: list[str] = []
        self._names: dict[int, str] = {}
        self._backward_module = ""
        self._lock = threading.Lock()
        self._handles: list[Any] = []
        self._originals: dict[str, Callable] = {}
        self._black_box: mmap.mmap | None = None

    # -- modules -------------------------------------------------------------------------------------------
    def track_modules(self, model: nn.Module) -> None:
        self._names = {id(module): name or type(module).__name__ for name, module in model.named_modules()}
        if not self._handles:
            self._handles = [
                nn.modules.module.register_module_forward_pre_hook(self._enter),
                nn.modules.module.register_module_forward_hook(self._leave, always_call=True),
            ]

    def _enter(self, module: nn.Module, _args: Any) -> None:
        name = self._names.get(id(module))
        if name is not None:
            if not self._modules:
                self._backward_module = ""  # a new forward: the last backward is over
            self._modules.append(name)

    def _leave(self, module: nn.Module, _args: Any, output: Any) -> None:
        name = self._names.get(id(module))
        if name is not None and self._modules:
            self._modules.pop()
        # The gradient of a module's output arrives just before its backward runs: a hook on that tensor (it
        # returns nothing, so gradients are untouched) names the module for the collectives of its backward.
        # Nested modules often return the same tensor; the innermost one (whose forward ended first) keeps it.
        first = output[0] if isinstance(output, (tuple, list)) and output else output
        if (
            name is not None
            and isinstance(first, torch.Tensor)
            and first.requires_grad
            and not hasattr(first, "_tuneforge_module")
        ):
            first._tuneforge_module = name
            first.register_hook(lambda _grad, name=name: self._enter_backward(name))

    def _enter_backward(self, name: str) -> None:
        self._backward_module = name

    @property
    def module(self) -> str:
        if self._modules:
            return self._modules[-1]
        return self._backward_module if self.phase == "forward/backward" else ""

    # -- collectives ---------------------------------------------------------------------------------------
    def record(self, op: str, args: tuple, kwargs: dict) -> CollectiveRecord:
        tensors = [t for value in (*args, *kwargs.values()) for t in _tensors(value)]
        with self._lock:
            self.seq += 1
            entry = CollectiveRecord(
                seq=self.seq,
                op=op,
                shapes=[list(t.shape) for t in tensors[:4]],
                dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors[:4]],
                module=self.module,
                phase=self.phase,
                started=time.time(),
                site=call_site(3),
            )
            self.records.append(entry)
            self._outstanding.append(entry)
            if self.in_flight is None:
                self.in_flight = entry
                self._write_black_box(entry)
        return entry

    def done(self, entry: CollectiveRecord) -> None:
        """`entry` completed. Completions may come out of order: DDP's bucket hook records its all-reduce until
        the future completes, and the asynchronous call it makes inside returns (done) at once."""
        entry.seconds = time.time() - entry.started
        with self._lock:
            self._outstanding = [e for e in self._outstanding if e is not entry]
            oldest = self._outstanding[0] if self._outstanding else None
            if oldest is not self.in_flight:
                self.in_flight = oldest
                self._write_black_box(oldest)

    # -- black box -----------------------------------------------------------------------------------------
    def arm_black_box(self, path: Path) -> None:
        """Keep the collective in flight in `path` (a page of shared memory backed by the file)."""
        self.disarm_black_box()
        path.write_bytes(b"\0" * BLACK_BOX_BYTES)
        with path.open("r+b") as file:
            self._black_box = mmap.mmap(file.fileno(), BLACK_BOX_BYTES)

    def disarm_black_box(self) -> None:
        if self._black_box is not None:
            self._black_box.close()
            self._black_box = None

    def _write_black_box(self, entry: CollectiveRecord | None) -> None:
        if self._black_box is None:
            return
        payload = json.dumps(asdict(entry)).encode() if entry is not None else b""
        if len(payload) > BLACK_BOX_BYTES:
            payload = json.dumps({**asdict(entry), "shapes": [], "dtypes": []}).encode()[:BLACK_BOX_BYTES]
        self._black_box[:] = payload.ljust(BLACK_BOX_BYTES, b"\0")

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Calls on this thread are not recorded: a caller that records the collective itself."""
        self._paused.active = True
        try:
            yield
        finally:
            self._paused.active = False

    def _wrap(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._paused, "active", False):
                return original(*args, **kwargs)
            entry = self.record(name, args, kwargs)
            try:
                return original(*args, **kwargs)
            finally:
                self.done(entry)

        recorded.__tuneforge_recorded__ = True  # type: ignore[attr-defined]
        return recorded

    def install(self) -> None:
        """Wrap the collective entry points of `torch.distributed` (idempotent, process-wide)."""
        for name in WRAPPED:
            original = getattr(dist, name, None)
            if original is None or getattr(original, "__tuneforge_recorded__", False):
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(name, original))

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def snapshot(self) -> list[dict]:
        with self._lock:
            return [asdict(entry) for entry in self.records]


RECORDER = CollectiveRecorder()
"""One per process: collectives are process-wide."""
