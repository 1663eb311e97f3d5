"""Adapters on stacked routed experts computed as grouped low-rank products equal PEFT's own W + B·A form,
without ever running the experts on a full-size adapted weight, and they take input dropout."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tuneforge.errors import UserError
from tuneforge.model.moe import find_moe
from tuneforge.train.checkpoint import write_model_files

from conftest import tiny_deepseek_v2, tiny_mixtral, tiny_qwen3_moe, trained_lora

BUILDERS = {"deepseek_v2": tiny_deepseek_v2, "mixtral": tiny_mixtral, "qwen3_moe": tiny_qwen3_moe}


def adapted(build, tokenizer, **lora):
    """The tiny model with adapters on everything, experts included, and non-zero B factors; also the number
    of times its experts modules themselves ran (PEFT's form runs them on W + B·A)."""
    base = build(tokenizer).float()
    calls = []
    for block in find_moe(base):
        base.get_submodule(block.experts_path).register_forward_pre_hook(lambda *_: calls.append(1))
    model, notes = trained_lora(base, factors="lora_", experts=True, **lora)
    return model, notes[-1], calls


def forward_backward(model, ids):
    logits = model(input_ids=ids).logits
    logits.pow(2).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return logits.detach(), grads


@pytest.mark.parametrize(("arch", "rank"), [("deepseek_v2", 4), ("deepseek_v2", 3), ("mixtral", 4), ("qwen3_moe", 8)])
def test_grouped_expert_adapters_equal_peft_form_forward_and_backward(tokenizer, arch, rank):
    """Rank 3 leaves grouped_mm's 16-byte stride rule unmet, so the per-expert fallback runs."""
    ids = torch.randint(3, len(tokenizer), (2, 19), generator=torch.Generator().manual_seed(2))
    grouped, note, grouped_calls = adapted(BUILDERS[arch], tokenizer, r=rank)
    peft_form, peft_note, peft_calls = adapted(BUILDERS[arch], tokenizer, r=rank, grouped_experts=False)
    assert note.endswith("; stacked experts as grouped low-rank products")
    assert "in PEFT's full-size W + B·A form" in peft_note and "grouped_experts is false" in peft_note

    logits, grads = forward_backward(grouped, ids)
    expected, expected_grads = forward_backward(peft_form, ids)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert grads.keys() == expected_grads.keys() and any(".experts." in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    # The grouped form never runs the experts module on an adapted full-size weight; PEFT's form always does.
    assert grouped_calls == [] and len(peft_calls) > 0


def test_expert_adapters_take_dropout_and_peft_loads_the_saved_file(tokenizer, tmp_path):
    base = tiny_mixtral(tokenizer).float()
    base.save_pretrained(tmp_path / "base")
    # Only the stacked experts adapted, so any dropout seen comes from their low-rank branch.
    targets = r".*\.experts\.(gate_up_proj|down_proj)"
    model, note, _ = adapted(tiny_mixtral, tokenizer, dropout=0.5, targets=targets)
    assert "experts.gate_up_proj x2" in note and "dropout=0.5" in note
    ids = torch.randint(3, len(tokenizer), (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.train()
        first, second = model(input_ids=ids).logits, model(input_ids=ids).logits
        assert not torch.allclose(first, second)
        trained = model.eval()(input_ids=ids).logits

    note = write_model_files(model, tokenizer, tmp_path / "adapter", {})
    assert "lora_dropout 0" in note
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["lora_dropout"] == 0.0 and len(config["target_parameters"]) == 4
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    with torch.no_grad():
        loaded = PeftModel.from_pretrained(plain, tmp_path / "adapter").eval()
        torch.testing.assert_close(loaded(input_ids=ids).logits, trained, atol=1e-5, rtol=1e-5)


def test_dropout_on_experts_in_peft_form_is_refused_with_the_fix(tokenizer):
    with pytest.raises(UserError, match=r"model\.lora\.dropout: 0\.1 cannot apply .*model\.layers\.0\.mlp\.experts"):
        adapted(tiny_mixtral, tokenizer, dropout=0.1, grouped_experts=False)
