"""The compute precision of forward passes: autocast to bf16 or fp16, or none (fp32), and what
`train.precision: auto` stands for on the machine at hand."""

from __future__ import annotations

import contextlib

import torch

from tuneforge.config.schema import Config
from tuneforge.errors import UserError

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision in AUTOCAST_DTYPES:
        return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision])
    return contextlib.nullcontext()


def native_cpu_half_precision() -> bool:
    """Whether this CPU computes bfloat16 matmuls natively (AVX512-BF16 or AMX); without, oneDNN emulates them."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def choose_precision(requested: str, on_gpu: bool, gpu_has_bf16: bool = True) -> tuple[str, str]:
    """The precision to compute in, and why when `requested` is `auto` (empty otherwise): bf16 where the
    hardware computes it natively, fp32 elsewhere (emulated bf16 is slower than fp32, and fp16 needs loss
    scaling, which a user chooses knowingly)."""
    if requested != "auto":
        return requested, ""
    if on_gpu:
        if gpu_has_bf16:
            return "bf16", "the GPU computes bfloat16"
        return "fp32", "this GPU has no bfloat16; train.precision=fp16 is faster there, with loss scaling"
    if native_cpu_half_precision():
        return "bf16", "this CPU computes bfloat16 natively (AVX512-BF16 or AMX)"
    return "fp32", "this CPU has no AVX512-BF16 or AMX, so bf16 would be emulated, several times slower than fp32"


def resumed_precision(
    requested: str, chosen: str, why: str, trained_in: str | None, on_gpu: bool, native_bf16: bool, checkpoint: str
) -> tuple[str, str]:
    """The precision of a resumed run, and why: under `auto`, the interrupted run's (`trained_in`), so the resumed
    run continues with the same numerics although this machine alone would pick another. bf16 where this machine
    only emulates it: kept on a CPU (said, with the faster choice), refused on a GPU (emulated bf16 there is too
    slow to choose silently). A precision set by hand is kept, with a note when the interrupted run's differed."""
    if trained_in is None:  # written by a tuneforge before checkpoints recorded it; said where auto chose
        return chosen, f"{why}; the checkpoint does not record the interrupted run's precision" if why else ""
    if trained_in == chosen:
        return chosen, why
    if requested != "auto":
        if "fp16" in (trained_in, chosen):
            raise UserError(
                f"--resume {checkpoint}: the interrupted run computed in {trained_in}, this one sets "
                f"train.precision={chosen}; fp16 keeps a loss scale in the training state that the other precisions "
                f"neither write nor read, so the state cannot carry over: resume with train.precision={trained_in}"
            )
        return chosen, f"set by hand; the interrupted run computed in {trained_in}"
    kept = f"the interrupted run computed in {trained_in}; on this machine alone auto would pick {chosen}"
    if trained_in != "bf16" or native_bf16:
        return trained_in, kept
    if on_gpu:
        raise UserError(
            f"--resume {checkpoint}: the interrupted run computed in bf16, which this GPU only emulates (slowly); "
            "set train.precision=bf16 to go on in it anyway, or train.precision=fp32 (its losses then differ "
            "slightly from the interrupted run's)"
        )
    return trained_in, f"{kept} (bf16 is emulated on this CPU; train.precision=fp32 is faster, with other numerics)"


def with_precision(cfg: Config, precision: str) -> Config:
    """`cfg` computing in `precision` (what `auto` was resolved to)."""
    if cfg.train.precision == precision:
        return cfg
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"precision": precision})})
