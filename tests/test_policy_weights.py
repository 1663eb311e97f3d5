"""The live policy's weights streamed as a checkpoint holds them (what vLLM is refreshed with before a rollout):
written as safetensors beside the base's config, transformers' own loader builds a model that computes the
policy's logits, in the report's set-up too (4-bit linear layers and experts, adapters on the experts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from tuneforge.config.schema import LoraSettings, ModelConfig, QuantizationConfig
from tuneforge.model.build import build_model
from tuneforge.model.moe import find_moe
from tuneforge.model.trainable import make_trainable
from tuneforge.policy_weights import policy_weights

from conftest import TINY_DEEPSEEK_V2, free_port

LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
DEEPSEEK_V2 = {**TINY_DEEPSEEK_V2, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32}
QLORA = {"bits": 4, "quant_type": "nf4", "double_quant": True, "compute_dtype": "float32"}
CASES = {
    "full": ("llama", LLAMA, None, None),
    "lora": ("llama", LLAMA, {"r": 4, "alpha": 8, "dropout": 0.0}, None),
    "qlora": ("llama", LLAMA, {"r": 4, "alpha": 8, "dropout": 0.0}, QLORA),
    "report-qlora-experts": (
        "deepseek_v2",
        DEEPSEEK_V2,
        {"r": 4, "alpha": 8, "dropout": 0.0, "experts": True},
        # bitsandbytes' CPU kernels take output sizes in multiples of 32: MLA's 24-wide projection stays unquantized.
        {**QLORA, "skip_modules": ["kv_a_proj_with_mqa"]},
    ),
}


def policy(tmp_path, tokenizer, case: str, sharded_engine: bool = False, info=None):
    architecture, size, lora, quantization = CASES[case]
    cfg = ModelConfig(
        architecture=architecture,
        tokenizer="bytes",
        size={**size, "initializer_range": 0.2},
        lora=LoraSettings(**lora) if lora else None,
        quantization=QuantizationConfig(**quantization) if quantization else None,
    )
    model = build_model(cfg, tokenizer, seed=0, base_dir=tmp_path / "base", sharded_engine=sharded_engine, info=info)
    model, _ = make_trainable(model, cfg, False, find_moe(model))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # adapters as trained ones: B away from zero
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_the_streamed_weights_load_in_transformers_as_the_policy_computes(tmp_path, tokenizer, case):
    model = policy(tmp_path, tokenizer, case)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    frozen = {name: param.detach().clone() for name, param in model.named_parameters()}
    streamed = dict(policy_weights(model, torch.float32))
    # The model itself is only read: nothing merged in place, nothing requantized.
    assert all(torch.equal(param, frozen[name]) for name, param in model.named_parameters())
    assert not any("lora" in name or "base_layer" in name for name in streamed)
    if case.startswith("report"):  # fused in memory, one tensor per expert as checkpoints name them
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in streamed
    assert {t.dtype for t in streamed.values()} == {torch.float32}

    directory = tmp_path / "streamed"
    config = AutoConfig.from_pretrained(tmp_path / "base") if (tmp_path / "base").exists() else base.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(directory)
    save_file({name: t.contiguous() for name, t in streamed.items()}, directory / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.randint(3, len(tokenizer), (2, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_sharded_weights_stream_whole_on_every_rank(tmp_path):
    """ZeRO-3 with offload and FSDP2 on 2 ranks, the report's set-up: gathered a unit at a time through the
    engine's `whole`, each rank streams exactly what one process streams unsharded (without the gathering a
    rank reads its empty shards; without the copies, tensors released with their unit)."""
    tests = Path(__file__).parent
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}"]
    command += [str(tests / "sharded_weights_worker.py"), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert (tmp_path / "ok-0").exists() and (tmp_path / "ok-1").exists()
