"""Random draws made inside `forked_rng` (a model's initialisation, an engine that seeds the process's
generators as it starts) leave the run's generators as they were: Python's, NumPy's and torch's (the CUDA one
of the device too)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy
import torch


@contextlib.contextmanager
def forked_rng(device: torch.device) -> Iterator[None]:
    devices = [device] if device.type == "cuda" else []
    python_state, numpy_state = random.getstate(), numpy.random.get_state()
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        numpy.random.set_state(numpy_state)
