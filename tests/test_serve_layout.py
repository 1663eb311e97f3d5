"""`tuneforge export --for vllm|sglang`: adapters on stacked experts written one pair per expert and projection
for the server classes that read that layout, every key checked against the layout's rules, the update each
expert gets unchanged, and what a server cannot load refused with the merged export offered."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tuneforge.errors import UserError
from tuneforge.serve_layout import export_for_server
from tuneforge.train.checkpoint import write_model_files

from conftest import tiny_deepseek_v2, tiny_llama, tiny_qwen3_moe, trained_lora

PER_EXPERT_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.lora_([AB])\.weight"
)


def trained_adapter(build, tokenizer, directory: Path, experts: bool = True, **lora) -> tuple[Path, Path, object]:
    """A base saved to `directory/base` and a LoRA adapter on it (random B: a trained one) as training saves it."""
    base = build(tokenizer).float()
    base.save_pretrained(directory / "base")
    tokenizer.save_pretrained(directory / "base")
    model, _ = trained_lora(base, experts=experts, **lora)
    checkpoint = directory / "adapter"
    meta = {"template": "deepseek_coder", "system": None, "adapter": {"dtype": "float32", "trust_remote_code": False}}
    write_model_files(model, tokenizer, checkpoint, meta)
    return checkpoint, directory / "base", model.eval()


def check_layout(weights: dict, layers: set[int], experts: int, rank: int, hidden: int, width: int) -> None:
    """Every MoE layer has every expert, each projection one (r, in) A and one (out, r) B, nothing stacked."""
    seen = set()
    for key, tensor in weights.items():
        assert ".base_layer." not in key and not key.endswith(("experts.lora_A.weight", "experts.lora_B.weight")), key
        if (match := PER_EXPERT_KEY.fullmatch(key)) is None:
            continue
        layer, expert, projection, factor = match.groups()
        seen.add((int(layer), int(expert), projection, factor))
        inputs, outputs = (width, hidden) if projection == "down" else (hidden, width)
        assert tuple(tensor.shape) == ((rank, inputs) if factor == "A" else (outputs, rank)), key
    expected = {(lay, e, p, f) for lay in layers for e in range(experts) for p in ("gate", "up", "down") for f in "AB"}
    assert seen == expected


def test_qwen3_moe_experts_load_in_peft_from_the_per_expert_layout(tokenizer, tmp_path):
    """The layout vLLM's Qwen3-MoE class reads is also the one PEFT reads for transformers' old MoE layout: PEFT's
    own loader takes the written adapter onto today's fused experts and gives the trained logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    checkpoint, base, trained = trained_adapter(tiny_qwen3_moe, tokenizer, tmp_path)
    lines = export_for_server(checkpoint, tmp_path / "vllm", "vllm", base)
    assert lines[0].startswith("exported adapter for vllm: ") and "one lora_A/lora_B pair per expert" in lines[0]
    # vLLM takes only some ranks for --max-lora-rank: the adapter's 4 is served under 8.
    assert lines[1].startswith(f"serve: vllm serve {base.resolve()} --enable-lora --max-lora-rank 8 --lora-modules ")
    config = json.loads((tmp_path / "vllm" / "adapter_config.json").read_text())
    assert "target_parameters" not in config and {"gate_proj", "up_proj", "down_proj"} <= set(config["target_modules"])
    weights = load_file(tmp_path / "vllm" / "adapter_model.safetensors")
    check_layout(weights, {0, 1}, experts=4, rank=4, hidden=32, width=32)
    ids = torch.randint(3, len(tokenizer), (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        loaded = PeftModel.from_pretrained(plain, tmp_path / "vllm").eval()
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_deepseek_v2_experts_get_the_same_update_per_expert(tokenizer, tmp_path):
    """DeepSeek-V2's dense MLP and shared experts keep their module names; each routed expert's written pair
    computes the update the stacked adapter computed for it (B·A, gate and up split by rows)."""
    checkpoint, base, trained = trained_adapter(tiny_deepseek_v2, tokenizer, tmp_path)
    export_for_server(checkpoint, tmp_path / "sglang", "sglang", base)
    weights = load_file(tmp_path / "sglang" / "adapter_model.safetensors")
    check_layout(weights, {1}, experts=4, rank=4, hidden=32, width=16)
    config = json.loads((tmp_path / "sglang" / "adapter_config.json").read_text())
    assert "target_parameters" not in config
    assert any(key.endswith("layers.0.mlp.gate_proj.lora_A.weight") for key in weights)
    assert any(key.endswith("layers.1.mlp.shared_experts.down_proj.lora_B.weight") for key in weights)
    experts = trained.get_submodule("base_model.model.model.layers.1.mlp.experts")
    wrappers = {m.parameter_name: m for m in [experts, *experts.modules()] if hasattr(m, "parameter_name")}
    scaling = 8 / 4
    for name, wrapper in wrappers.items():
        delta = wrapper.get_delta_weight("default")  # (experts, out, in), as the weight is stored
        for expert in range(4):
            prefix = f"base_model.model.model.layers.1.mlp.experts.{expert}"
            if name == "gate_up_proj":
                parts = [
                    weights[f"{prefix}.{p}.lora_B.weight"] @ weights[f"{prefix}.{p}.lora_A.weight"]
                    for p in ("gate_proj", "up_proj")
                ]
                written = torch.cat(parts) * scaling
            else:
                written = (
                    weights[f"{prefix}.down_proj.lora_B.weight"]
                    @ weights[f"{prefix}.down_proj.lora_A.weight"]
                    * scaling
                )
            torch.testing.assert_close(written, delta[expert], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("lora", "refusal"),
    [
        ({"r": 4, "use_dora": True}, "serves no DoRA adapters"),
        ({"r": 600}, "rank 600 is above vllm's limit of 512"),
        ({"r": 4, "modules_to_save": ["lm_head"]}, "layers trained in full (lm_head) are not adapters"),
    ],
)
def test_what_the_server_cannot_load_is_refused_with_the_merged_export_offered(lora, refusal, tokenizer, tmp_path):
    checkpoint, base, _ = trained_adapter(tiny_llama, tokenizer, tmp_path, experts=False, **lora)
    with pytest.raises(UserError, match=rf"{re.escape(refusal)}; use export --merge"):
        export_for_server(checkpoint, tmp_path / "out", "vllm", base)
    assert not (tmp_path / "out").exists()


def test_a_full_checkpoint_is_served_as_it_is(tokenizer, tmp_path):
    tiny_llama(tokenizer).save_pretrained(tmp_path / "full")
    with pytest.raises(UserError, match="is a full model, which vllm serves as it is"):
        export_for_server(tmp_path / "full", tmp_path / "out", "vllm")


def test_a_layer_whose_own_rank_is_above_the_limit_is_refused(tokenizer, tmp_path):
    checkpoint, base, _ = trained_adapter(tiny_llama, tokenizer, tmp_path, experts=False)
    config_path = checkpoint / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "rank_pattern": {"q_proj": 1024}}))
    with pytest.raises(UserError, match=r"a layer's rank is above vllm's limit of 512; use export --merge"):
        export_for_server(checkpoint, tmp_path / "out", "vllm", base)


def _base_of_type(base: Path, model_type: str, directory: Path) -> Path:
    """`base`'s files with the config of another MoE class: which layout is written follows the class alone."""
    from transformers import AutoConfig

    directory.mkdir()
    for path in base.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    AutoConfig.for_model(model_type).save_pretrained(directory)
    return directory


def test_classes_that_read_fused_experts_get_the_stacked_adapter_as_trained(tokenizer, tmp_path):
    """The weights and the stacked experts' `target_parameters` as trained: PEFT's loader puts the written adapter
    on the experts again and gives the trained logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    checkpoint, base, trained = trained_adapter(tiny_qwen3_moe, tokenizer, tmp_path)
    fused = _base_of_type(base, "qwen3_5_moe", tmp_path / "fused")
    lines = export_for_server(checkpoint, tmp_path / "out", "vllm", fused)
    assert "(qwen3_5_moe, experts in PEFT's stacked layout; rank 4)" in lines[0]
    weights = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert weights.keys() == load_file(checkpoint / "adapter_model.safetensors").keys()
    written = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert any(".experts." in name for name in written["target_parameters"])
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "out").eval()
    ids = torch.randint(3, len(tokenizer), (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, trained(input_ids=ids).logits, atol=1e-5, rtol=1e-4)


def test_an_moe_class_whose_expert_layout_is_not_known_is_refused(tokenizer, tmp_path):
    checkpoint, base, _ = trained_adapter(tiny_qwen3_moe, tokenizer, tmp_path)
    unknown = _base_of_type(base, "olmoe", tmp_path / "olmoe")
    with pytest.raises(UserError, match=r"which expert layout vllm's olmoe class reads is not known to tuneforge"):
        export_for_server(checkpoint, tmp_path / "out", "vllm", unknown)
    assert not (tmp_path / "out").exists()
