"""QLoRA on CPU (bitsandbytes NF4), and exports that compute what the training model computed."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from tuneforge.config import load_config
from tuneforge.config.schema import LoraSettings, ModelConfig, QuantizationConfig
from tuneforge.errors import UserError
from tuneforge.export import export
from tuneforge.model.build import build_model
from tuneforge.model.moe import find_moe
from tuneforge.model.trainable import make_trainable
from tuneforge.train.checkpoint import save_checkpoint
from tuneforge.train.run import run_training
from tuneforge.trained import load_trained

from conftest import TINY_DEEPSEEK_V2, chat, write_jsonl

pytest.importorskip("bitsandbytes")

# Every quantized layer's output size is a multiple of 32 (bitsandbytes' CPU kernels need it). A larger
# initializer range than the default 0.02 lets adapters on a frozen random base reach confident logits.
LLAMA = {
    "initializer_range": 0.2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
DEEPSEEK_V2 = {
    **TINY_DEEPSEEK_V2,
    "initializer_range": 0.2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "kv_lora_rank": 24,
}
QLORA = {"bits": 4, "quant_type": "nf4", "double_quant": True, "compute_dtype": "float32"}
LORA = {"r": 8, "alpha": 16, "dropout": 0.0}


def model_config(architecture: str, size: dict, quantization: dict | None) -> ModelConfig:
    return ModelConfig(
        architecture=architecture,
        tokenizer="bytes",
        size=size,
        lora=LoraSettings(**LORA),
        quantization=QuantizationConfig(**quantization) if quantization else None,
    )


def probe_ids(tokenizer) -> torch.Tensor:
    return torch.tensor([tokenizer("### Instruction:\nhello there\n### Response:\n")["input_ids"]])


def trained_lora_checkpoint(tmp_path, tokenizer, quantization: dict | None):
    """Trains adapters for a few steps as `tuneforge train` would, saves the checkpoint, and returns it with
    the training model's logits on a probe."""
    from tuneforge.engines.single import SingleEngine

    from conftest import accumulate, rows_batch, tokenized

    cfg = model_config("llama", {**LLAMA, "initializer_range": 0.02}, quantization)  # logits of order 1
    model = build_model(cfg, tokenizer, seed=0, base_dir=tmp_path / "base")
    model, _ = make_trainable(model, cfg, False, find_moe(model))
    data = tokenized(tokenizer, [chat(f"question {i}", f"answer {i * 3}") for i in range(4)])
    batch = rows_batch(data, [0, 1, 2, 3], tokenizer.pad_token_id)
    engine = SingleEngine(model, lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad]))
    for _ in range(3):
        accumulate(engine, [batch], "fp32")
        engine.step(3e-2, 1.0)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe_ids(tokenizer)).logits
    meta = {"template": "deepseek_coder", "system": None, "adapter": {"dtype": "float32", "quantization": quantization}}
    checkpoint = save_checkpoint(model, tokenizer, tmp_path / "checkpoints" / "final", meta)
    return checkpoint, logits


# The 4-bit form in the slow tier (bitsandbytes' CPU kernels, seconds); the plain LoRA form stays fast.
@pytest.mark.parametrize("quantization", [None, pytest.param(QLORA, marks=pytest.mark.slow)], ids=["lora", "qlora"])
def test_exported_adapter_and_merged_model_reproduce_the_training_logits(tmp_path, tokenizer, quantization):
    checkpoint, logits = trained_lora_checkpoint(tmp_path, tokenizer, quantization)
    probe = probe_ids(tokenizer)
    lines = export(checkpoint, tmp_path / "adapter", merge=False, dtype_name=None)
    assert "exported adapter" in lines[0]
    lines = export(checkpoint, tmp_path / "merged", merge=True, dtype_name="fp32")
    assert "merged into the dequantized base" in lines[0] if quantization else "merged" in lines[0]

    # Merged: a plain transformers model, no PEFT, no bitsandbytes. For LoRA the differences are float32
    # reassociation (x(W + BA) against xW + xBA), about 1e-6 relative: 1e-4 on logits of size ~1 leaves margin.
    # For QLoRA, bitsandbytes' CPU 4-bit matmul rounds to bfloat16 whatever the compute dtype (measured: 2e-3
    # on outputs of 0.5, i.e. bf16's 2^-8), so the training model itself is only bf16-accurate: 1e-2.
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name, _ in merged.named_parameters())
    tolerance = 1e-2 if quantization else 1e-4
    with torch.no_grad():
        merged_logits = merged(input_ids=probe).logits
    torch.testing.assert_close(merged_logits, logits, atol=tolerance, rtol=tolerance)
    if quantization:
        # Merging into the original float weights instead would carry NF4's quantization error: far worse.
        naive = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), checkpoint)
        with torch.no_grad():
            naive_error = (naive.merge_and_unload()(input_ids=probe).logits - logits).abs().max()
        assert naive_error > 5 * (merged_logits - logits).abs().max()

    # Adapter: PEFT loads it onto its base (for QLoRA, the same 4-bit base it was trained against).
    base = load_trained(tmp_path / "adapter").model if quantization else None
    if base is None:
        plain_base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        base = PeftModel.from_pretrained(plain_base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(base(input_ids=probe).logits, logits, atol=1e-5, rtol=1e-5)  # the same ops

    exported_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    rendered = exported_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello there"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("### Instruction:\nhello there\n### Response:\n")


def test_bf16_export_halves_the_weights(tmp_path, tokenizer):
    checkpoint, _ = trained_lora_checkpoint(tmp_path, tokenizer, None)
    export(checkpoint, tmp_path / "bf16", merge=True, dtype_name="bf16")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}
    with pytest.raises(UserError, match="exists and is not empty"):
        export(checkpoint, tmp_path / "bf16", merge=True, dtype_name="bf16")


@pytest.mark.slow  # an 8-bit base through bitsandbytes' CPU kernels: seconds; the export checks stay fast
def test_8bit_base_weights_train_lora(tmp_path, tokenizer):
    from bitsandbytes.nn import Linear8bitLt

    cfg = model_config("llama", LLAMA, {"bits": 8})
    model = build_model(cfg, tokenizer, seed=0, base_dir=tmp_path / "base")
    assert isinstance(model.model.layers[0].self_attn.q_proj, Linear8bitLt)
    model, notes = make_trainable(model, cfg, False, find_moe(model))
    assert "quantization: base weights 8-bit" in notes[0]
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    from tuneforge.engines.single import SingleEngine

    from conftest import accumulate, rows_batch, tokenized

    data = tokenized(tokenizer, [chat("question", "answer"), chat("other question", "other answer")])
    batch = rows_batch(data, [0, 1], tokenizer.pad_token_id)
    engine = SingleEngine(model, lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad]))
    first = accumulate(engine, [batch], "fp32").loss
    for _ in range(5):
        engine.step(2e-2, 1.0)
        last = accumulate(engine, [batch], "fp32").loss
    assert last < first
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)


def test_layers_the_cpu_kernels_cannot_run_fail_with_a_clear_message(tmp_path, tokenizer):
    size = {**LLAMA, "hidden_size": 32, "intermediate_size": 64}  # k_proj/v_proj: 2 heads x 8 = 16 outputs
    with pytest.raises(UserError, match=r"multiple of 32; these are not: model\.layers\.0\.self_attn\.k_proj \(16\)"):
        build_model(model_config("llama", size, QLORA), tokenizer, seed=0, base_dir=tmp_path / "base")


CONFIG = """\
model:
  architecture: {architecture}
  size: {size}
  tokenizer: bytes
  lora: {lora}
  quantization: {quantization}
data: {{train_files: [train.jsonl], cache_dir: null}}
train: {{lr: 1.0e-2, warmup_steps: 0, schedule: constant, micro_batch_size: 4, max_steps: 20, precision: fp32}}
checkpoint: {{every_steps: 0}}
log: {{progress: lines}}
"""


def write_config(tmp_path, architecture: str, size: dict) -> None:
    write_jsonl(tmp_path / "train.jsonl", [chat(f"question {i % 4}", f"answer {i % 4 * 11}") for i in range(16)])
    text = CONFIG.format(
        architecture=architecture, size=json.dumps(size), lora=json.dumps(LORA), quantization=json.dumps(QLORA)
    )
    (tmp_path / "cfg.yaml").write_text(text)


@pytest.mark.slow
@pytest.mark.parametrize("architecture,size", [("llama", LLAMA), ("deepseek_v2", DEEPSEEK_V2)])
def test_qlora_loss_falls(tmp_path, capsys, architecture, size):
    write_config(tmp_path, architecture, size)
    run_training(load_config(tmp_path / "cfg.yaml"), tmp_path / "run")
    out = capsys.readouterr().out
    assert "quantization: base weights 4-bit nf4, double quant, compute float32" in out
    # The routed experts, stacked 3-D parameters, are quantized too (bitsandbytes' loader skips them).
    assert ("the stacked experts of 1 MoE block(s) too" in out) == (architecture == "deepseek_v2")
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert sum(losses[-3:]) / 3 < 0.5 * losses[0], losses


@pytest.mark.slow  # a checkpoint, an export and two generations: an end-to-end round trip
def test_chat_answers_the_same_from_an_adapter_checkpoint_and_its_merged_export(tmp_path, tokenizer, capsys):
    from tuneforge.cli import main

    checkpoint, _ = trained_lora_checkpoint(tmp_path, tokenizer, None)
    export(checkpoint, tmp_path / "merged", merge=True, dtype_name="fp32")
    capsys.readouterr()
    replies = []
    for source in (checkpoint, tmp_path / "merged"):
        assert main(["chat", str(source), "--prompt", "question 2", "--max-new-tokens", "12"]) == 0
        replies.append(capsys.readouterr().out.strip())
    assert replies[0] and replies[0] == replies[1]
    (tmp_path / "lost").mkdir()
    assert main(["chat", str(checkpoint), "--prompt", "hi", "--base", str(tmp_path / "missing")]) == 2
    assert "is not here; pass --base DIR" in capsys.readouterr().err


@pytest.mark.slow
def test_a_qlora_adapter_on_deepseek_experts_exports_to_a_gguf_llama_cpp_runs_as_the_merged_model(tmp_path, tokenizer):
    """The report's set-up in small: DeepSeek-V2 in 4 bits with adapters on its stacked experts. The GGUF export
    merges into the dequantized base, and llama.cpp computes the merged model's logits."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from tuneforge.gguf_export.export import export_gguf

    cfg = model_config("deepseek_v2", DEEPSEEK_V2, QLORA)
    cfg.lora.experts = True
    model = build_model(cfg, tokenizer, seed=0, base_dir=tmp_path / "base")
    model, _ = make_trainable(model, cfg, False, find_moe(model))
    assert any(".experts." in name for name, p in model.named_parameters() if p.requires_grad)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    meta = {"template": "deepseek_coder", "system": None, "adapter": {"dtype": "float32", "quantization": QLORA}}
    checkpoint = save_checkpoint(model, tokenizer, tmp_path / "checkpoints" / "final", meta)
    export(checkpoint, tmp_path / "merged", merge=True, dtype_name="fp32")
    export_gguf(checkpoint, tmp_path / "gguf", "f32")
    ids = probe_ids(tokenizer)[0].tolist()
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(input_ids=torch.tensor([ids])).logits[0]
    llm = llama_cpp.Llama(str(tmp_path / "gguf" / "model.gguf"), n_ctx=128, n_threads=1, logits_all=True, verbose=False)
    llm.eval(ids)
    got = torch.tensor(llm.scores[: len(ids)])
    assert (got - expected).abs().max() <= 2e-3 * expected.abs().max()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
