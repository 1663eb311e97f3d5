"""Preference training (DPO and its loss family, ORPO) on the one training loop: pairs read and rendered like SFT
data, each answer's log-probability from the chunked output layer, losses equal to their definitions computed
directly from a plain forward per answer, packed pairs equal to unpacked ones, and the run through the CLI."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from tuneforge.config.schema import DataConfig, LoraSettings, PreferenceConfig
from tuneforge.data.batching import collate
from tuneforge.data.pairs import pair_conversations
from tuneforge.data.pipeline import build_split
from tuneforge.data.templates import IGNORE_INDEX, get_template
from tuneforge.errors import UserError
from tuneforge.objective.log_probs import linear_target_log_probs
from tuneforge.train.loop import accumulate_gradients
from tuneforge.train.objectives import build_objective

from conftest import (
    TINY_LLAMA,
    TUNEFORGE,
    chat,
    launch,
    single_engine,
    tiny_llama,
    train_here,
    with_lora,
    write_jsonl,
)

LOSS_TYPES = ["sigmoid", "robust", "hinge", "ipo", "sppo_hard", "nca_pair"]


def pair(i: int, prompt_as_string: bool = False) -> dict:
    prompt = f"Convert #{i:06x} to RGB." if prompt_as_string else [{"role": "user", "content": f"Convert #{i:06x}."}]
    return {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": f"({i}, {i % 7}, {i % 5})"}],
        "rejected": [{"role": "assistant", "content": f"({i + 3}, {i % 7}, 9{i})"}],
    }


def pair_data(tmp_path, tokenizer, rows: list[dict]):
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    cfg = DataConfig(train_files=[str(path)], cache_dir=None)
    return build_split("train", cfg, [str(path)], tokenizer, get_template(cfg.template), pairs=True)


def lora_model(tokenizer, seed: int = 0):
    """A tiny Llama with LoRA adapters whose B factors are not zero, so the policy differs from the reference."""
    model, _ = with_lora(tiny_llama(tokenizer, seed=seed), LoraSettings(r=4, alpha=8, dropout=0.0))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


def answer_log_prob(model, data, index: int) -> float:
    """log p(answer | prompt) of sample `index`, from a plain forward of that sample alone."""
    ids, labels = data.sample(index)
    ids, labels = torch.tensor(ids[None].astype("int64")), torch.tensor(labels.astype("int64"))
    with torch.no_grad():
        log_probs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    wanted = labels[1:]
    mask = wanted != IGNORE_INDEX
    return float(log_probs[mask].gather(1, wanted[mask][:, None]).sum())


def test_pairs_read_in_every_form_and_bad_rows_are_counted_by_reason(tmp_path, tokenizer):
    shared = {
        "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "go away"}],
    }
    rows = [
        pair(1),
        pair(2, prompt_as_string=True),
        shared,
        {"prompt": "q", "chosen": "same", "rejected": "same"},
        {"chosen": "a", "rejected": "b"},
        {"prompt": "q", "chosen": "a"},
        {"prompt": "q", "chosen": [{"role": "user", "content": "no answer"}], "rejected": "b"},
        {**shared, "prompt": "hi"},  # a prompt column beside whole conversations, repeating their first message
        {**shared, "prompt": "something else"},
    ]
    split = pair_data(tmp_path, tokenizer, rows)
    assert split.report.read == 9 and split.report.kept == 4
    counts = split.report.drops.counts
    assert counts == {
        "identical answers": 1,
        "missing prompt": 1,
        "not a pair": 1,
        "missing answer": 1,
        "conflicting prompt": 1,
    }, counts
    assert split.report.drops.examples["identical answers"] == [
        f"{tmp_path / 'pairs.jsonl'}:4: " + ("`chosen` and `rejected` are the same; the pair teaches nothing")
    ]
    assert [o.rsplit(" ", 1)[1] for o in split.data.origins] == ["(chosen)", "(rejected)"] * 4
    assert split.data.sample(6)[0].tolist() == split.data.sample(4)[0].tolist()  # the repeated prompt is not doubled
    chosen, rejected = pair_conversations(shared, "x:3")
    assert chosen.turns[-1].assistant == "hello" and rejected.turns[-1].assistant == "go away"
    assert chosen.turns[-1].user == "hi"  # the shared first message is the prompt


def test_an_answers_origin_is_found_when_the_files_path_holds_a_marker_too():
    from tuneforge.data.pairs import answer_origin

    where = "/d/prefs (rejected)/x.jsonl:3 (chosen): turn 2"
    assert answer_origin(where) == "/d/prefs (rejected)/x.jsonl:3 (chosen)"
    assert answer_origin("x.jsonl:4 (rejected)") == "x.jsonl:4 (rejected)"
    assert answer_origin("x.jsonl:5") == "x.jsonl:5"


def test_only_the_answer_trains_and_a_pair_with_a_dropped_answer_is_dropped_once(tmp_path, tokenizer):
    history = {
        "prompt": [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "HISTORY"},
            {"role": "user", "content": "second"},
        ],
        "chosen": "good",
        "rejected": "x" * 3000,  # over data.max_length: the pair goes, counted once
    }
    split = pair_data(tmp_path, tokenizer, [pair(1), {**history, "rejected": "bad"}, history])
    assert split.report.kept == 2
    assert split.report.drops.counts == {"longer than data.max_length": 1}
    assert "(rejected)" in split.report.drops.examples["longer than data.max_length"][0]
    ids, labels = split.data.sample(2)
    trained = tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])
    assert "good" in trained and "HISTORY" not in trained and "second" not in trained


def test_target_log_probs_equal_a_log_softmax_in_value_and_gradient():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(700, 16, generator=generator, requires_grad=True)
    weight = torch.randn(300, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 300, (700,), generator=generator)
    upstream = torch.randn(700, generator=generator)
    chunked = linear_target_log_probs(hidden, weight, targets, torch.float32)
    (chunked * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    direct = torch.log_softmax(hidden @ weight.T, dim=-1).gather(1, targets[:, None]).squeeze(1)
    (direct * upstream).sum().backward()
    torch.testing.assert_close(chunked, direct, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grads[1], weight.grad, atol=1e-5, rtol=1e-4)


def definition(loss_type: str, beta: float, smoothing: float, chosen: float, rejected: float) -> float:
    """Each loss from its paper's formula, on the policy/reference log-ratios of the two answers."""
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    margin = chosen - rejected
    if loss_type == "sigmoid":
        return -(1 - smoothing) * math.log(sig(beta * margin)) - smoothing * math.log(sig(-beta * margin))
    if loss_type == "robust":
        flipped = math.log(sig(-beta * margin))
        return (-(1 - smoothing) * math.log(sig(beta * margin)) + smoothing * flipped) / (1 - 2 * smoothing)
    if loss_type == "hinge":
        return max(0.0, 1 - beta * margin)
    if loss_type == "ipo":
        return (margin - 1 / (2 * beta)) ** 2
    if loss_type == "sppo_hard":
        return (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2
    if loss_type == "nca_pair":
        return (
            -math.log(sig(beta * chosen)) - 0.5 * math.log(sig(-beta * chosen)) - 0.5 * math.log(sig(-beta * rejected))
        )
    raise AssertionError(loss_type)


# The default loss in the fast tier; each other loss type's own equation in the slow one (seconds each on 2 cores).
@pytest.mark.parametrize(
    "loss_type", [t if t == "sigmoid" else pytest.param(t, marks=pytest.mark.slow) for t in LOSS_TYPES]
)
def test_the_dpo_loss_of_a_batch_equals_its_definition(tmp_path, tokenizer, loss_type):
    split = pair_data(tmp_path, tokenizer, [pair(i) for i in range(3)])
    data, model = split.data, lora_model(tokenizer)
    settings = PreferenceConfig(beta=0.5, loss_type=loss_type, label_smoothing=0.1, sft_weight=0.3)
    engine = single_engine(model)
    objective = build_objective(engine, "fp32", objective="dpo", preference=settings)
    # Pairs 0 and 1 share a row, pair 2 has its own: packing does not change what a pair contributes.
    batch = collate(data, [[0, 1, 2, 3], [4, 5]], tokenizer.pad_token_id, packed=True)
    step = accumulate_gradients(engine, [batch], objective)

    expected, rewards = [], []
    for k in range(3):
        policy = [answer_log_prob(model, data, 2 * k + side) for side in (0, 1)]
        with model.disable_adapter():
            reference = [answer_log_prob(model, data, 2 * k + side) for side in (0, 1)]
        lengths = [int((data.sample(2 * k + side)[1][1:] != IGNORE_INDEX).sum()) for side in (0, 1)]
        if loss_type == "ipo":
            policy = [p / n for p, n in zip(policy, lengths, strict=True)]
            reference = [r / n for r, n in zip(reference, lengths, strict=True)]
        chosen, rejected = policy[0] - reference[0], policy[1] - reference[1]
        nll = -policy[0] if loss_type == "ipo" else -policy[0] / lengths[0]
        expected.append(definition(loss_type, 0.5, 0.1, chosen, rejected) + 0.3 * nll)
        rewards.append((0.5 * chosen, 0.5 * rejected))
    assert step.loss == pytest.approx(sum(expected) / 3, rel=1e-4, abs=1e-5)
    assert step.metrics["rewards/chosen"] == pytest.approx(sum(c for c, _ in rewards) / 3, rel=1e-4, abs=1e-6)
    assert step.metrics["rewards/margin"] == pytest.approx(sum(c - r for c, r in rewards) / 3, rel=1e-4, abs=1e-6)
    assert step.metrics["rewards/accuracy"] == pytest.approx(sum(c > r for c, r in rewards) / 3)


def test_a_frozen_copy_as_reference_equals_the_disabled_adapters(tmp_path, tokenizer):
    """`preference.reference: model` with LoRA: a frozen copy of the base, held by the engine, gives the same
    step (loss, rewards, gradients) as the policy with its adapters disabled."""
    split = pair_data(tmp_path, tokenizer, [pair(i) for i in range(3)])
    batch = collate(split.data, [[0, 1, 2, 3], [4, 5]], tokenizer.pad_token_id, packed=True)
    steps = []
    for frozen_copy in (False, True):
        model = lora_model(tokenizer)
        engine = single_engine(model)
        reference = engine.frozen(tiny_llama(tokenizer)) if frozen_copy else None  # the same base weights
        objective = build_objective(
            engine, "fp32", objective="dpo", preference=PreferenceConfig(beta=0.5), reference_model=reference
        )
        step = accumulate_gradients(engine, [batch], objective)
        steps.append((step, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        if frozen_copy:
            assert not any(p.requires_grad for p in reference.plain.parameters())
            assert all(p.grad is None for p in reference.plain.parameters())
    (adapters, adapter_grads), (copy, copy_grads) = steps
    assert adapters.metrics["rewards/margin"] != 0  # the policy differs from the reference
    assert copy.loss == pytest.approx(adapters.loss, rel=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy"):
        assert copy.metrics[key] == pytest.approx(adapters.metrics[key], rel=1e-5, abs=1e-7), key
    assert copy_grads.keys() == adapter_grads.keys() and copy_grads
    for name, grad in adapter_grads.items():
        torch.testing.assert_close(copy_grads[name], grad, atol=1e-7, rtol=1e-5, msg=name)


def test_orpo_equals_its_definition(tmp_path, tokenizer):
    split = pair_data(tmp_path, tokenizer, [pair(i) for i in range(2)])
    data, model = split.data, lora_model(tokenizer)
    engine = single_engine(model)
    objective = build_objective(engine, "fp32", objective="orpo", preference=PreferenceConfig(orpo_lambda=0.25))
    step = accumulate_gradients(engine, [collate(data, [[0, 1], [2, 3]], tokenizer.pad_token_id, True)], objective)
    expected = []
    for k in range(2):
        means = []
        for side in (0, 1):
            tokens = int((data.sample(2 * k + side)[1][1:] != IGNORE_INDEX).sum())
            means.append(answer_log_prob(model, data, 2 * k + side) / tokens)
        odds = [m - math.log(1 - math.exp(m)) for m in means]
        expected.append(-means[0] - 0.25 * math.log(1 / (1 + math.exp(-(odds[0] - odds[1])))))
    assert step.loss == pytest.approx(sum(expected) / 2, rel=1e-4)


def test_pairs_packed_in_one_row_train_as_in_rows_of_their_own(tmp_path, tokenizer):
    split = pair_data(tmp_path, tokenizer, [pair(i) for i in range(3)])
    results = []
    for rows in ([[0, 1, 2, 3, 4, 5]], [[0, 1], [2, 3], [4, 5]]):
        model = lora_model(tokenizer)
        engine = single_engine(model)
        objective = build_objective(engine, "fp32", objective="dpo", preference=PreferenceConfig(beta=0.3))
        step = accumulate_gradients(engine, [collate(split.data, rows, tokenizer.pad_token_id, True)], objective)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((step, grads))
    (packed, packed_grads), (rows, row_grads) = results
    assert packed.loss == pytest.approx(rows.loss, rel=1e-5)
    assert packed_grads.keys() == row_grads.keys() and packed_grads
    for name in packed_grads:
        torch.testing.assert_close(packed_grads[name], row_grads[name], atol=1e-6, rtol=1e-4, msg=name)


DPO_CONFIG = (
    TINY_LLAMA.replace("tokenizer: bytes,", "tokenizer: bytes, lora: {r: 4, alpha: 8, dropout: 0.0},")
    + """data: {train_files: [pairs.jsonl], cache_dir: null}
train: {objective: dpo, lr: 1.0e-2, micro_batch_size: 2, gradient_accumulation: 2, max_steps: 6, precision: fp32}
preference: {beta: 0.5}
checkpoint: {every_steps: 3}
log: {progress: lines}
"""
)


@pytest.mark.slow
def test_dpo_through_the_cli_logs_rewards_and_resumes_exactly(tmp_path):
    write_jsonl(tmp_path / "pairs.jsonl", [pair(i) for i in range(24)])
    (tmp_path / "cfg.yaml").write_text(DPO_CONFIG)
    whole = train_here(tmp_path / "cfg.yaml", tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "x 2 pairs x 1 rank(s)" in whole.stdout and "acc " in whole.stdout
    assert "samples per step              24 pairs, 2 per global micro-batch" in whole.stdout  # not 48 answers
    records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference at the start
    assert {"rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy"} <= records[-1].keys()
    assert records[-1]["rewards/margin"] > 0 and records[-1]["loss"] < math.log(2)
    # Killed after step 3's checkpoint, resumed: the same steps as without the interruption.
    cut = launch(tmp_path / "cfg.yaml", tmp_path / "cut", "train.max_steps=6", fault="kill:0:4")
    assert cut.returncode != 0
    resumed = train_here(tmp_path / "cfg.yaml", tmp_path / "cut", "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == list(range(1, 7))
    for mine, theirs in zip(again, records, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-6)
        assert mine["rewards/margin"] == pytest.approx(theirs["rewards/margin"], abs=1e-6)


@pytest.mark.slow
def test_the_wrong_kind_of_data_stops_before_the_model_loads(tmp_path):
    from conftest import tuneforge_here

    write_jsonl(tmp_path / "pairs.jsonl", [pair(i) for i in range(4)])
    write_jsonl(tmp_path / "chats.jsonl", [chat("q", "a")])
    (tmp_path / "cfg.yaml").write_text(DPO_CONFIG)
    sft_on_pairs = tuneforge_here("data", "check", str(tmp_path / "cfg.yaml"), "train.objective=sft")
    assert sft_on_pairs.returncode != 0
    assert "pairs.jsonl:1: this row is a preference pair" in sft_on_pairs.stderr
    assert "set train.objective: dpo, orpo or reward" in sft_on_pairs.stderr
    chats = "data.train_files=[chats.jsonl]"
    dpo_on_chats = tuneforge_here("data", "check", str(tmp_path / "cfg.yaml"), chats, cwd=tmp_path)
    assert dpo_on_chats.returncode != 0
    assert "chats.jsonl:1: train.objective trains on preference pairs" in dpo_on_chats.stderr
    assert "(a openai conversation: train on it with train.objective: sft)" in dpo_on_chats.stderr
    checked = tuneforge_here("data", "check", str(tmp_path / "cfg.yaml"), cwd=tmp_path)
    assert checked.returncode == 0 and "4 records read from 1 source(s); 4 kept" in checked.stdout
    # Through the command itself once: the refusal and its exit status as users see them.
    full = subprocess.run(
        [TUNEFORGE, "train", str(tmp_path / "cfg.yaml"), "model.lora=null", "preference.reference=adapters"],
        capture_output=True,
        text=True,
    )
    assert full.returncode != 0 and "preference.reference: adapters needs model.lora" in full.stderr


@pytest.mark.parametrize("objective", ["orpo", "reward"])
def test_a_reference_setting_without_a_reference_is_refused_when_the_config_loads(tmp_path, objective):
    """ORPO and reward models have no reference model: `preference.reference` would do nothing there."""
    from conftest import tuneforge_here

    write_jsonl(tmp_path / "pairs.jsonl", [pair(i) for i in range(2)])
    (tmp_path / "cfg.yaml").write_text(DPO_CONFIG)
    refused = tuneforge_here(
        "data", "check", str(tmp_path / "cfg.yaml"), f"train.objective={objective}", "preference.reference=model"
    )
    assert refused.returncode != 0 and "train: 2 records read" not in refused.stdout
    assert (
        f"preference.reference: model does nothing with train.objective: {objective}, which has no reference model "
        "(only dpo has one); remove preference.reference, or set train.objective: dpo"
    ) in refused.stderr
    left_out = tuneforge_here("data", "check", str(tmp_path / "cfg.yaml"), f"train.objective={objective}")
    assert left_out.returncode == 0, left_out.stderr


def test_a_data_file_with_pairs_is_rejected_by_sft_in_the_library_too(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "pairs.jsonl", [pair(1)])
    cfg = DataConfig(train_files=[str(path)], cache_dir=None)
    with pytest.raises(UserError, match="this row is a preference pair"):
        build_split("train", cfg, [str(path)], tokenizer, get_template(cfg.template))


# Adam's epsilon well above float noise: with 1e-8 a gradient near zero whose sign another float order flips (2
# ranks sum in another order than 1 process; AVX-512 reduces in another order than AVX2) moves its weight by a
# whole learning rate. With 1e-3 such gradients move their weights by ~lr * g / 1e-3, while a real difference of
# 1e-6 in any gradient still shows at atol 1e-5 after the 3 steps.
PAIRED_JOB = """\
model: {model}
data: {{train_files: [pairs.jsonl], cache_dir: null}}
train: {{objective: dpo, lr: 1.0e-2, eps: 1.0e-3, warmup_steps: 1, precision: fp32, gradient_accumulation: 2,
  max_steps: 3}}
preference: {{beta: 0.5, sft_weight: 0.2}}
checkpoint: {{every_steps: 0}}
log: {{progress: lines}}
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "engine", "lora", "reference"),
    [
        ("llama", "ddp", "model.lora={r: 4, alpha: 8, dropout: 0.0}", "auto"),
        ("deepseek_v2", "zero3_offload", "model.lora={r: 4, alpha: 8, dropout: 0.0, experts: true}", "auto"),
        ("llama", "fsdp", "model.lora=null", "auto"),  # full fine-tuning: the reference precomputed over both ranks
        # A frozen copy sharded like the policy, against the one process's precomputed table: under ZeRO-3 with
        # offload its MoE blocks must be gathered whole too, or ranks routing differently wait on each other.
        ("llama", "fsdp", "model.lora=null", "model"),
        ("deepseek_v2", "zero3_offload", "model.lora=null", "model"),
        # Below ZeRO-3 the copy is a replica DeepSpeed casts as it casts the policy, against disabled adapters.
        ("llama", "zero2", "model.lora={r: 4, alpha: 8, dropout: 0.0}", "model"),
    ],
)
def test_dpo_on_two_ranks_equals_one_process(tmp_path, model, engine, lora, reference):
    """The same global batch of pairs on 2 ranks and in 1 process: the same losses, rewards and adapter. The
    MoE case is the report's set-up in small (adapters on the routed experts, ZeRO-3 with CPU offload), where the
    reference pass (adapters disabled) must not add router statistics: the router loss matches too. With
    `reference=model` the 2 ranks hold a frozen copy of the model (sharded by the engine) as the reference, the
    one process its precomputed log-probs."""
    from safetensors.torch import load_file

    from conftest import ENGINES, TINY_MODELS, metrics

    write_jsonl(tmp_path / "pairs.jsonl", [pair(i) for i in range(16)])
    config = tmp_path / "cfg.yaml"
    config.write_text(PAIRED_JOB.format(model=TINY_MODELS[model]))
    one = train_here(config, tmp_path / "one", "train.micro_batch_size=4", lora)
    assert one.returncode == 0, one.stderr[-3000:]
    two = launch(
        config,
        tmp_path / "two",
        "train.micro_batch_size=2",
        lora,
        f"preference.reference={reference}",
        *ENGINES[engine],
        ranks=2,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    if reference == "model":
        assert "dpo reference: a frozen copy of the model before training" in two.stdout
    mine, theirs = metrics(tmp_path / "two"), metrics(tmp_path / "one")
    for key in ("loss", "rewards/margin", "rewards/accuracy", *(["router_aux_loss"] if model != "llama" else [])):
        assert [r[key] for r in mine] == pytest.approx([r[key] for r in theirs], abs=1e-5), key
    weights = "adapter_model" if "lora=null" not in lora else "model"
    adapter = tmp_path / "{}" / "checkpoints" / "final" / f"{weights}.safetensors"
    one_weights, two_weights = (load_file(str(adapter).format(run)) for run in ("one", "two"))
    assert one_weights.keys() == two_weights.keys()
    for name, tensor in one_weights.items():
        torch.testing.assert_close(two_weights[name], tensor, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_in_the_reports_set_up_a_frozen_4bit_copy_equals_the_disabled_adapters(tmp_path):
    """QLoRA on a DeepseekV2 with adapters on the routed experts, ZeRO-3 with offload on 2 ranks: the reference as
    a frozen 4-bit copy of the base, partitioned by ZeRO-3 like the policy, trains exactly as the policy with
    its adapters disabled (losses, rewards and the policy's router loss). Its weights load in bf16, as QLoRA's
    usually do: the copy gets the k-bit preparation the policy's base gets (what stays in 16 bits cast to
    fp32), or its norms and embeddings would compute in bf16 where the disabled adapters' compute in fp32."""
    from test_resume import report_model_section

    from conftest import ENGINES, metrics

    write_jsonl(tmp_path / "pairs.jsonl", [pair(i) for i in range(16)])
    config = tmp_path / "cfg.yaml"
    config.write_text(
        report_model_section(dtype="bfloat16")
        + """\
data: {train_files: [pairs.jsonl], cache_dir: null}
train: {objective: dpo, lr: 1.0e-2, warmup_steps: 1, precision: fp32, micro_batch_size: 2, gradient_accumulation: 2,
  max_steps: 3}
checkpoint: {every_steps: 0, save_final: false}
log: {progress: lines}
"""
    )
    runs = {
        reference: launch(
            config, tmp_path / reference, f"preference.reference={reference}", *ENGINES["zero3_offload"], ranks=2
        )
        for reference in ("adapters", "model")
    }
    for run in runs.values():
        assert run.returncode == 0, run.stderr[-3000:]
    adapters, copy = metrics(tmp_path / "adapters"), metrics(tmp_path / "model")
    assert adapters[-1]["rewards/margin"] > 0  # the policy has moved away from its reference
    for key in ("loss", "rewards/chosen", "rewards/margin", "router_aux_loss"):
        assert [r[key] for r in copy] == pytest.approx([r[key] for r in adapters], abs=1e-6), key


@pytest.mark.slow  # three training runs (the tier guard in conftest.py)
def test_a_resumed_run_builds_its_frozen_reference_from_the_model_before_training(tmp_path):
    """Full fine-tuning with `preference.reference: model`, resumed from its step-2 checkpoint: the copy is the
    model before training again (not the checkpoint's weights), so the resumed steps equal the uninterrupted
    run's, which equal a precomputed reference's."""
    from conftest import metrics

    write_jsonl(tmp_path / "pairs.jsonl", [pair(i) for i in range(16)])
    job = DPO_CONFIG.replace("max_steps: 6", "max_steps: 4").replace("every_steps: 3", "every_steps: 2")
    (tmp_path / "cfg.yaml").write_text(job)
    full = ["model.lora=null", "preference.reference=model"]
    whole = train_here(tmp_path / "cfg.yaml", tmp_path / "whole", *full)
    assert whole.returncode == 0, whole.stderr[-3000:]
    step_2 = str(tmp_path / "whole" / "checkpoints" / "step-2")
    resumed = train_here(tmp_path / "cfg.yaml", tmp_path / "resumed", *full, "--resume", step_2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = {name: [r["loss"] for r in metrics(tmp_path / name)] for name in ("whole", "resumed")}
    assert losses["resumed"] == losses["whole"][2:]
    table = train_here(tmp_path / "cfg.yaml", tmp_path / "table", "model.lora=null")
    assert table.returncode == 0, table.stderr[-3000:]
    assert losses["whole"] == pytest.approx([r["loss"] for r in metrics(tmp_path / "table")], abs=1e-6)


@pytest.mark.slow
def test_full_fine_tuning_dpo_precomputes_its_reference_once_and_equals_a_live_one(tmp_path):
    """A precomputed reference equals the live one where both exist (LoRA: before training the adapters are
    zero, so the model is its base); full fine-tuning precomputes it into the work dir and reads it back on
    resume, which then equals the uninterrupted run."""
    write_jsonl(tmp_path / "pairs.jsonl", [pair(i) for i in range(24)])
    (tmp_path / "cfg.yaml").write_text(DPO_CONFIG.replace("max_steps: 6", "max_steps: 4"))
    live = train_here(tmp_path / "cfg.yaml", tmp_path / "live")
    table = train_here(tmp_path / "cfg.yaml", tmp_path / "table", "preference.reference=precompute")
    assert live.returncode == table.returncode == 0, table.stderr[-3000:]
    assert "dpo reference: computing the train log-probabilities" in table.stdout
    live_losses = [json.loads(line)["loss"] for line in (tmp_path / "live" / "metrics.jsonl").open()]
    table_losses = [json.loads(line)["loss"] for line in (tmp_path / "table" / "metrics.jsonl").open()]
    assert table_losses == pytest.approx(live_losses, abs=1e-6)

    full = ["model.lora=null", "checkpoint.every_steps=2"]
    whole = train_here(tmp_path / "cfg.yaml", tmp_path / "full", *full)
    assert whole.returncode == 0, whole.stderr[-3000:]
    saved = list((tmp_path / "full" / "reference").glob("train-*.safetensors"))
    assert len(saved) == 1
    cut = launch(tmp_path / "cfg.yaml", tmp_path / "cut", *full, fault="kill:0:3")
    assert cut.returncode != 0
    resumed = train_here(tmp_path / "cfg.yaml", tmp_path / "cut", *full, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "dpo reference: train log-probabilities read from" in resumed.stdout
    again = [json.loads(line)["loss"] for line in (tmp_path / "cut" / "metrics.jsonl").open()]
    first = [json.loads(line)["loss"] for line in (tmp_path / "full" / "metrics.jsonl").open()]
    assert again == pytest.approx(first, abs=1e-6) and len(again) == 4


def save_model_in_place(model, path) -> None:
    """`model`'s weights written over the file at `path` (a safetensors file of the same shapes): the same inode,
    size and modification time, only the content changed, as a copy that keeps times would leave it."""
    import os
    import tempfile

    times = path.stat()
    with tempfile.TemporaryDirectory() as other:
        model.save_pretrained(other, safe_serialization=True)
        content = (Path(other) / path.name).read_bytes()
    assert len(content) == times.st_size
    with path.open("r+b") as handle:
        handle.write(content)
    os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))


@pytest.mark.slow
def test_a_precomputed_reference_follows_the_weights_and_is_archived_with_its_run(tmp_path, tokenizer):
    """New weights at the same model path (same file, size and modification time) are not given the old
    weights' table: the step-1 loss is log 2 exactly, as when policy and reference agree. `--archive-previous`
    moves `reference/` with the run's other outputs."""
    import shutil

    from conftest import metrics

    tiny_llama(tokenizer, seed=0).save_pretrained(tmp_path / "model", safe_serialization=True)
    write_jsonl(tmp_path / "pairs.jsonl", [pair(i) for i in range(4)])
    (tmp_path / "cfg.yaml").write_text(
        f"model: {{path: {tmp_path / 'model'}, tokenizer: bytes}}\n"
        + """data: {train_files: [pairs.jsonl], cache_dir: null, max_length: 128}
train: {objective: dpo, lr: 1.0e-2, micro_batch_size: 2, max_steps: 1, precision: fp32}
checkpoint: {every_steps: 0, save_final: false}
log: {progress: lines, plot: false}
"""
    )
    first = train_here(tmp_path / "cfg.yaml", tmp_path / "first")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "dpo reference: hashing 2 model file(s)" in first.stdout  # config.json and model.safetensors
    (old_table,) = (tmp_path / "first" / "reference").glob("train-*.safetensors")

    save_model_in_place(tiny_llama(tokenizer, seed=1), tmp_path / "model" / "model.safetensors")
    shutil.copytree(tmp_path / "first" / "reference", tmp_path / "rerun" / "reference")  # a rerun's work dir
    rerun = train_here(tmp_path / "cfg.yaml", tmp_path / "rerun")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    stale = tmp_path / "rerun" / "reference" / old_table.name
    assert f"dpo reference: {stale} was computed for other model files; not used" in rerun.stdout
    assert "dpo reference: computing the train log-probabilities" in rerun.stdout
    assert metrics(tmp_path / "rerun")[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)

    archived = train_here(tmp_path / "cfg.yaml", tmp_path / "rerun", "--archive-previous")
    assert archived.returncode == 0, archived.stderr[-3000:]
    (previous,) = (tmp_path / "rerun" / "previous-runs").iterdir()
    assert f"work dir: the previous run's metrics.jsonl, diagnostics/, reference/, run.json moved to {previous}" in (
        archived.stdout
    )
    assert len(list((previous / "reference").glob("train-*.safetensors"))) == 2
    assert "dpo reference: computing the train log-probabilities" in archived.stdout
    assert metrics(tmp_path / "rerun")[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_validation_over_held_out_pairs_counts_each_pair_once(tmp_path, tokenizer):
    """Held-out pairs are batched like training pairs (a pair's answers in one row), rows repeated to give every
    rank a batch are not counted, and the mean over pairs equals the loss of all of them in one batch."""
    from tuneforge.distributed import Layout
    from tuneforge.train.validate import validation_batches, validation_loss

    split = pair_data(tmp_path, tokenizer, [pair(i) for i in range(3)])
    engine = single_engine(lora_model(tokenizer))
    objective = build_objective(engine, "fp32", objective="dpo", preference=PreferenceConfig(beta=0.5))
    batches = list(validation_batches(split.data, 2, tokenizer.pad_token_id, Layout(), False, 1024, group=2))
    assert sorted(b.num_samples for b in batches) == [2, 4]
    result = validation_loss(engine, batches, objective)
    whole = accumulate_gradients(engine, [collate(split.data, [[0, 1], [2, 3], [4, 5]], 0, True)], objective)
    engine.optimizer.zero_grad(set_to_none=True)
    assert result.units == 3
    assert result.loss == pytest.approx(whole.loss, rel=1e-5)
    assert result.metrics["rewards/margin"] == pytest.approx(whole.metrics["rewards/margin"], rel=1e-5, abs=1e-7)
    # Two ranks: the second rank's share of the last batch is a repeated pair, masked and not counted.
    last_rank = list(validation_batches(split.data, 1, 0, Layout.of(1, 2, 1), False, 1024, group=2))
    assert sorted(objective.count(b) for b in last_rank) == [0, 1]


@pytest.mark.slow
def test_the_dpo_demo_config_trains_and_validates(tmp_path):
    from conftest import REPO

    result = train_here(REPO / "configs" / "demo_dpo.yaml", tmp_path / "run", "train.max_steps=2", "eval.every_steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    record = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()][-1]
    assert {"val_loss", "val_rewards/accuracy", "rewards/margin"} <= record.keys()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("objective", "lora", "engine"),
    [
        ("dpo", "model.lora={r: 4, alpha: 8, dropout: 0.0}", "ddp"),
        ("dpo", "model.lora=null", "fsdp"),  # full fine-tuning: the precomputed reference split too
        ("reward", "model.lora={r: 4, alpha: 8, dropout: 0.0}", "ddp"),
    ],
)
def test_pairs_split_across_two_ranks_equal_one_process_with_whole_rows(tmp_path, objective, lora, engine):
    """Sequence parallelism 2: each row of pairs split in half across the ranks, an answer's log-probability
    (a conversation's score) the sum of both halves' parts: the same losses, rewards and weights as one process."""
    from test_sequence_parallel import assert_same_weights

    from conftest import ENGINES, TINY_MODELS, metrics

    write_jsonl(tmp_path / "pairs.jsonl", [pair(i) for i in range(16)])
    config = tmp_path / "cfg.yaml"
    config.write_text(PAIRED_JOB.format(model=TINY_MODELS["llama"]))
    settings = ["train.micro_batch_size=2", f"train.objective={objective}", lora]
    one = train_here(config, tmp_path / "one", *settings)
    assert one.returncode == 0, one.stderr[-3000:]
    split = ["parallel.sequence_parallel=2", *ENGINES[engine]]
    two = launch(config, tmp_path / "two", *settings, *split, ranks=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "sequence parallel: each row split across 2 ranks" in two.stdout
    mine, theirs = metrics(tmp_path / "two"), metrics(tmp_path / "one")
    for key in ("loss", "rewards/margin", "rewards/accuracy"):
        assert [r[key] for r in mine] == pytest.approx([r[key] for r in theirs], abs=1e-5), key
    weights = "adapter_model" if "lora=null" not in lora else "model"
    assert_same_weights(tmp_path / "one", tmp_path / "two", f"{weights}.safetensors")
