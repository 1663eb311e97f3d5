"""The optimizer: fused AdamW where every trainable tensor allows it, with the multi-tensor path's results."""

from __future__ import annotations

import torch

from tuneforge.config.schema import TrainConfig
from tuneforge.train.optim import build_optimizer


def test_fused_adamw_on_cpu_steps_like_the_multi_tensor_path():
    torch.manual_seed(0)
    models = [torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)]
    models[1].load_state_dict(models[0].state_dict())
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1)
    fused = build_optimizer(models[0], cfg)
    assert fused.defaults["fused"] is True
    reference = torch.optim.AdamW(
        [{"params": [models[1].weight], "weight_decay": 0.1}, {"params": [models[1].bias], "weight_decay": 0.0}],
        lr=1e-2,
        foreach=True,
    )
    for _ in range(3):
        batch = torch.randn(4, 16)
        for model, optimizer in zip(models, (fused, reference), strict=True):
            optimizer.zero_grad()
            model(batch).square().sum().backward()
            optimizer.step()
    for mine, theirs in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-5)
