"""Reward models (`train.objective: reward`): a scalar score per conversation from transformers' sequence
classification form of the network, trained to rank each pair's chosen answer first. The loss of a batch equals
its definition computed from transformers' own scoring of each conversation alone (so the score is read where
an exported model reads it), packed pairs equal unpacked ones, and a trained model exported through the CLI
scores conversations in `AutoModelForSequenceClassification` as tuneforge did."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from test_preference import pair, pair_data
from tuneforge.config.schema import PreferenceConfig
from tuneforge.data.batching import collate
from tuneforge.train.loop import accumulate_gradients
from tuneforge.train.objectives import build_objective

from conftest import (
    TINY_DENSE,
    TINY_LLAMA,
    launch,
    single_engine,
    tiny_llama,
    train_here,
    tuneforge_here,
    write_jsonl,
)


def tiny_reward_model(tokenizer, seed: int = 0) -> LlamaForSequenceClassification:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), **TINY_DENSE, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():  # scores spread enough that the penalties and the focal weight matter
        model.score.weight.mul_(40)
    return model


def transformers_score(model, data, index: int) -> float:
    """The conversation's score as transformers computes it, the conversation alone in its batch."""
    ids, _ = data.sample(index)
    with torch.no_grad():
        return float(model(input_ids=torch.tensor(ids[None].astype("int64"))).logits[0, 0])


def definition(loss_type: str, penalty: str, weight: float, chosen: float, rejected: float) -> float:
    p = 1 / (1 + math.exp(-(chosen - rejected)))
    loss = -math.log(p) * ((1 - 2 * max(0.0, p - 0.5)) ** 2 if loss_type == "focal" else 1.0)
    for score in (chosen, rejected):
        if penalty == "log_barrier":
            inside = min(max(score, -5 + 1e-3), 5 - 1e-3)
            loss += weight * (-math.log(5 - inside) - math.log(inside + 5))
        elif penalty == "l2":
            loss += weight * score**2
    return loss


@pytest.mark.parametrize(("loss_type", "penalty"), [("ranking", "none"), ("focal", "log_barrier"), ("ranking", "l2")])
def test_the_reward_loss_of_a_batch_equals_its_definition_from_transformers_own_scores(
    tmp_path, tokenizer, loss_type, penalty
):
    data = pair_data(tmp_path, tokenizer, [pair(i) for i in range(3)]).data
    model = tiny_reward_model(tokenizer)
    engine = single_engine(model)
    settings = PreferenceConfig(reward_loss=loss_type, penalty=penalty, penalty_weight=0.05)
    objective = build_objective(engine, "fp32", objective="reward", preference=settings)
    # Pairs 0 and 1 share a row, pair 2 has its own.
    step = accumulate_gradients(
        engine, [collate(data, [[0, 1, 2, 3], [4, 5]], tokenizer.pad_token_id, True)], objective
    )
    scores = [(transformers_score(model, data, 2 * k), transformers_score(model, data, 2 * k + 1)) for k in range(3)]
    assert any(abs(c) > 1 for c, _ in scores)  # the penalties see scores of some size
    expected = sum(definition(loss_type, penalty, 0.05, c, r) for c, r in scores) / 3
    assert step.loss == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert step.metrics["rewards/chosen"] == pytest.approx(sum(c for c, _ in scores) / 3, rel=1e-4, abs=1e-5)
    assert step.metrics["rewards/margin"] == pytest.approx(sum(c - r for c, r in scores) / 3, rel=1e-4, abs=1e-5)
    assert step.metrics["rewards/accuracy"] == pytest.approx(sum(c > r for c, r in scores) / 3)
    assert not model.score._forward_hooks  # the score hook lives only while scores are taken


def test_pairs_packed_in_one_row_score_and_train_as_in_rows_of_their_own(tmp_path, tokenizer):
    data = pair_data(tmp_path, tokenizer, [pair(i) for i in range(2)]).data
    results = []
    for rows, packed in (([[0, 1, 2, 3]], True), ([[0], [1], [2], [3]], False)):
        model = tiny_reward_model(tokenizer)
        engine = single_engine(model)
        objective = build_objective(engine, "fp32", objective="reward", preference=PreferenceConfig())
        step = accumulate_gradients(engine, [collate(data, rows, tokenizer.pad_token_id, packed)], objective)
        results.append((step.loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (packed_loss, packed_grads), (plain_loss, plain_grads) = results
    assert packed_loss == pytest.approx(plain_loss, rel=1e-5)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, plain_grads[name], atol=1e-5, rtol=1e-4, msg=name)


REWARD_JOB = (
    TINY_LLAMA
    + """data: {train_files: [pairs.jsonl], validation_files: [held.jsonl], cache_dir: null}
train: {objective: reward, lr: 3.0e-3, micro_batch_size: 4, max_steps: 12, precision: fp32}
preference: {reward_loss: focal, penalty: l2, penalty_weight: 0.01}
eval: {every_steps: 6}
checkpoint: {every_steps: 0}
log: {progress: lines, plot: false}
"""
)


def scores_of(model, tokenizer, conversations: list[list[int]]) -> list[float]:
    """Scores of token sequences, padded together in one batch (on the right, as transformers expects)."""
    width = max(map(len, conversations))
    ids = torch.tensor([c + [tokenizer.pad_token_id] * (width - len(c)) for c in conversations])
    with torch.no_grad():
        return model(input_ids=ids).logits[:, 0].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_a_reward_model_trained_through_the_cli_exports_a_sequence_classifier_that_scores_the_same(tmp_path, lora):
    from peft import AutoPeftModelForSequenceClassification
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    write_jsonl(tmp_path / "pairs.jsonl", [pair(i) for i in range(48)])
    write_jsonl(tmp_path / "held.jsonl", [pair(i) for i in range(100, 108)])
    (tmp_path / "cfg.yaml").write_text(REWARD_JOB)
    run = train_here(tmp_path / "cfg.yaml", tmp_path / "run", *(["model.lora={r: 4, alpha: 8}"] if lora else []))
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracy", "val_rewards/accuracy"} <= records[-1].keys()
    assert records[-1]["rewards/accuracy"] > 0.5 and records[-1]["loss"] < records[0]["loss"]

    final, out = tmp_path / "run" / "checkpoints" / "final", tmp_path / "exported"
    exported = tuneforge_here("export", str(final), "--out", str(out), "--merge")
    assert exported.returncode == 0, exported.stderr
    assert "reward model (" in exported.stdout
    tokenizer = AutoTokenizer.from_pretrained(out)
    data = pair_data(tmp_path, tokenizer, [pair(i) for i in range(100, 103)]).data
    conversations = [data.sample(k)[0].tolist() for k in range(6)]
    merged = AutoModelForSequenceClassification.from_pretrained(out).eval()
    if lora:  # the adapters as PEFT loads them, score head included
        trained = AutoPeftModelForSequenceClassification.from_pretrained(final).eval()
    else:
        trained = AutoModelForSequenceClassification.from_pretrained(final).eval()
    expected = scores_of(trained, tokenizer, conversations)
    assert scores_of(merged, tokenizer, conversations) == pytest.approx(expected, abs=1e-5)
    # tuneforge's own scoring of the same conversations, packed in one row, agrees.
    model = trained.merge_and_unload() if lora else trained
    objective = build_objective(single_engine(model), "fp32", objective="reward", preference=PreferenceConfig())
    ours = objective.scores(collate(data, [list(range(6))], tokenizer.pad_token_id, True)).tolist()
    assert ours == pytest.approx(expected, abs=1e-5)
    chat = tuneforge_here("chat", str(final), "--prompt", "hi")
    assert chat.returncode == 2 and "a reward model (train.objective: reward) scores conversations" in chat.stderr


@pytest.mark.slow
def test_lora_reward_adapters_of_a_published_model_load_in_peft_as_the_readme_says(tmp_path, tokenizer):
    """A base saved as published chat models are (a causal LM's config: no label count, no pad token): PEFT's
    `AutoPeftModelForSequenceClassification` builds the base from the config the adapters name, so that config
    must say one label and the pad token, or the score head does not load (two rows) and scores are read
    elsewhere. The user's model directory is left as it was."""
    from peft import AutoPeftModelForSequenceClassification

    from tuneforge.trained import load_trained

    base = tiny_llama(tokenizer)
    base.config.pad_token_id = None
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    published = (tmp_path / "base" / "config.json").read_text()
    write_jsonl(tmp_path / "pairs.jsonl", [pair(i) for i in range(8)])
    (tmp_path / "cfg.yaml").write_text(
        f"model: {{path: {tmp_path / 'base'}, lora: {{r: 4, alpha: 8}}}}\n"
        + """data: {train_files: [pairs.jsonl], cache_dir: null, max_length: 256}
train: {objective: reward, lr: 1.0e-2, micro_batch_size: 4, max_steps: 2, precision: fp32}
checkpoint: {every_steps: 0}
log: {progress: lines, plot: false}
"""
    )
    run = train_here(tmp_path / "cfg.yaml", tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    final = tmp_path / "run" / "checkpoints" / "final"

    loaded = AutoPeftModelForSequenceClassification.from_pretrained(final).eval()  # the README's call, as it is
    ours = load_trained(final).model
    data = pair_data(tmp_path / "run", tokenizer, [pair(i) for i in range(100, 103)]).data
    conversations = [data.sample(k)[0].tolist() for k in range(6)]  # of several lengths: padded in one batch
    expected = scores_of(ours, tokenizer, conversations)
    assert scores_of(loaded, tokenizer, conversations) == pytest.approx(expected, abs=1e-5)
    objective = build_objective(single_engine(ours), "fp32", objective="reward", preference=PreferenceConfig())
    packed = objective.scores(collate(data, [list(range(6))], tokenizer.pad_token_id, True)).tolist()
    assert packed == pytest.approx(expected, abs=1e-5)  # where training reads each score
    assert (tmp_path / "base" / "config.json").read_text() == published


@pytest.mark.slow
def test_a_reward_model_in_the_reports_set_up_on_two_ranks_equals_one_process(tmp_path):
    """4-bit DeepseekV2, adapters on the routed experts, ZeRO-3 with CPU offload, 2 ranks: the same losses,
    accuracies, router loss and adapters (score head included) as one process with the same global batch."""
    from safetensors.torch import load_file

    from test_resume import report_model_section

    from conftest import ENGINES, metrics, train_here

    write_jsonl(tmp_path / "pairs.jsonl", [pair(i) for i in range(16)])
    config = tmp_path / "cfg.yaml"
    config.write_text(
        report_model_section()
        + """\
data: {train_files: [pairs.jsonl], cache_dir: null}
train: {objective: reward, lr: 1.0e-2, warmup_steps: 1, precision: fp32, gradient_accumulation: 2, max_steps: 3}
checkpoint: {every_steps: 0}
log: {progress: lines}
"""
    )

    one = train_here(config, tmp_path / "one", "train.micro_batch_size=4")
    assert one.returncode == 0, one.stderr[-3000:]
    assert "model: DeepseekV2ForSequenceClassification" in one.stdout and "chat with it" not in one.stdout
    lora_line = next(line for line in one.stdout.splitlines() if line.startswith("lora: "))
    assert "experts.gate_up_proj" in lora_line and "score" not in lora_line  # the head trains whole, not by LoRA
    two = launch(config, tmp_path / "two", "train.micro_batch_size=2", *ENGINES["zero3_offload"], ranks=2)
    assert two.returncode == 0, two.stderr[-3000:]
    mine, theirs = metrics(tmp_path / "two"), metrics(tmp_path / "one")
    for key in ("loss", "rewards/margin", "rewards/accuracy", "router_aux_loss"):
        assert [r[key] for r in mine] == pytest.approx([r[key] for r in theirs], abs=1e-5), key
    adapter = tmp_path / "{}" / "checkpoints" / "final" / "adapter_model.safetensors"
    one_weights, two_weights = (load_file(str(adapter).format(run)) for run in ("one", "two"))
    assert one_weights.keys() == two_weights.keys() and any(".score." in name for name in one_weights)
    # Adam divides each gradient by its own running size, so summation-order noise in near-zero gradients moves
    # a weight by up to a few lr * 1e-3 (lr 1e-2 here): 1e-4 is far below any real difference (a step is 1e-2).
    for name, tensor in one_weights.items():
        torch.testing.assert_close(two_weights[name], tensor, atol=1e-4, rtol=1e-4, msg=name)


def test_a_reward_checkpoint_is_told_by_its_files_and_damaged_ones_are_left_to_the_loader(tmp_path):
    from tuneforge.trained import is_reward_model

    cases = {
        "full": ("config.json", '{"architectures": ["LlamaForSequenceClassification"]}', True),
        "causal": ("config.json", '{"architectures": ["LlamaForCausalLM"]}', False),
        "odd": ("config.json", '{"architectures": "LlamaForSequenceClassification"}', False),
        "damaged": ("config.json", "{not json", False),
        "adapter": ("adapter_config.json", '{"task_type": "SEQ_CLS"}', True),
        "damaged-adapter": ("adapter_config.json", "[", False),
    }
    for name, (file, text, expected) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / file).write_text(text)
        assert is_reward_model(tmp_path / name) is expected, name
