"""LoRA and partial training: where adapters go, and that only they train."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tuneforge.config.schema import LoraSettings, ModelConfig
from tuneforge.engines.single import SingleEngine
from tuneforge.errors import UserError
from tuneforge.model.adapters import resolve_lora_targets
from tuneforge.model.moe import find_moe
from tuneforge.model.trainable import make_trainable

from conftest import (
    REPO,
    accumulate,
    chat,
    rows_batch,
    tiny_deepseek_v2,
    tiny_llama,
    tiny_mixtral,
    tokenized,
    trainable,
)


def lora_model_config(**lora) -> ModelConfig:
    return ModelConfig(architecture="llama", tokenizer="bytes", lora=LoraSettings(**lora))


def train_steps(model, tokenizer, steps: int = 3) -> None:
    data = tokenized(tokenizer, [chat(f"question {i}", f"answer {i * 3}") for i in range(4)])
    batch = rows_batch(data, [0, 1, 2, 3], tokenizer.pad_token_id)
    engine = SingleEngine(model, lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad]))
    for _ in range(steps):
        accumulate(engine, [batch], "fp32")
        engine.step(1e-2, 1.0)


@pytest.mark.parametrize("build", [tiny_llama, tiny_deepseek_v2], ids=["llama", "deepseek_v2"])
def test_only_adapters_change_and_the_base_stays_bitwise_frozen(tokenizer, build):
    model, notes = trainable(build(tokenizer), lora_model_config(r=4, alpha=8, dropout=0.0), False)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    train_steps(model, tokenizer)
    adapters = [name for name in before if "lora_" in name]
    assert adapters and "lora: r=4 alpha=8" in notes[-1]
    for name, param in model.named_parameters():
        if "lora_" in name:
            assert not torch.equal(param, before[name]), f"adapter {name} did not train"
        else:
            assert torch.equal(param, before[name]), f"base weight {name} changed"


def test_all_linear_leaves_out_head_routers_and_routed_experts(tokenizer):
    model = tiny_deepseek_v2(tokenizer)
    targets = resolve_lora_targets(model, LoraSettings(), find_moe(model))
    assert "lm_head" not in targets.modules
    assert not any(".experts" in name or "gate.weight" in name for name in targets.modules)
    kinds = {name.rsplit(".", 1)[-1] for name in targets.modules}
    # MLA attention, the dense first layer's MLP and the shared experts all get adapters.
    assert {"q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= kinds
    assert any("shared_experts" in name for name in targets.modules)
    assert targets.parameters == [] and targets.skipped_experts == 2  # gate_up_proj and down_proj, stacked
    assert "routed-expert weights left out" in targets.describe()


@pytest.mark.parametrize("build", [tiny_deepseek_v2, tiny_mixtral], ids=["deepseek_v2", "mixtral"])
def test_the_peft_model_has_no_expert_adapters_unless_asked(tokenizer, build):
    """PEFT retargets `*.down_proj` onto fused experts for transformers-5 MoE models; `experts: false` must hold
    in the model PEFT builds, not only in the targets we resolve."""
    model, _ = trainable(build(tokenizer), lora_model_config(dropout=0.1), False)
    adapted = [name for name, p in model.named_parameters() if p.requires_grad]
    assert adapted and not any(".experts." in name for name in adapted), adapted
    assert model.base_model.model.config.model_type == build(tokenizer).config.model_type  # restored
    model, _ = trainable(build(tokenizer), lora_model_config(dropout=0.0, experts=True), False)
    assert any(".experts." in name for name, p in model.named_parameters() if p.requires_grad)


def test_explicit_names_and_regex_targets(tokenizer):
    model = tiny_llama(tokenizer)
    names = resolve_lora_targets(model, LoraSettings(targets=["q_proj", "v_proj"]), find_moe(model))
    assert sorted(n.rsplit(".", 1)[-1] for n in names.modules) == ["q_proj", "q_proj", "v_proj", "v_proj"]
    regex = resolve_lora_targets(model, LoraSettings(targets=r"model\.layers\.1\..*_proj"), find_moe(model))
    assert regex.modules and all(n.startswith("model.layers.1.") for n in regex.modules)
    with pytest.raises(UserError, match="matches no linear layer"):
        resolve_lora_targets(model, LoraSettings(targets=["lm_head"]), find_moe(model))


def test_lora_on_stacked_experts_trains_when_switched_on(tokenizer):
    model = tiny_deepseek_v2(tokenizer)
    settings = {"r": 4, "alpha": 8, "dropout": 0.0, "experts": True}
    model, notes = make_trainable(model, lora_model_config(**settings), False, find_moe(model))
    assert "experts.gate_up_proj x1" in notes[-1] and "experts.down_proj x1" in notes[-1]
    expert_adapters = {n: p.detach().clone() for n, p in model.named_parameters() if "experts" in n and "lora" in n}
    assert expert_adapters
    train_steps(model, tokenizer)
    changed = [
        n for n, p in model.named_parameters() if n in expert_adapters and not torch.equal(p, expert_adapters[n])
    ]
    assert changed == list(expert_adapters)


def test_lora_on_expert_lists_is_opt_in(tokenizer):
    spec = importlib.util.spec_from_file_location("legacy", REPO / "tests" / "assets" / "modeling_legacy_moe.py")
    legacy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(legacy)
    config = legacy.LegacyMoEConfig(vocab_size=len(tokenizer), num_experts=4, experts_per_token=1)
    model = legacy.LegacyMoEForCausalLM(config)
    off = resolve_lora_targets(model, LoraSettings(), find_moe(model))
    on = resolve_lora_targets(model, LoraSettings(experts=True), find_moe(model))
    assert not any(".experts." in n for n in off.modules) and off.skipped_experts > 0
    assert len([n for n in on.modules if ".experts." in n]) == off.skipped_experts


def test_freeze_patterns_keep_matching_weights_and_train_the_rest(tokenizer):
    cfg = ModelConfig(architecture="llama", tokenizer="bytes", freeze=["embed_tokens", r"layers\.0\."])
    model, notes = trainable(tiny_llama(tokenizer), cfg, False)
    assert notes == ["freeze: 10 parameter tensors frozen by model.freeze"]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    train_steps(model, tokenizer)
    for name, param in model.named_parameters():
        frozen = "embed_tokens" in name or "layers.0." in name
        assert torch.equal(param, before[name]) == frozen, name


def test_freeze_that_matches_nothing_is_a_clear_error(tokenizer):
    cfg = ModelConfig(architecture="llama", tokenizer="bytes", freeze=["embeddings"])
    with pytest.raises(UserError, match="matches no parameter name"):
        trainable(tiny_llama(tokenizer), cfg, False)


def test_gradient_checkpointing_gives_the_same_gradients(tokenizer):
    data = tokenized(tokenizer, [chat("hello", "world"), chat("a longer question", "and its answer")])
    batch = rows_batch(data, [0, 1], tokenizer.pad_token_id)
    grads = []
    for checkpointing in (False, True):
        model, _ = trainable(tiny_llama(tokenizer), lora_model_config(dropout=0.0), checkpointing)
        model.train()
        accumulate(SingleEngine(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.0)), [batch], "fp32")
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_dora_and_rslora_switches_reach_peft(tokenizer):
    model, _ = trainable(tiny_llama(tokenizer), lora_model_config(r=4, alpha=8, use_dora=True), False)
    assert any("lora_magnitude_vector" in name for name, _ in model.named_parameters())
    model, _ = trainable(tiny_llama(tokenizer), lora_model_config(r=4, alpha=8, use_rslora=True), False)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q_proj.scaling["default"] == pytest.approx(8 / 2)  # alpha / sqrt(r), not alpha / r
