"""Token-weighted loss: sums over target tokens, divided once by the step's total target count."""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tuneforge.data.batching import MicroBatch
from tuneforge.data.templates import IGNORE_INDEX
from tuneforge.model.attention import model_inputs, to_device
from tuneforge.train.fused_loss import linear_cross_entropy_sum, plain_output_layer

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision in AUTOCAST_DTYPES:
        return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision])
    return contextlib.nullcontext()


def loss_sum(
    model: torch.nn.Module,
    batch: MicroBatch,
    precision: str,
    plain: torch.nn.Module | None = None,
    fuse: bool = True,
) -> torch.Tensor:
    """Sum of cross-entropy over the batch's target tokens (fp32 reduction). `model` may be an engine's
    wrapper; `plain` is the Hugging Face model inside it (for its config and output layer). `fuse`: whether
    the engine leaves the output layer's weight whole after the forward (`EngineTraits.fuses_output_layer`),
    so the loss may apply it to the labelled tokens itself."""
    plain = plain if plain is not None else model
    device = next(plain.parameters()).device
    targets = to_device(batch.targets, device)
    inputs = model_inputs(plain, batch, device)
    head = fused_output_layer(plain) if fuse else None
    with autocast(precision, device):
        if head is None:
            logits = model(**inputs, use_cache=False).logits
            return F.cross_entropy(
                logits.float().reshape(-1, logits.size(-1)),
                targets.reshape(-1),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
        # The forward goes through the engine's wrapper as usual (its hooks and gradient sync stay intact),
        # computing logits for one position only; the loss takes the final hidden states from there.
        outputs = model(**inputs, use_cache=False, logits_to_keep=1, output_hidden_states=True)
        compute_dtype = AUTOCAST_DTYPES.get(precision, head.weight.dtype)
    weight = head.weight  # read after the forward: FSDP2 has gathered the root's parameters by now
    if isinstance(weight, DTensor):
        raise RuntimeError("the output layer's weight is still sharded after the forward; the fused loss needs it")
    # The labelled positions, found on the CPU copy of the targets: a boolean index on the GPU would wait for it.
    selected = to_device((batch.targets.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1), device)
    hidden = outputs.hidden_states[-1]
    hidden = hidden.reshape(-1, hidden.size(-1)).index_select(0, selected)
    return linear_cross_entropy_sum(hidden, weight, targets.reshape(-1).index_select(0, selected), compute_dtype)


def fused_output_layer(plain: torch.nn.Module) -> torch.nn.Linear | None:
    """The output layer to fuse with the loss, or None where the model's own logits must be used: the
    forward has no `logits_to_keep` (older remote code) or the layer is not a plain local `nn.Linear`."""
    base = plain.get_base_model() if hasattr(plain, "get_base_model") else plain
    if "logits_to_keep" not in inspect.signature(base.forward).parameters:
        return None
    return plain_output_layer(base)
