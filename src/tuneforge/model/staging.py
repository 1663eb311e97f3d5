"""Where a 4-bit model with stacked experts is loaded before tuneforge quantizes those experts.

bitsandbytes quantizes the linear layers while `transformers` loads them, but the stacked routed experts arrive
whole in the load dtype and are quantized afterwards (Mixtral-8x7B: 90 GB in bf16, more than an 80 GB GPU).
`device`: everything loads onto the GPU, which holds the experts unquantized for a moment. `host`: the model
loads into host RAM (each rank its own copy; bitsandbytes quantizes the linear layers with its CPU kernels),
each expert stack then goes to the GPU alone and is quantized there, and the rest follows; the GPU never holds
more than one stack unquantized. The run and the estimate decide with the same rule, `choose_staging`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from tuneforge.errors import UserError

Staging = Literal["device", "host"]

HEADROOM = 0.9
"""Share of the GPU's free memory a load onto it may take: the allocator and the quantization need the rest."""

LOAD_CONTEXT_BYTES = 2**30
"""GPU memory taken before the weights load (CUDA context): what the estimate subtracts from the capacity."""


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


def available_host_bytes() -> float:
    """Host RAM the kernel can give without swapping (MemAvailable); infinite where it does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def check_host_room(setting: str, device_load: float, free: float, host: float, local_ranks: int) -> None:
    """A host-staged load needs the model once per rank of the node in host RAM: refused up front when the RAM
    available is short (the alternative would be the kernel's OOM killer halfway through loading)."""
    if local_ranks * device_load <= host:
        return
    gib = 2**30
    raise UserError(
        f"model.quantization.stage_experts={setting}: staging the model in host RAM needs {local_ranks} x "
        f"{device_load / gib:.1f} GiB (a copy per rank on this node), {host / gib:.1f} GiB are available; loading "
        f"onto the GPU needs {device_load / gib:.1f} GiB, {free / gib:.1f} are free. Use fewer ranks per node, free "
        "host memory, or GPUs with more memory"
    )
