"""The router load-balancing loss: its value, padding and packing invariance, and its place in a run."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from tuneforge.config import load_config
from tuneforge.data.batching import collate
from tuneforge.errors import UserError
from tuneforge.model.moe import find_moe
from tuneforge.model.router_balance import attach_router_balance, combine, routing_stats
from tuneforge.train.run import run_training

from conftest import accumulate, chat, rows_batch, single_engine, tiny_llama, tiny_mixtral, tokenized, write_jsonl


def balance_loss(layer_logits: list[torch.Tensor], top_k: int, token_mask: torch.Tensor) -> torch.Tensor:
    """The balance loss of one batch on one rank, on real (unmasked) tokens, from recomputed top-k routing."""
    weights = token_mask.reshape(-1).float()
    stats = [routing_stats(logits, top_k, weights) for logits in layer_logits]
    counts, prob_sums = torch.stack([c for c, _ in stats]), torch.stack([p for _, p in stats])
    return combine(counts, prob_sums, float(weights.sum().clamp(min=1.0)))


def attach_balance(model, coef):
    return attach_router_balance(find_moe(model), model.config, coef)


def test_one_layer_matches_transformers_and_balanced_routing_gives_top_k():
    torch.manual_seed(0)
    logits = torch.randn(40, 8)
    mask = torch.ones(40)
    expected = load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    assert balance_loss([logits], 2, mask).item() == pytest.approx(expected.item(), rel=1e-6)
    assert balance_loss([torch.zeros(40, 8)], 2, mask).item() == pytest.approx(2.0)
    skewed = torch.zeros(40, 8)
    skewed[:, 0] = 5.0
    assert balance_loss([skewed], 2, mask).item() > 3.0


def test_padding_tokens_do_not_count():
    torch.manual_seed(0)
    real = torch.randn(30, 4)
    padded = torch.cat([real, 10 * torch.randn(10, 4)])
    mask = torch.cat([torch.ones(30), torch.zeros(10)])
    assert balance_loss([padded], 1, mask).item() == pytest.approx(balance_loss([real], 1, torch.ones(30)).item())


def test_recorded_router_logits_are_the_models_own(tokenizer):
    model = tiny_mixtral(tokenizer)
    balance, note = attach_balance(model, None)
    assert "0.001 (the model config) over 2 MoE layers, top-2" in note
    data = tokenized(tokenizer, [chat("hello there", "general kenobi"), chat("q", "a much longer answer here")])
    batch = rows_batch(data, [0, 1], tokenizer.pad_token_id)
    with balance.capture():
        out = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_router_logits=True, use_cache=False
        )
    ours = balance.loss(batch.attention_mask, batch.num_targets, batch.num_targets, lambda tensor: tensor)
    theirs = balance_loss(list(out.router_logits), 2, batch.attention_mask)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)


def test_packed_and_unpacked_batches_give_the_same_balance_loss_and_gradients(tokenizer):
    """HF's own balance loss cannot take packed batches' 4-D masks; ours sees the same tokens either way."""
    data = tokenized(tokenizer, [chat("q" * (3 + 5 * i), "answer " * (1 + i)) for i in range(4)])
    pad = tokenizer.pad_token_id
    results = {}
    for packed in (False, True):
        model = tiny_mixtral(tokenizer)
        balance, _ = attach_balance(model, 0.5)
        rows = [[0, 1, 2, 3]] if packed else [[0], [1], [2], [3]]
        step = accumulate(single_engine(model), [collate(data, rows, pad, packed=packed)], "fp32", balance=balance)
        router_grad = model.model.layers[0].mlp.gate.weight.grad.clone()
        results[packed] = (step, router_grad)
    (unpacked, grad_unpacked), (packed, grad_packed) = results[False], results[True]
    assert packed.router_aux_loss == pytest.approx(unpacked.router_aux_loss, rel=1e-5)
    assert packed.loss == pytest.approx(unpacked.loss, rel=1e-5)
    torch.testing.assert_close(grad_packed, grad_unpacked, atol=1e-6, rtol=1e-4)


def test_the_coefficient_scales_the_router_gradient(tokenizer):
    data = tokenized(tokenizer, [chat("hi", "there"), chat("how are you", "fine thanks")])
    batch = rows_batch(data, [0, 1], tokenizer.pad_token_id)
    grads = {}
    for coef in (0.0, 1.0, 2.0):
        model = tiny_mixtral(tokenizer)
        balance, _ = attach_balance(model, coef)
        accumulate(single_engine(model), [batch], "fp32", balance=balance)
        grads[coef] = model.model.layers[1].mlp.gate.weight.grad.clone()
    assert not torch.allclose(grads[1.0], grads[0.0])
    # The objective is linear in the coefficient, so the aux part of the gradient doubles.
    torch.testing.assert_close(grads[2.0] - grads[0.0], 2 * (grads[1.0] - grads[0.0]), atol=1e-6, rtol=1e-4)


def test_dense_model_with_a_coefficient_is_a_clear_error(tokenizer):
    with pytest.raises(UserError, match="no MoE layers"):
        attach_balance(tiny_llama(tokenizer), 0.01)
    assert attach_balance(tiny_llama(tokenizer), None) == (None, "")


CONFIG = """\
model:
  architecture: qwen3_moe
  size: {hidden_size: 32, intermediate_size: 64, moe_intermediate_size: 32, num_hidden_layers: 2,
         num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8, num_experts: 4, num_experts_per_tok: 2}
  tokenizer: bytes
data: {train_files: [train.jsonl], cache_dir: null, packing: true, max_length: 96}
train: {lr: 1.0e-3, micro_batch_size: 2, max_steps: 3, precision: fp32}
checkpoint: {every_steps: 0, save_final: false}
log: {progress: lines}
"""


@pytest.mark.slow
def test_a_packed_moe_run_logs_the_router_loss_and_zero_turns_it_off(tmp_path, capsys):
    write_jsonl(tmp_path / "train.jsonl", [chat(f"question {i}", f"answer {i * 7}") for i in range(12)])
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    run_training(load_config(tmp_path / "cfg.yaml"), tmp_path / "on")
    assert "router balance loss: coefficient 0.001 (the model config) over 2 MoE layers" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").open()]
    assert all(1.9 < r["router_aux_loss"] < 4.0 for r in records)  # top_k=2 when balanced, at most 4 experts

    run_training(load_config(tmp_path / "cfg.yaml", ["train.router_aux_loss_coef=0"]), tmp_path / "off")
    assert "router balance loss: off" in capsys.readouterr().out
    off = [json.loads(line) for line in (tmp_path / "off" / "metrics.jsonl").open()]
    assert all("router_aux_loss" not in r for r in off)
    assert off[0]["loss"] == pytest.approx(records[0]["loss"], rel=1e-6)  # the first forward is the same
