"""Run by `test_policy_weights.py` under PyTorch's elastic launcher on 2 ranks: the report's set-up (DeepSeek-V2,
4-bit linear layers and experts, adapters on the experts) held by ZeRO-3 with offload, then by FSDP2; each rank
streams the policy's weights through the engine's `whole` and must get, tensor for tensor, what one process
streams from the same model unsharded. Writes `ok-RANK` into the directory given."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from test_policy_weights import policy
from tuneforge.config.schema import ParallelConfig, TrainConfig
from tuneforge.data.byte_tokenizer import build_byte_tokenizer
from tuneforge.distributed import init_distributed
from tuneforge.engines import EngineChoice
from tuneforge.model.moe import find_moe
from tuneforge.policy_weights import policy_weights


def main(directory: Path) -> None:
    info = init_distributed()
    engines = {
        "zero3_offload": ParallelConfig(engine="deepspeed", zero_stage=3, cpu_offload="all"),
        "fsdp": ParallelConfig(engine="fsdp"),
    }
    for name, parallel in engines.items():
        model = policy(directory / name, build_byte_tokenizer(), "report-qlora-experts", True, info)
        expected = {key: tensor.clone() for key, tensor in policy_weights(model, torch.float32)}
        train = TrainConfig(precision="fp32")
        choice = EngineChoice.choose(info, parallel, train)
        moe = find_moe(model.get_base_model())
        engine = choice.build(model, lambda m: torch.optim.AdamW(m.parameters(), lr=0.0), info, parallel, train, moe)
        assert engine.sharded, name
        streamed = dict(policy_weights(engine.unwrapped, torch.float32, engine.whole))
        assert streamed.keys() == expected.keys(), (name, sorted(streamed.keys() ^ expected.keys())[:5])
        for key, tensor in expected.items():
            got = streamed[key]
            assert got.shape == tensor.shape, (name, key, got.shape, tensor.shape)
            assert torch.allclose(got, tensor, atol=1e-6, rtol=1e-6), (name, key, float((got - tensor).abs().max()))
    (directory / f"ok-{info.rank}").write_text("ok")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
