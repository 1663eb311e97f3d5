"""4-bit stacked routed experts: stored in bitsandbytes' 4-bit format, read as their dequantized values by
transformers' code, PEFT and tuneforge's grouped adapters alike, and never kept dequantized for backward."""

from __future__ import annotations

import pytest
import torch
from bitsandbytes.nn import Params4bit
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tuneforge.config.schema import LoraSettings, ModelConfig, QuantizationConfig
from tuneforge.errors import UserError
from tuneforge.model.expert_lora import grouped_experts_forward
from tuneforge.model.moe import find_moe
from tuneforge.model.quantize import quantized_linears
from tuneforge.model.quantized_experts import (
    EXPERTS_IMPLEMENTATION,
    dequantize_stacked_experts,
    quantize_stacked_experts,
    quantized_experts_count,
    stacked_numel,
)
from tuneforge.model.stacked_experts import compute_dtype, stacked_weight_names
from tuneforge.model.trainable import make_trainable
from tuneforge.train.checkpoint import write_model_files

from conftest import tiny_deepseek_v2, tiny_mixtral, tiny_qwen3_moe

BUILDERS = {"deepseek_v2": tiny_deepseek_v2, "mixtral": tiny_mixtral, "qwen3_moe": tiny_qwen3_moe}
SETTINGS = QuantizationConfig(bits=4, quant_type="nf4", double_quant=True, compute_dtype="float32")


def experts_modules(model):
    return [model.get_submodule(block.experts_path) for block in find_moe(model)]


def quantized(build, tokenizer, storage=torch.float32):
    """The tiny model with its stacked experts in 4 bits, and a plain copy whose expert weights hold the
    dequantized values (what the quantized model must compute with)."""
    model = build(tokenizer).float()
    full = {id(e): {n: getattr(e, n).detach().clone() for n in stacked_weight_names(e)} for e in experts_modules(model)}
    originals = list(full.values())
    assert quantize_stacked_experts(model, SETTINGS, storage) == len(originals) > 0
    # Built again rather than copied: removing a parametrization from a deep copy also removes it from the class
    # the copy shares with the original.
    reference = build(tokenizer).float()
    quantize_stacked_experts(reference, SETTINGS, storage)
    assert dequantize_stacked_experts(reference) == 2 * len(originals)
    reference.set_experts_implementation("grouped_mm")
    return model, reference, originals


@pytest.mark.parametrize("arch", BUILDERS)
def test_stacked_experts_are_stored_in_4_bits_and_compute_with_their_dequantized_values(tokenizer, arch):
    model, reference, originals = quantized(BUILDERS[arch], tokenizer)
    assert model.config._experts_implementation == EXPERTS_IMPLEMENTATION
    assert quantized_experts_count(model) == len(originals) and quantized_experts_count(reference) == 0
    for experts, ref, original in zip(experts_modules(model), experts_modules(reference), originals, strict=True):
        for name, weight in original.items():
            stored = experts.parametrizations[name].original
            assert isinstance(stored, Params4bit) and not stored.requires_grad
            # Two 4-bit values per byte, here in float32 storage: 1/8 of the float32 weight, plus constants.
            assert stored.numel() * stored.element_size() == weight.numel() // 2
            values = getattr(ref, name)
            assert values.shape == weight.shape and values.dtype == torch.float32
            assert torch.equal(getattr(experts, name), values)
            # NF4: close to the original, not equal to it.
            assert 0 < (values - weight).abs().max() < 0.25 * weight.abs().max()
    # The MoE map sees the stacked weights under their own names and full shapes.
    assert find_moe(model).summary() == find_moe(reference).summary()
    ids = torch.randint(3, len(tokenizer), (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def set_adapters(model) -> None:
    """Non-zero adapter weights, the same for every model with the same adapter names and shapes."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))


def saved_sizes(run) -> list[int]:
    """Sizes of the tensors autograd keeps for backward while `run()` computes."""
    sizes = []

    def pack(tensor):
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    return sizes, out


def test_backward_dequantizes_again_instead_of_keeping_the_full_weight(tokenizer):
    """Reading a 4-bit weight dequantizes it; a plain matmul would keep that full-size copy until backward, as
    large as the unquantized experts. The experts' input gradients still equal the dequantized model's."""
    model, reference, _ = quantized(tiny_qwen3_moe, tokenizer)
    experts, ref = experts_modules(model)[0], experts_modules(reference)[0]
    weight_sizes = {getattr(ref, name).numel() for name in stacked_weight_names(ref)}
    tokens, hidden = 23, ref.down_proj.shape[1]
    generator = torch.Generator().manual_seed(3)
    states = torch.randn(tokens, hidden, generator=generator)
    top_k_index = torch.randint(0, experts.num_experts, (tokens, 2), generator=generator)
    top_k_weights = torch.rand(tokens, 2, generator=generator)

    def run(module):
        x = states.clone().requires_grad_(True)
        return saved_sizes(lambda: (x, module(x, top_k_index, top_k_weights)))

    sizes, (x, out) = run(experts)
    ref_sizes, (ref_x, ref_out) = run(ref)
    assert not weight_sizes & set(sizes)
    assert weight_sizes & set(ref_sizes)  # the unquantized model keeps its (parameter) weights, as it should
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    out.pow(2).sum().backward()
    ref_out.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["deepseek_v2", "mixtral"])
def test_grouped_adapters_on_4bit_experts_equal_adapters_on_the_dequantized_experts(tokenizer, arch):
    """The report's set-up in one process: adapters on 4-bit routed experts train exactly like adapters on
    plain experts holding the dequantized values (logits and every adapter gradient)."""
    model, reference, _ = quantized(BUILDERS[arch], tokenizer)
    settings = LoraSettings(r=4, alpha=8, dropout=0.0, experts=True)
    cfg = ModelConfig(architecture="llama", tokenizer="bytes", lora=settings)
    results = []
    for base in (model, reference):
        peft_model, notes = make_trainable(base, cfg, False, find_moe(base))
        assert notes[-1].endswith("; stacked experts as grouped low-rank products")
        set_adapters(peft_model)
        ids = torch.randint(3, len(tokenizer), (2, 19), generator=torch.Generator().manual_seed(2))
        logits = peft_model(input_ids=ids).logits
        logits.pow(2).mean().backward()
        grads = {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
        results.append((logits.detach(), grads))
    (logits, grads), (expected, expected_grads) = results
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert grads.keys() == expected_grads.keys() and any(".experts." in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_activation_checkpointing_recomputes_4bit_experts_to_the_same_gradients(tokenizer):
    """The report's set-up checkpoints activations (xtuner's default): the recompute dequantizes the experts
    again inside the checkpointed layer, and every adapter gradient stays the same."""
    settings = LoraSettings(r=4, alpha=8, dropout=0.0, experts=True)
    cfg = ModelConfig(architecture="llama", tokenizer="bytes", lora=settings)
    ids = torch.randint(3, len(tokenizer), (2, 19), generator=torch.Generator().manual_seed(2))
    grads, dequantized = [], []
    for checkpointing in (False, True):
        model, _, _ = quantized(tiny_deepseek_v2, tokenizer)
        calls = []
        for experts in experts_modules(model):
            for name in stacked_weight_names(experts):
                experts.parametrizations[name][0].register_forward_hook(lambda *_, seen=calls: seen.append(1))
        peft_model, _ = make_trainable(model, cfg, checkpointing, find_moe(model))
        set_adapters(peft_model)
        peft_model.train()(input_ids=ids).logits.pow(2).mean().backward()
        grads.append({n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad})
        dequantized.append(len(calls))
    # Each stacked weight: forward and backward, plus the recompute when checkpointed.
    assert dequantized == [4, 6]
    assert grads[0].keys() == grads[1].keys() and any(".experts." in n for n in grads[0])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_adapter_trained_on_4bit_experts_loads_in_plain_peft_on_the_dequantized_base(tmp_path, tokenizer):
    """PEFT nests the wrappers of parametrized weights in another order than of plain ones; the adapter file must
    still mean the same weights as for an unquantized base, so that PEFT (and servers) load it there."""
    model, reference, _ = quantized(tiny_deepseek_v2, tokenizer)
    reference.save_pretrained(tmp_path / "base")
    settings = LoraSettings(r=4, alpha=8, dropout=0.0, experts=True)
    peft_model, _ = make_trainable(
        model, ModelConfig(architecture="llama", tokenizer="bytes", lora=settings), False, find_moe(model)
    )
    set_adapters(peft_model)
    ids = torch.randint(3, len(tokenizer), (2, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        trained = peft_model.eval()(input_ids=ids).logits
    write_model_files(peft_model, tokenizer, tmp_path / "adapter", {})
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    with torch.no_grad():
        loaded = PeftModel.from_pretrained(plain, tmp_path / "adapter").eval()
        torch.testing.assert_close(loaded(input_ids=ids).logits, trained, atol=1e-5, rtol=1e-5)


def test_4bit_experts_compute_in_the_compute_dtype_outside_autocast(tokenizer):
    """Like bitsandbytes' 4-bit linear layers: float32 weights with compute_dtype bfloat16 run the experts in
    bfloat16 (on the dequantized values rounded to it) and hand back float32."""
    model = tiny_deepseek_v2(tokenizer).float()
    quantize_stacked_experts(model, SETTINGS.model_copy(update={"compute_dtype": "bfloat16"}), torch.float32)
    _, reference, _ = quantized(tiny_deepseek_v2, tokenizer)
    experts, plain = experts_modules(model)[0], experts_modules(reference)[0]
    assert compute_dtype(experts) == torch.bfloat16 and compute_dtype(plain) == torch.float32
    hidden = torch.randn(11, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    top_k = model.config.num_experts_per_tok
    index = torch.stack([torch.randperm(experts.num_experts)[:top_k] for _ in range(11)])
    weights = torch.rand(11, top_k)
    with torch.no_grad():
        out = experts(hidden, index, weights)
        in_fp32 = grouped_experts_forward(plain, hidden, index, weights, adapters={})
        plain.to(torch.bfloat16)
        in_bf16 = grouped_experts_forward(plain, hidden.bfloat16(), index, weights, adapters={})
    assert out.dtype == torch.float32
    assert torch.equal(out, in_bf16.float()) and not torch.equal(out, in_fp32)


@pytest.mark.parametrize("pattern", ["experts", "layers.1.mlp.experts", "model.layers.1", "model.layers.*.mlp.experts"])
def test_skip_modules_keeps_named_experts_in_full_precision(tokenizer, pattern):
    """Names match as transformers matches the linear layers it leaves unquantized: suffix, prefix, regex."""
    model = tiny_deepseek_v2(tokenizer).float()
    total = stacked_numel(model, SETTINGS)
    skipped = SETTINGS.model_copy(update={"skip_modules": [pattern]})
    assert total > 0 and stacked_numel(model, skipped) == 0
    # The same rule for the linear layers: a prefix leaves the whole layer; the others name only the routed
    # experts, which hold no linear layer (the shared experts' stay quantized).
    every = {name for name, _ in quantized_linears(model, SETTINGS)}
    left = {name for name, _ in quantized_linears(model, skipped)}
    assert any(".shared_experts." in name for name in every)
    assert left == ({n for n in every if not n.startswith("model.layers.1.")} if pattern == "model.layers.1" else every)
    assert quantize_stacked_experts(model, skipped, torch.uint8) == 0
    assert quantized_experts_count(model) == 0


def test_a_model_whose_experts_forward_cannot_be_switched_says_so(tokenizer, monkeypatch, capsys):
    """transformers decides from the modeling source whether a model's experts forward can be switched."""
    model = tiny_mixtral(tokenizer).float()
    monkeypatch.setattr(type(model), "_can_set_experts_implementation", classmethod(lambda cls: False))
    assert quantize_stacked_experts(model, SETTINGS, torch.float32) > 0
    assert model.config._experts_implementation != EXPERTS_IMPLEMENTATION
    assert "cannot switch the experts of MixtralForCausalLM to tuneforge's grouped forward" in capsys.readouterr().out
    # Its own forward still computes with the dequantized values.
    ids = torch.randint(3, len(tokenizer), (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        dequantize_stacked_experts(model)
        torch.testing.assert_close(logits, model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_peft_form_on_4bit_experts_is_refused_with_the_fix(tokenizer):
    """PEFT's own W + B·A wrapper leaves its delta parametrization on a 4-bit weight after each forward."""
    model, _, _ = quantized(tiny_mixtral, tokenizer)
    settings = LoraSettings(r=4, alpha=8, dropout=0.0, experts=True, grouped_experts=False)
    with pytest.raises(UserError) as error:
        make_trainable(
            model, ModelConfig(architecture="llama", tokenizer="bytes", lora=settings), False, find_moe(model)
        )
    assert "are stored in 4 bits" in str(error.value)
    assert "model.lora.grouped_experts: true" in str(error.value) and "skip_modules: [experts]" in str(error.value)


def test_staging_is_decided_from_the_models_shapes_and_refused_without_host_room(tokenizer, monkeypatch, capsys):
    """`_staging` on a device that is not the CPU (here `meta`, whose free memory is unbounded): auto loads
    onto it, host stages, and a node whose ranks cannot each hold a copy in host RAM is refused up front."""
    from tuneforge.model.build import _staging

    model = tiny_deepseek_v2(tokenizer)
    meta = torch.device("meta")
    cfg = ModelConfig(architecture="llama", tokenizer="bytes", lora=LoraSettings(), quantization=SETTINGS)
    assert _staging(model, cfg, torch.device("cpu"), None) == "device"
    assert _staging(model, cfg, meta, None) == "device"
    host = cfg.model_copy(update={"quantization": SETTINGS.model_copy(update={"stage_experts": "host"})})
    assert _staging(model, host, meta, None) == "host"
    assert "model: loading into host RAM first (model.quantization.stage_experts=host)" in capsys.readouterr().out
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(10**12))  # more copies than any machine holds
    with pytest.raises(UserError, match="staging the model in host RAM needs 1000000000000 x"):
        _staging(model, host, meta, None)
    # With every experts module kept in full precision there is nothing to stage.
    skipped = SETTINGS.model_copy(update={"stage_experts": "host", "skip_modules": ["experts"]})
    assert _staging(model, cfg.model_copy(update={"quantization": skipped}), meta, None) == "device"
