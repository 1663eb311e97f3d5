"""Figures for the step line: peak memory and step times (the model FLOPs a token needs are `model.flops`)."""

from __future__ import annotations

import resource
import time

import torch


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated GPU memory on GPU; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kilobytes on Linux


class StepClock:
    """Times steps without waiting for them. On a GPU a mark is an event in the stream, timed once the step's
    figures have been read (it is done by then); elsewhere the host clock, where work is done as it is called."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.origin = self.mark()

    def mark(self) -> torch.cuda.Event | float:
        if not self.cuda:
            return time.monotonic()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float:
        """From mark `start` to mark `end` (both done)."""
        if isinstance(start, float) and isinstance(end, float):
            return end - start
        assert isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event)
        return start.elapsed_time(end) / 1000

    def since_origin(self, mark: torch.cuda.Event | float) -> float:
        return self.seconds(self.origin, mark)
