"""CUDA-only checks of the GPU hot path (skipped without a GPU; `make gpu-test` runs them): PyTorch's varlen
kernel equals masked SDPA for packed rows, packed equals unpacked, the fused loss equals the logits path, and a
micro-step makes no host synchronisation, also with 4-bit stacked experts."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

from tuneforge.data.batching import collate
from tuneforge.model import packed_attention
from tuneforge.model.packed_attention import cumulative_lengths

from conftest import chat, loss_sum, rows_batch, tiny_llama, tokenized

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")
RECORDS = [chat("a" * 5, "short"), chat("b" * 30, "a longer reply " * 3), chat("c" * 12, "mid reply")]


@pytest.mark.parametrize(("kv_heads", "width", "value_width"), [(16, 128, 128), (4, 128, 128), (16, 192, 128)])
def test_varlen_attention_equals_block_diagonal_sdpa_in_bf16(kv_heads, width, value_width):
    torch.manual_seed(0)
    lengths = [[700, 1200, 148], [2048], [37, 1500, 9, 502]]  # every row 2,048 long
    position_ids = torch.cat([torch.cat([torch.arange(n) for n in row]) for row in lengths]).view(len(lengths), -1)
    length = position_ids.size(1)
    shapes = [(3, 16, length, width), (3, kv_heads, length, width), (3, kv_heads, length, value_width)]
    inputs = [torch.randn(shape, device=CUDA, dtype=torch.bfloat16, requires_grad=True) for shape in shapes]
    bounds, longest = cumulative_lengths(position_ids)
    module = torch.nn.Module()
    module.is_causal, module.training = True, True
    ours, _ = packed_attention.packed_sdpa_forward(
        module, *inputs, None, position_ids=position_ids.to(CUDA), cu_seq_lens_q=bounds.to(CUDA),
        max_length_q=longest,
    )  # fmt: skip
    same_sample = torch.zeros(3, 1, length, length, dtype=torch.bool, device=CUDA)
    for row, row_lengths in enumerate(lengths):
        start = 0
        for n in row_lengths:
            same_sample[row, 0, start : start + n, start : start + n] = True
            start += n
    mask = same_sample & torch.ones(length, length, dtype=torch.bool, device=CUDA).tril()
    q, k, v = (t.float() for t in inputs)
    groups = 16 // kv_heads
    expected = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask
    ).transpose(1, 2)
    torch.testing.assert_close(ours.float(), expected, atol=2e-2, rtol=2e-2)
    weights = torch.randn_like(expected)
    for mine, theirs in zip(
        torch.autograd.grad((ours.float() * weights).sum(), inputs),
        torch.autograd.grad((expected * weights).sum(), inputs),
        strict=True,
    ):
        torch.testing.assert_close(mine.float(), theirs.float(), atol=5e-2, rtol=5e-2)


def bf16_llama(tokenizer):
    model = tiny_llama(tokenizer).to(CUDA, torch.bfloat16)
    model.config._attn_implementation = packed_attention.register()
    return model


def test_packed_rows_give_the_unpacked_loss_on_cuda(tokenizer):
    model, data = bf16_llama(tokenizer), tokenized(tokenizer, RECORDS)
    packed = loss_sum(model, collate(data, [[0, 1, 2]], tokenizer.pad_token_id, packed=True), "bf16")
    unpacked = loss_sum(model, rows_batch(data, [0, 1, 2], tokenizer.pad_token_id), "bf16")
    assert float(packed) == pytest.approx(float(unpacked), rel=2e-2)


def test_the_fused_loss_equals_the_logits_path_on_cuda(tokenizer):
    model, data = bf16_llama(tokenizer), tokenized(tokenizer, RECORDS)
    batch = rows_batch(data, [0, 1, 2], tokenizer.pad_token_id)
    fused = loss_sum(model, batch, "bf16", fuse=True)
    plain = loss_sum(model, batch, "bf16", fuse=False)
    assert float(fused) == pytest.approx(float(plain), rel=1e-2)


def test_the_fused_loss_in_several_gpu_chunks_equals_the_full_logits_forward_and_backward(monkeypatch):
    """GPU chunks are sized by memory: forced to 128 rows here, they give the loss and both gradients of
    cross-entropy over the whole fp32 logits."""
    from tuneforge.objective import fused_loss

    torch.manual_seed(0)
    hidden = torch.randn(600, 256, device=CUDA).to(torch.bfloat16).requires_grad_()
    weight = (0.05 * torch.randn(5000, 256, device=CUDA)).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 5000, (600,), device=CUDA)
    monkeypatch.setattr(fused_loss, "GPU_CHUNK_BYTES", 128 * 5000 * fused_loss.LOGIT_BYTES)
    assert fused_loss.chunk_rows(600, 5000, on_gpu=True) == 128
    fused = fused_loss.linear_cross_entropy_sum(hidden, weight, targets, torch.bfloat16)
    fused.backward()
    fused_grads = hidden.grad.float(), weight.grad.float()
    hidden.grad = weight.grad = None
    reference = F.cross_entropy((hidden @ weight.T).float(), targets, reduction="sum")
    reference.backward()
    assert float(fused) == pytest.approx(float(reference), rel=1e-3)
    for mine, theirs in zip(fused_grads, (hidden.grad.float(), weight.grad.float()), strict=True):
        assert torch.allclose(mine, theirs, rtol=2e-2, atol=2e-2 * theirs.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-varlen", "fp32-gathered-sdpa"])
def test_a_packed_micro_step_makes_no_host_synchronisation(tokenizer, dtype):
    """bf16 runs the varlen kernel; fp32, which it does not take, the gathered SDPA planned from the host copy."""
    model, data = bf16_llama(tokenizer).to(dtype), tokenized(tokenizer, RECORDS)
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    batch = collate(data, [[0, 1, 2]], tokenizer.pad_token_id, packed=True)
    loss_sum(model, batch, precision).backward()  # warm-up: allocations and the varlen self-check
    torch.cuda.synchronize()
    syncs = host_syncs(lambda: loss_sum(model, batch, precision).backward())
    # transformers' mask preparation reads the position ids once per forward (find_packed_sequence_indices,
    # masking_utils.py) whatever the attention; nothing else may.
    assert [site for site in syncs if not site.startswith("masking_utils.py")] == []
    assert len(syncs) <= 1


def host_syncs(work) -> list[str]:
    """Where `work` synchronised with the GPU: `file:line` of the Python frame of each synchronising call."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            work()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [f"{os.path.basename(w.filename)}:{w.lineno}" for w in caught if "synchroniz" in str(w.message).lower()]


def test_a_whole_step_with_router_balance_reads_the_device_once(tokenizer):
    """accumulate_gradients over two packed micro-batches of an MoE model with its router balance loss, and the
    optimizer step (a fused AdamW that skips non-finite steps on the device), make no host synchronisation until
    the step's one read of its sums and gradient norm."""
    from tuneforge.config.schema import TrainConfig
    from tuneforge.engines.single import SingleEngine
    from tuneforge.model.moe import find_moe
    from tuneforge.model.quantized_experts import register_experts_implementation
    from tuneforge.model.router_balance import attach_router_balance
    from tuneforge.train.loop import accumulate_gradients
    from tuneforge.train.objectives import build_objective
    from tuneforge.train.optim import build_optimizer

    from conftest import tiny_qwen3_moe

    model = tiny_qwen3_moe(tokenizer).to(CUDA, torch.bfloat16)
    model.set_experts_implementation(register_experts_implementation())  # grouped_mm: no per-expert counts read
    balance, _ = attach_router_balance(find_moe(model), model.config, 0.01)
    engine = SingleEngine(model, lambda m: build_optimizer(m, TrainConfig(precision="bf16")))
    objective = build_objective(engine, "bf16", balance)
    data = tokenized(tokenizer, RECORDS)
    batches = [collate(data, [[0, 1]], tokenizer.pad_token_id, packed=True), collate(data, [[2]], 0, packed=True)]
    accumulate_gradients(engine, batches, objective).read(engine.step(1e-4, 1.0))  # warm-up
    torch.cuda.synchronize()
    done = {}

    def one_step():
        done["step"] = accumulate_gradients(engine, batches, objective)
        done["norm"] = engine.step(1e-4, 1.0)

    syncs = host_syncs(one_step)
    assert [site for site in syncs if not site.startswith("masking_utils.py")] == []
    assert len(syncs) <= len(batches)  # transformers' mask preparation, at most once per forward
    step, norm = done["step"], done["norm"]
    (value,) = step.read(norm)
    assert value > 0 and step.router_aux_loss is not None and step.num_targets > 0


def expert_adapted(tokenizer, grouped: bool):
    """A bf16 Qwen3-MoE on CUDA, adapters on its stacked experts (r=16: grouped_mm's alignment holds)."""
    from tuneforge.config.schema import LoraSettings, ModelConfig
    from tuneforge.model.moe import find_moe
    from tuneforge.model.trainable import make_trainable

    from conftest import tiny_qwen3_moe

    settings = LoraSettings(r=16, alpha=32, dropout=0.0, experts=True, grouped_experts=grouped)
    base = tiny_qwen3_moe(tokenizer).to(CUDA, torch.bfloat16)
    model, _ = make_trainable(
        base, ModelConfig(architecture="llama", tokenizer="bytes", lora=settings), False, find_moe(base)
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model


def test_grouped_expert_adapters_equal_peft_form_in_bf16_without_host_synchronisation(tokenizer):
    ids = torch.randint(3, len(tokenizer), (2, 64), generator=torch.Generator().manual_seed(2)).to(CUDA)
    grouped, peft_form = expert_adapted(tokenizer, True), expert_adapted(tokenizer, False)
    expected = peft_form(input_ids=ids).logits.float()
    logits = grouped(input_ids=ids).logits.float()
    torch.testing.assert_close(logits, expected, atol=3e-2, rtol=3e-2)
    logits.pow(2).mean().backward()  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the per-expert fallback would read counts on the host
    try:
        grouped(input_ids=ids).logits.float().pow(2).mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_4bit_experts_on_cuda_compute_with_their_dequantized_values_without_host_synchronisation(tokenizer):
    """bitsandbytes' CUDA kernels rebuild the 4-bit stacked experts (bf16, grouped_mm) in forward and backward."""
    pytest.importorskip("bitsandbytes")
    from tuneforge.config.schema import QuantizationConfig
    from tuneforge.model.quantized_experts import dequantize_stacked_experts, quantize_stacked_experts

    from conftest import tiny_qwen3_moe

    settings = QuantizationConfig(bits=4, compute_dtype="bfloat16")
    models = []
    for _ in range(2):
        model = tiny_qwen3_moe(tokenizer).to(CUDA, torch.bfloat16)
        assert quantize_stacked_experts(model, settings, torch.bfloat16) > 0
        models.append(model)
    quantized, reference = models
    dequantize_stacked_experts(reference)
    reference.set_experts_implementation("grouped_mm")
    ids = torch.randint(3, len(tokenizer), (2, 64), generator=torch.Generator().manual_seed(2)).to(CUDA)
    embeddings = [m.get_input_embeddings() for m in models]
    for e in embeddings:
        e.weight.requires_grad_(True)
    outputs = [m(input_ids=ids).logits.float() for m in models]
    torch.testing.assert_close(outputs[0], outputs[1], atol=3e-2, rtol=3e-2)
    for out in outputs:
        out.pow(2).mean().backward()
    torch.testing.assert_close(embeddings[0].weight.grad, embeddings[1].weight.grad, atol=3e-2, rtol=5e-2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        quantized(input_ids=ids).logits.float().pow(2).mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("sharded_engine", [False, True], ids=["uint8-storage", "bf16-storage"])
def test_a_4bit_moe_staged_in_host_ram_loads_as_it_does_onto_the_gpu(tokenizer, tmp_path, sharded_engine):
    """stage_experts=host: the model loads on the CPU and each expert stack is quantized on the GPU alone; the
    result is the model a load onto the GPU gives (the experts bit for bit), all of it on the GPU."""
    pytest.importorskip("bitsandbytes")
    from tuneforge.config.schema import LoraSettings, ModelConfig, QuantizationConfig
    from tuneforge.model.build import _load
    from tuneforge.model.quantized_experts import quantized_experts_count

    from conftest import tiny_qwen3_moe

    tiny_qwen3_moe(tokenizer).to(torch.bfloat16).save_pretrained(tmp_path / "base")
    loaded = {}
    for staging in ("device", "host"):
        settings = QuantizationConfig(bits=4, compute_dtype="bfloat16", stage_experts=staging)
        cfg = ModelConfig(path=str(tmp_path / "base"), dtype="bfloat16", quantization=settings, lora=LoraSettings())
        model = _load(str(tmp_path / "base"), cfg, CUDA, sharded_engine=sharded_engine)
        assert quantized_experts_count(model) > 0
        assert {p.device.type for p in model.parameters()} == {"cuda"}
        # The linear layers' quantization state (double quant's nested state too) came along.
        states = [m.weight.quant_state for m in model.modules() if hasattr(getattr(m, "weight", None), "quant_state")]
        assert states and all(s.absmax.is_cuda and s.state2.absmax.is_cuda for s in states)
        loaded[staging] = model
    for (name, a), (_, b) in zip(loaded["device"].named_parameters(), loaded["host"].named_parameters(), strict=True):
        if ".experts." in name:
            # Compared bit for bit: 4-bit codes stored as bfloat16 can read as NaN, which equals nothing.
            assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)), name
    ids = torch.randint(3, len(tokenizer), (2, 32), generator=torch.Generator().manual_seed(2)).to(CUDA)
    with torch.no_grad():
        logits = [loaded[s](input_ids=ids).logits.float() for s in ("device", "host")]
    torch.testing.assert_close(logits[0], logits[1], atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("name", ["sft", "dpo-adapters", "dpo-precompute", "dpo-model", "orpo", "reward"])
def test_a_step_that_logs_nothing_does_not_synchronise_for_any_objective(tmp_path, monkeypatch, name):
    """The CUDA form of `test_host_reads`: whole runs of each objective on the GPU, where the steps that print
    no line, save, validate, sample nor check for a stop (see `READ_STEPS`) make no host synchronisation; the
    others read every unread step's figures in one transfer."""
    from test_host_reads import READ_STEPS, write_job
    from tuneforge.train.loop import Trainer

    from conftest import metrics, train_here

    extra = write_job(tmp_path, name)
    syncs: dict[int, list[str]] = {}
    original = Trainer.train_step

    def watched(self, step, epoch, micro_batches):
        if step in READ_STEPS:
            return original(self, step, epoch, micro_batches)
        done = {}
        sites = host_syncs(lambda: done.update(pending=original(self, step, epoch, micro_batches)))
        syncs[step] = [site for site in sites if not site.startswith("masking_utils.py")]
        return done["pending"]

    monkeypatch.setattr(Trainer, "train_step", watched)
    result = train_here(tmp_path / "cfg.yaml", tmp_path / "run", *extra)
    monkeypatch.undo()
    assert result.returncode == 0, result.stderr[-3000:]
    assert syncs and all(sites == [] for sites in syncs.values()), syncs
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]
