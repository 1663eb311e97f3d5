"""Token-weighted loss: sums over target tokens, divided once by the step's total target count."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from tuneforge.data.batching import MicroBatch
from tuneforge.data.templates import IGNORE_INDEX
from tuneforge.model.attention import model_inputs

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision in AUTOCAST_DTYPES:
        return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision])
    return contextlib.nullcontext()


def loss_sum(model: torch.nn.Module, batch: MicroBatch, precision: str, plain: torch.nn.Module | None = None):
    """Sum of cross-entropy over the batch's target tokens (fp32 reduction). `model` may be an engine's
    wrapper; `plain` is the Hugging Face model inside it (for its config)."""
    plain = plain if plain is not None else model
    device = next(plain.parameters()).device
    with autocast(precision, device):
        logits = model(**model_inputs(plain, batch, device), use_cache=False).logits
    targets = batch.targets.to(device)
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
