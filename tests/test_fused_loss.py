"""The fused output-layer loss equals the standard logits path, in value and in every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tuneforge.config.schema import LoraSettings
from tuneforge.data.batching import collate
from tuneforge.data.templates import IGNORE_INDEX
from tuneforge.objective import fused_loss
from tuneforge.objective.forward import fused_output_layer
from tuneforge.objective.fused_loss import linear_cross_entropy_sum

from conftest import chat, loss_sum, tiny_deepseek_v2, tiny_llama, tokenized, with_lora


def reference(model, batch) -> torch.Tensor:
    """The standard path: the model's full logits, then cross-entropy."""
    logits = model(
        input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.attention_mask
    ).logits
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), batch.targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def gradients(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.fixture
def batch(tokenizer):
    records = [chat(f"question {i}", "answer " * (i + 1)) for i in range(5)]
    data = tokenized(tokenizer, records)
    return collate(data, [[i] for i in range(5)], tokenizer.pad_token_id, packed=False)


@pytest.mark.parametrize("make", [tiny_llama, tiny_deepseek_v2], ids=["llama", "deepseek_v2"])
def test_fused_loss_and_gradients_equal_the_logits_path(tokenizer, batch, make, monkeypatch):
    # Several chunks and a ragged last one.
    monkeypatch.setattr(fused_loss, "CHUNK_ELEMENTS", 7 * len(tokenizer))
    monkeypatch.setattr(fused_loss, "MIN_CHUNK_ROWS", 1)
    model = make(tokenizer)
    assert fused_output_layer(model) is model.lm_head
    expected = reference(model, batch)
    expected.backward()
    expected_grads = gradients(model)
    fused = loss_sum(model, batch, "fp32")
    fused.backward()
    fused_grads = gradients(model)
    assert float(fused) == pytest.approx(float(expected), rel=1e-6)
    assert fused_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_frozen_output_layer_gets_no_gradient_and_lora_still_trains(tokenizer, batch):
    model, _ = with_lora(tiny_llama(tokenizer), LoraSettings(r=4, alpha=8, dropout=0.0, targets=["q_proj", "v_proj"]))
    assert fused_output_layer(model) is not None and not fused_output_layer(model).weight.requires_grad
    expected = reference(model, batch)
    expected.backward()
    expected_grads = gradients(model)
    loss_sum(model, batch, "fp32").backward()
    fused_grads = gradients(model)
    assert fused_grads.keys() == expected_grads.keys() and all("lora_" in name for name in fused_grads)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_wrapped_output_layer_takes_the_standard_path(tokenizer):
    settings = LoraSettings(r=4, alpha=8, targets=["q_proj"], modules_to_save=["lm_head"])
    model, _ = with_lora(tiny_llama(tokenizer), settings)
    assert fused_output_layer(model) is None


@pytest.mark.parametrize("model_type", ["gemma2", "cohere"])
def test_a_model_that_transforms_its_logits_trains_on_them(tokenizer, batch, model_type):
    """Gemma-2 softcaps its logits after the output layer and Cohere scales them: the fused loss, which
    multiplies the hidden states by the layer itself, would train on other logits. Those take the model's own
    logits, and the loss is the model's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import TINY_DENSE

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), head_dim=8, **TINY_DENSE)
    model = AutoModelForCausalLM.from_config(config)
    assert fused_output_layer(model) is None
    assert float(loss_sum(model, batch, "fp32")) == pytest.approx(float(reference(model, batch)), rel=1e-6)


def test_without_gradients_wanted_none_is_computed(monkeypatch):
    """Validation of full fine-tuning: the output layer's weight requires a gradient, but under no_grad the loss
    alone is computed, not the vocabulary-sized weight gradient with it."""
    computed = []
    monkeypatch.setattr(fused_loss, "_accumulate_weight_gradient", lambda *args, **kwargs: computed.append(1))
    hidden, weight = torch.randn(6, 8), torch.randn(11, 8, requires_grad=True)
    targets = torch.tensor([1, 2, 3, 4, 5, 6])
    expected = F.cross_entropy(hidden @ weight.detach().T, targets, reduction="sum")
    with torch.no_grad():
        loss = linear_cross_entropy_sum(hidden, weight, targets, torch.float32)
    assert computed == [] and float(loss) == pytest.approx(float(expected), rel=1e-6)


def test_the_function_scales_its_gradients_by_the_incoming_one():
    torch.manual_seed(0)
    hidden = torch.randn(9, 6, requires_grad=True)
    weight = torch.randn(11, 6, requires_grad=True)
    targets = torch.randint(0, 11, (9,))
    (3.0 * linear_cross_entropy_sum(hidden, weight, targets, torch.float32)).backward()
    fused = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    (3.0 * F.cross_entropy(hidden @ weight.T, targets, reduction="sum")).backward()
    torch.testing.assert_close(fused[0], hidden.grad)
    torch.testing.assert_close(fused[1], weight.grad)


def test_confidently_wrong_rows_keep_an_exact_loss():
    """A target whose probability underflows fp32 still gets its finite, exact loss and gradient."""
    hidden = torch.tensor([[40.0, 0.0], [0.0, 1.0]], requires_grad=True)
    weight = torch.tensor([[5.0, 0.0], [-5.0, 0.0], [0.0, 1.0]], requires_grad=True)
    targets = torch.tensor([1, 2])
    loss = linear_cross_entropy_sum(hidden, weight, targets, torch.float32)
    expected = F.cross_entropy(hidden @ weight.T, targets, reduction="sum")
    assert float(loss) == pytest.approx(float(expected)) and float(loss) > 399


def test_the_gpu_form_without_a_branch_gives_the_cpu_form_losses_and_probabilities():
    """GPUs take log-sum-exp minus the target logit for every row (no data-dependent branch, so no host sync);
    the CPU overwrites the logits and recomputes only underflowing rows. Same numbers, rows like that included."""
    from tuneforge.objective.fused_loss import _softmax_and_loss

    generator = torch.Generator().manual_seed(0)
    part = torch.randn(6, 8, generator=generator)
    matrix = torch.randn(50, 8, generator=generator)
    part[0] = 40 * matrix[3]  # row 0 is confidently wrong about its target 7
    wanted = torch.tensor([7, 1, 2, 3, 4, 5])
    kept, in_place = (part @ matrix.T for _ in range(2))
    gpu_probabilities, gpu_loss = _softmax_and_loss(kept, wanted, part, matrix, overwrite=False)
    cpu_probabilities, cpu_loss = _softmax_and_loss(in_place, wanted, part, matrix, overwrite=True)
    expected = F.cross_entropy(part @ matrix.T, wanted, reduction="sum")
    assert float(gpu_loss) == pytest.approx(float(expected), rel=1e-6) and float(expected) > 200
    assert float(cpu_loss) == pytest.approx(float(expected), rel=1e-6)
    torch.testing.assert_close(gpu_probabilities, cpu_probabilities)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_weight_gradient_sums_every_chunk(compute_dtype, monkeypatch):
    """Ragged chunks: the first writes the weight's gradient, the others add to it, in either compute dtype."""
    monkeypatch.setattr(fused_loss, "CHUNK_ELEMENTS", 4 * 11)
    monkeypatch.setattr(fused_loss, "MIN_CHUNK_ROWS", 1)
    torch.manual_seed(0)
    hidden = torch.randn(10, 6, requires_grad=True)
    weight = torch.randn(11, 6, requires_grad=True)
    targets = torch.randint(0, 11, (10,))
    linear_cross_entropy_sum(hidden, weight, targets, compute_dtype).backward()
    fused = weight.grad.clone()
    weight.grad = None
    F.cross_entropy(hidden @ weight.T, targets, reduction="sum").backward()
    tolerance = {} if compute_dtype == torch.float32 else {"rtol": 0.05, "atol": 0.05}
    torch.testing.assert_close(fused, weight.grad, **tolerance)


def test_no_target_rows_give_zero_gradients():
    hidden = torch.randn(0, 6, requires_grad=True)
    weight = torch.randn(11, 6, requires_grad=True)
    loss = linear_cross_entropy_sum(hidden, weight, torch.zeros(0, dtype=torch.long), torch.float32)
    loss.backward()
    assert float(loss) == 0.0 and torch.equal(weight.grad, torch.zeros_like(weight))


def test_a_second_backward_through_the_same_loss_is_refused():
    """Gradients are handed over scaled in place, so a retained graph must not silently scale them twice."""
    hidden = torch.randn(3, 4, requires_grad=True)
    weight = torch.randn(5, 4, requires_grad=True)
    loss = linear_cross_entropy_sum(hidden, weight, torch.tensor([0, 1, 2]), torch.float32)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward pass"):
        loss.backward()


def test_gpu_chunks_are_sized_by_memory_and_cpu_chunks_by_cache():
    """A GPU chunk fills its memory budget (tall matmuls, few launches); a CPU chunk stays cache-sized."""
    from tuneforge.objective.fused_loss import GPU_CHUNK_BYTES, LOGIT_BYTES, chunk_rows

    for vocab in (32_000, 102_400, 128_256):
        rows = chunk_rows(100_000, vocab, on_gpu=True)
        assert rows * vocab * LOGIT_BYTES <= GPU_CHUNK_BYTES < (rows + 1) * vocab * LOGIT_BYTES
        assert chunk_rows(100_000, vocab, on_gpu=False) == max(256, (1 << 23) // vocab)
    assert chunk_rows(100_000, 102_400, on_gpu=True) == 1048
    assert chunk_rows(300, 102_400, on_gpu=True) == 300  # never taller than the rows there are
    assert chunk_rows(0, 102_400, on_gpu=True) == 1
