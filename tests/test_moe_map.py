"""The run's MoE map: found once on the base model, still right once adapters wrap the experts, and the
routing it records is the router's own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tuneforge.config.schema import LoraSettings, ModelConfig
from tuneforge.model.flops import active_matmul_parameters, model_flops_per_token
from tuneforge.model.moe import find_moe
from tuneforge.model.router_balance import attach_router_balance, combine, routing_stats
from tuneforge.model.trainable import make_trainable

from conftest import (
    accumulate,
    chat,
    rows_batch,
    single_engine,
    tiny_deepseek_v2,
    tiny_llama,
    tiny_mixtral,
    tiny_qwen3_moe,
    tokenized,
)

MOE_MODELS = {"deepseek_v2": tiny_deepseek_v2, "mixtral": tiny_mixtral, "qwen3_moe": tiny_qwen3_moe}
EXPECTED = {
    "deepseek_v2": (["model.layers.1.mlp"], "softmax top-2"),
    "mixtral": (["model.layers.0.mlp", "model.layers.1.mlp"], "softmax top-2"),
    "qwen3_moe": (["model.layers.0.mlp", "model.layers.1.mlp"], "softmax top-2"),
}


def lora_config(experts: bool) -> ModelConfig:
    return ModelConfig(architecture="llama", tokenizer="bytes", lora=LoraSettings(r=4, dropout=0.0, experts=experts))


def batch_of(tokenizer):
    data = tokenized(tokenizer, [chat(f"question {i} " + "x" * i, f"answer {i * 7}") for i in range(4)])
    return rows_batch(data, [0, 1, 2, 3], tokenizer.pad_token_id)


@pytest.mark.parametrize("experts", [True, False], ids=["expert-adapters", "no-expert-adapters"])
@pytest.mark.parametrize("name", list(MOE_MODELS))
def test_the_map_of_the_base_drives_router_loss_and_telemetry_after_adapters_wrap_it(tokenizer, name, experts):
    base = MOE_MODELS[name](tokenizer)
    moe = find_moe(base)
    blocks, routing = EXPECTED[name]
    assert [b.name for b in moe] == blocks and {b.routing for b in moe} == {routing}
    assert {(b.num_experts, b.layout, b.router_name, b.experts_name) for b in moe} == {
        (4, "stacked", "gate", "experts")
    }
    with torch.device("meta"):
        skeleton = type(base)(base.config)
    assert find_moe(skeleton).summary() == moe.summary()  # what the doctor sees is what training uses
    active_before = active_matmul_parameters(base, moe)

    model, notes = make_trainable(base, lora_config(experts), False, moe)
    assert ("experts.gate_up_proj" in notes[-1]) == experts
    wrapped = set(map(id, model.modules()))
    assert all(id(b.module) in wrapped and id(b.router) in wrapped for b in moe)
    # Adapters add trainable values; the routed experts, and the adapters on them, count by their top-k share.
    lora = {n: p.numel() for n, p in model.named_parameters() if "lora_" in n}
    on_experts = sum(v for n, v in lora.items() if ".experts." in n)
    assert (on_experts > 0) == experts
    adapters = sum(lora.values()) - on_experts + on_experts * 2 / 4
    assert active_matmul_parameters(model, moe) - active_before == adapters
    # The frozen base needs forward and input-gradient FLOPs only; adapters their own gradients too.
    assert model_flops_per_token(model, moe) == 4 * active_before + 6 * adapters
    balance, note = attach_router_balance(moe, model.config, None)
    assert f"over {len(blocks)} MoE layers, top-2 routing" in note
    step = accumulate(single_engine(model), [batch_of(tokenizer)], "fp32", balance=balance)
    assert step.router_aux_loss is not None and 1.0 < step.router_aux_loss < 4.0
    router_grads = [b.router.weight.grad for b in moe]
    assert all(g is None for g in router_grads)  # routers are frozen under LoRA: the loss reaches adapters only


def test_full_fine_tuning_needs_six_flops_per_parameter_and_frozen_parts_four(tokenizer):
    model = tiny_llama(tokenizer)
    assert not model.config.tie_word_embeddings
    moe = find_moe(model)
    matmul = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    assert active_matmul_parameters(model, moe) == matmul
    assert model_flops_per_token(model, moe) == 6 * matmul
    head = model.get_output_embeddings().weight
    head.requires_grad_(False)
    assert model_flops_per_token(model, moe) == 6 * matmul - 2 * head.numel()


def test_an_embedding_beside_a_list_of_as_many_layers_is_not_a_router():
    class Table(nn.Module):
        def __init__(self):
            super().__init__()
            self.kinds = nn.Embedding(3, 8)
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    class Scorer(nn.Module):
        def __init__(self):
            super().__init__()
            self.score = nn.Linear(16, 3)  # reads another width than the list's layers
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    assert not find_moe(Table()) and not find_moe(Scorer())


def group_limited_deepseek(tokenizer):
    model = tiny_deepseek_v2(tokenizer)
    for layer in model.model.layers[1:]:
        gate = layer.mlp.gate
        gate.topk_method, gate.num_group, gate.topk_group = "group_limited_greedy", 2, 1
        with torch.no_grad():
            gate.weight.normal_(0, 1.0)
    model.config.topk_method, model.config.n_group, model.config.topk_group = "group_limited_greedy", 2, 1
    return model


def test_the_balance_loss_counts_the_experts_the_router_chose_not_a_recomputed_top_k(tokenizer):
    """DeepSeek's group-limited routing keeps the top-k inside the best expert groups: a plain softmax top-k
    picks other experts for some tokens, and with them another balance loss."""
    model = group_limited_deepseek(tokenizer)
    moe = find_moe(model)
    assert [b.routing for b in moe] == ["group-limited greedy top-2 (1 of 2 expert groups)"]
    gate = moe.blocks[0].router
    seen = []
    gate.register_forward_hook(lambda _m, _i, out: seen.append((out[0].detach(), out[2].detach())))
    balance, _ = attach_router_balance(moe, model.config, 1.0)
    batch = batch_of(tokenizer)
    with balance.capture():
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    ours = balance.loss(batch.attention_mask, batch.num_targets, batch.num_targets, lambda values: values)
    (logits, chosen), weights = seen[0], batch.attention_mask.reshape(-1).float()
    real = float(weights.sum())
    by_router = combine(*[t[None] for t in routing_stats(logits, 2, weights, chosen)], real)
    by_softmax = combine(*[t[None] for t in routing_stats(logits, 2, weights)], real)
    assert ours.item() == pytest.approx(by_router.item(), rel=1e-6)
    assert abs(by_router.item() - by_softmax.item()) > 1e-3  # the two routings really differ here
