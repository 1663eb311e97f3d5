"""Adapters load where users load them: PEFT's own `PeftModel.from_pretrained` on the plain base model gives
the logits tuneforge trained, for adapters on linear layers, on stacked experts and on expert lists."""

from __future__ import annotations

import json
import shutil

import peft
import pytest
import torch
from packaging.version import Version
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tuneforge.config.schema import LoraSettings, ModelConfig
from tuneforge.model.moe import find_moe
from tuneforge.model.trainable import make_trainable
from tuneforge.train.checkpoint import write_model_files
from tuneforge.trained import load_trained

from conftest import REPO, tiny_deepseek_v2, tiny_llama, tiny_qwen3_moe, trainable

LEGACY = REPO / "tests" / "assets" / "modeling_legacy_moe.py"


def legacy_list_experts(tokenizer):
    """A remote-code MoE whose experts are a list of modules with linear layers (DeepSeek's remote layout)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("modeling_legacy_moe", LEGACY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    config = module.LegacyMoEConfig(vocab_size=len(tokenizer), num_experts=4, experts_per_token=2)
    config.auto_map = {
        "AutoConfig": "modeling_legacy_moe.LegacyMoEConfig",
        "AutoModelForCausalLM": "modeling_legacy_moe.LegacyMoEForCausalLM",
    }
    return module.LegacyMoEForCausalLM(config)


PEFT_READS_MODULES = Version(peft.__version__) >= Version("0.22")
"""PEFT 0.22's loader rewrites an adapter's targets from the base model's modules, no longer from names alone."""

CASES = {
    "llama-linear": (tiny_llama, False),
    "deepseek_v2-linear": (tiny_deepseek_v2, False),  # dense MLP and shared experts named like old experts
    "deepseek_v2-stacked-experts": (tiny_deepseek_v2, True),
    "qwen3_moe-stacked-experts": (tiny_qwen3_moe, True),
    "legacy-list-experts": (legacy_list_experts, True),
}


# One form in the fast tier; the other four save, reload through PEFT and compare the trained logits in the slow one.
@pytest.mark.parametrize("case", [c if c == "llama-linear" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_peft_loads_the_saved_adapter_with_the_trained_logits(tokenizer, tmp_path, case):
    build, experts = CASES[case]
    base = build(tokenizer).float()
    remote = case.startswith("legacy")
    base.save_pretrained(tmp_path / "base")
    if remote:
        shutil.copy(LEGACY, tmp_path / "base" / LEGACY.name)
    settings = LoraSettings(r=4, alpha=8, dropout=0.0, experts=experts)
    model, _ = make_trainable(
        base, ModelConfig(architecture="llama", tokenizer="bytes", lora=settings), False, find_moe(base)
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a trained adapter, not the no-op PEFT starts from
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    adapted = [n for n, _ in model.named_parameters() if "lora_A" in n]
    assert any(".experts." in n for n in adapted) == experts
    meta = {"adapter": {"dtype": "float32", "trust_remote_code": remote, "quantization": None}}
    write_model_files(model, tokenizer, tmp_path / "adapter", meta)
    ids = torch.randint(3, len(tokenizer), (2, 11), generator=generator)
    with torch.no_grad():
        trained = model.eval()(input_ids=ids).logits

        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32, trust_remote_code=remote)
        loaded = PeftModel.from_pretrained(plain, tmp_path / "adapter").eval()
        torch.testing.assert_close(loaded(input_ids=ids).logits, trained, atol=1e-5, rtol=1e-5)
        ours = load_trained(tmp_path / "adapter", tmp_path / "base", trust_remote_code=remote).model
        torch.testing.assert_close(ours(input_ids=ids).logits, trained, atol=1e-5, rtol=1e-5)
        # tuneforge's loader runs adapters on stacked experts as in training: grouped low-rank products.
        grouped = {type(m).__module__ for n, m in ours.named_modules() if n.endswith(".experts")}
        assert (grouped == {"tuneforge.model.expert_lora"}) == case.endswith("stacked-experts")
        merged = load_trained(tmp_path / "adapter", tmp_path / "base", merge=True, trust_remote_code=remote).model
        torch.testing.assert_close(merged(input_ids=ids).logits, trained, atol=1e-4, rtol=1e-4)

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    moved = [name for name in config.get("target_parameters") or [] if name.endswith(".weight")]
    # Only where PEFT's loader would misread module names are linear layers listed by their weight (PEFT 0.22 reads
    # the base's modules and keeps linear targets as they are).
    assert bool(moved) == (case.startswith("deepseek_v2") and not PEFT_READS_MODULES)


def test_dora_adapters_peft_would_misread_are_left_as_trained_with_a_warning(tokenizer, tmp_path):
    settings = LoraSettings(r=4, alpha=8, dropout=0.0, use_dora=True)
    model, _ = trainable(
        tiny_deepseek_v2(tokenizer), ModelConfig(architecture="llama", tokenizer="bytes", lora=settings), False
    )
    note = write_model_files(model, tokenizer, tmp_path, {})
    if not PEFT_READS_MODULES:
        assert note.startswith("warning: PEFT's own loader misreads the DoRA adapters on model.layers.0.mlp.")
    else:  # PEFT 0.22 keeps targets that are linear layers in the base: it loads them as trained, nothing to say
        assert note == ""
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert not config.get("target_parameters") and any(
        name.endswith("shared_experts.up_proj") for name in config["target_modules"]
    )
