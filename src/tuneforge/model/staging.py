"""Where a 4-bit model with stacked experts is loaded before tuneforge quantizes those experts.

bitsandbytes quantizes the linear layers while `transformers` loads them, but the stacked routed experts arrive
whole in the load dtype and are quantized afterwards (Mixtral-8x7B: 90 GB in bf16, more than an 80 GB GPU).
`device`: everything loads onto the GPU, which holds the experts unquantized for a moment (fast). `host`: the
model loads into host RAM (each rank its own copy), each expert stack then goes to the GPU alone and is
quantized there, and the rest follows; the GPU never holds more than one stack unquantized.
"""

from __future__ import annotations

from typing import Literal

Staging = Literal["device", "host"]

HEADROOM = 0.9
"""Share of the GPU's free memory a load onto it may take: the allocator and the quantization need the rest."""


def device_load_bytes(stacked: int, linear: int, rest: int, load_bytes: int, kbit: float) -> float:
    """GPU bytes a load onto the GPU reaches: linear layers arrive in k-bit, the stacked experts and everything
    else in the load dtype."""
    return linear * kbit + (stacked + rest) * load_bytes


def host_staged_gpu_bytes(stacked: int, largest: int, linear: int, rest: int, load_bytes: int, kbit: float) -> float:
    """GPU bytes a host-staged load reaches: the experts quantized so far and one stack unquantized, then the
    whole k-bit model with the rest in the load dtype."""
    return max(stacked * kbit + largest * load_bytes, (stacked + linear) * kbit + rest * load_bytes)


def choose_staging(setting: str, device_load: float, free: float) -> Staging:
    """`auto` loads onto the GPU where that fits in HEADROOM of its free memory, else stages in host RAM."""
    if setting in ("device", "host"):
        return setting  # type: ignore[return-value]
    return "device" if device_load <= HEADROOM * free else "host"
