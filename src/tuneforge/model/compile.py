"""`train.compile`: compile the element-wise parts of every decoder layer with `torch.compile`.

Matrix multiplies already run at the kernel's speed; what a compiler can win is the chains of small
element-wise operations around them, each a full pass over memory in eager mode: RMSNorm (square, mean,
rsqrt, two multiplies) and the gated MLP's SiLU-times-up. Compiled, each chain is one fused loop. Attention
stays eager: its packed per-sample batching is data-dependent Python that would only graph-break.

Shapes are compiled as dynamic, since packed rows differ in width from batch to batch; the modules of one
class share their compiled code (parameters are inputs, not constants), so a model compiles in seconds to a
minute, once per process.
"""

from __future__ import annotations

import importlib.util
import shutil

import torch
from torch import nn

from tuneforge.errors import UserError

"""Engines whose hooks are outside the compiled modules. FSDP2 and DeepSpeed hook the parameters of every
sharded module; compiling through those hooks is not something tuneforge has tested."""


def is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm")


def is_gated_mlp(module: nn.Module) -> bool:
    """A dense gated MLP (gate, up, down projections and an activation), not an experts block."""
    return all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")) and not hasattr(
        module, "experts"
    )


def check_compiler(device: torch.device) -> None:
    """Fail before the model loads, with the fix, rather than at the first compiled call: the compiler toolchain
    `torch.compile` needs on `device` (whether the engine allows compiling is `EngineTraits.compiles`)."""
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            raise UserError("train.compile on GPUs needs triton (pip install triton); or set train.compile=false")
        if not any(shutil.which(name) for name in ("cc", "gcc", "clang")):
            raise UserError(
                "train.compile: triton builds its launchers with a C compiler; install gcc or set train.compile=false"
            )
        return
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as exc:  # any failure to find one has the same fix
        raise UserError(
            f"train.compile on CPU needs a C++ compiler ({exc}); install g++ or set train.compile=false"
        ) from exc


def stays_eager(name: str, module: nn.Module) -> bool:
    """Attention (its own norms included: other shapes would share, and exhaust, the norms' compiled code)
    and routed experts, however they are stored."""
    return type(module).__name__.endswith("Attention") or name == "experts"


def compile_elementwise(model: nn.Module) -> int:
    """Compile every RMSNorm and dense gated MLP outside attention and routed experts, in place; returns how
    many modules were compiled."""
    compiled = 0
    for name, child in model.named_children():
        if stays_eager(name, child):
            continue
        if is_norm(child) or is_gated_mlp(child):
            child.compile(dynamic=True)
            compiled += 1
        else:
            compiled += compile_elementwise(child)
    return compiled
