"""Online RL's contract against hand computation: group advantages, each loss type's normalisation, clipping,
the KL estimate, the rewards, prompt records, and a rollout's rows on a tiny real model."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tuneforge.config.schema import DataConfig, RewardSpec, RLConfig
from tuneforge.data.batching import collate
from tuneforge.data.conversation import SampleError
from tuneforge.data.pipeline import prepare_data
from tuneforge.data.prompts import to_prompt
from tuneforge.data.templates import IGNORE_INDEX, get_template
from tuneforge.errors import UserError
from tuneforge.objective.group_relative import GroupRelativePolicy, group_advantages, policy_loss
from tuneforge.objective.rewards import build_rewards
from tuneforge.rollout_samplers import TransformersSampler


def test_group_advantages_sum_to_zero_and_scale_as_asked():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, 1.0, 2.0, 2.0]])
    plain = group_advantages(rewards, "none")
    torch.testing.assert_close(plain.sum(dim=1), torch.zeros(3))
    torch.testing.assert_close(plain[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert (plain[1] == 0).all()  # a group rewarded alike teaches nothing
    by_group = group_advantages(rewards, "group")
    torch.testing.assert_close(by_group[0], plain[0] / (rewards[0].std() + 1e-4))
    torch.testing.assert_close(group_advantages(rewards, "batch"), plain / (rewards.std() + 1e-4))
    # Leave-one-out: each against the mean of the other three.
    loo = group_advantages(rewards, "none", "rloo")
    torch.testing.assert_close(loo[2], torch.tensor([3 - 5 / 3, 1 - 7 / 3, 2 - 2.0, 2 - 2.0]))


def flat(log_probs: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.tensor([v for row in log_probs for v in row], requires_grad=True)
    completion = torch.tensor([i for i, row in enumerate(log_probs) for _ in row])
    return values, completion


@pytest.mark.parametrize(
    ("loss_type", "expected"),
    [
        # One update per rollout: the ratio is one and each token's term is -A.
        ("dapo", -(2 * 1.0 + 3 * -0.5)),  # summed over tokens (the step divides by its tokens)
        ("grpo", -(1.0 + -0.5)),  # each completion's mean, summed over completions
        ("rloo", -(1.0 + -0.5)),
        ("gspo", -(1.0 + -0.5)),
        ("dr_grpo", -(2 * 1.0 + 3 * -0.5) / 8),  # over the longest allowed completion, 8 tokens
    ],
)
def test_each_loss_type_reduces_as_it_says(loss_type, expected):
    log_probs, completion = flat([[-1.0, -2.0], [-0.5, -0.1, -3.0]])
    advantages = torch.tensor([1.0, -0.5])
    result = policy_loss(log_probs, log_probs.detach(), advantages, completion, loss_type, 0.2, 0.28, 8)
    assert float(result.loss) == pytest.approx(expected)
    assert float(result.clipped) == 0 and float(result.kl) == 0
    result.loss.backward()
    # The plain policy gradient: -A on each token's log-probability, weighted by the loss type's reduction.
    weights = {"dapo": [1, 1, 1, 1, 1], "dr_grpo": [1 / 8] * 5}.get(loss_type, [1 / 2, 1 / 2, 1 / 3, 1 / 3, 1 / 3])
    gains = [-1.0, -1.0, 0.5, 0.5, 0.5]
    torch.testing.assert_close(log_probs.grad, torch.tensor([g * w for g, w in zip(gains, weights, strict=True)]))


def test_a_ratio_beyond_its_clip_stops_its_tokens_gradient():
    log_probs, completion = flat([[0.0, 0.0]])
    old = torch.tensor([-0.5, 0.0])  # the first token's ratio is e^0.5 = 1.65 > 1 + 0.28
    result = policy_loss(log_probs, old, torch.tensor([1.0]), completion, "dapo", 0.2, 0.28, 8)
    assert float(result.clipped) == 1
    assert float(result.loss) == pytest.approx(-(1.28 + 1.0))
    result.loss.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([0.0, -1.0]))
    # A negative advantage: the ratio is clipped below (0.6 < 1 - 0.2), not above.
    log_probs, completion = flat([[-0.5]])
    low = policy_loss(log_probs, torch.tensor([0.0]), torch.tensor([-1.0]), completion, "dapo", 0.2, 0.28, 8)
    assert float(low.clipped) == 1 and float(low.loss) == pytest.approx(0.8)


def test_the_kl_estimate_is_zero_where_policy_and_reference_agree():
    log_probs, completion = flat([[-1.0, -2.0]])
    same = policy_loss(
        log_probs, log_probs.detach(), torch.tensor([0.0]), completion, "dapo", 0.2, 0.2, 8, log_probs.detach(), 0.1
    )
    assert float(same.kl) == 0 and float(same.loss) == 0
    apart = policy_loss(
        log_probs,
        log_probs.detach(),
        torch.tensor([0.0]),
        completion,
        "dapo",
        0.2,
        0.2,
        8,
        torch.tensor([-1.5, -2.0]),
        0.1,
    )
    # k3: exp(d) - d - 1 with d = ref - logp = -0.5 on the first token.
    k3 = torch.exp(torch.tensor(-0.5)) + 0.5 - 1
    assert float(apart.kl) == pytest.approx(float(k3)) and float(apart.loss) == pytest.approx(0.1 * float(k3))


def test_the_built_in_rewards(tmp_path, monkeypatch):
    specs = [
        RewardSpec(kind="exact_match"),
        RewardSpec(kind="numeric"),
        RewardSpec(kind="regex", pattern=r"^\(\d+, \d+, \d+\)$"),
        RewardSpec(kind="json"),
        RewardSpec(kind="length", target_length=10),
    ]
    rewards = build_rewards(specs)
    assert [r.name for r in rewards] == ["exact_match", "numeric", "regex", "json", "length"]
    completions = [" (1, 2, 3) ", "the answer is 1,234.0", '{"a": 1}']
    answers = ["(1, 2, 3)", "1234", "x"]
    assert [r.score(completions, answers) for r in rewards] == [
        [1.0, 0.0, 0.0],
        [1.0, 1.0, 0.0],
        [0.0, 0.0, 0.0],  # the regex sees the completion as written, spaces included
        [0.0, 0.0, 1.0],
        [pytest.approx(0.9), 0.0, pytest.approx(0.8)],  # 11, 21 and 8 characters against 10
    ]


def test_a_python_reward_runs_only_when_the_command_line_allows_it(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def short(completions, answers):\n    return [len(c) < 3 for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = RewardSpec(kind="python", function="my_rewards:short")
    with pytest.raises(UserError, match="runs code; pass --allow-reward-code"):
        build_rewards([spec])
    assert "my_rewards" not in sys.modules  # refused before anything was imported
    (reward,) = build_rewards([spec], allow_code=True)
    assert reward.score(["ab", "abcd"], ["", ""]) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("record", "user", "answer"),
    [
        ({"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}, "2+2?", "4"),
        (
            {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], "answer": 4},
            "2+2?",
            "4",
        ),
        ({"prompt": "Name a colour", "answer": "red"}, "Name a colour", "red"),
    ],
)
def test_prompt_records(record, user, answer):
    conversation, got = to_prompt(record, "f.jsonl:1")
    assert conversation.turns[-1].user == user and conversation.turns[-1].assistant is None and got == answer


def test_prompt_records_without_an_answer_or_a_question_are_refused():
    with pytest.raises(SampleError, match="no answer"):
        to_prompt({"prompt": "x"}, "f:1")
    with pytest.raises(SampleError, match="no prompt"):
        to_prompt({"messages": [{"role": "assistant", "content": "x"}], "answer": "y"}, "f:1")


def test_prompts_are_prepared_with_their_answers_and_the_too_long_counted(tmp_path, tokenizer):
    path = tmp_path / "p.jsonl"
    records = [{"prompt": "#00ff00", "answer": "(0, 255, 0)"}, {"prompt": "x" * 90, "answer": "y"}, {"prompt": "q"}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    config = DataConfig(train_files=[str(path)], cache_dir=str(tmp_path / "cache"))
    for _ in range(2):  # built, then read back from the cache
        data = prepare_data(config, tokenizer, get_template(None), prompt_room=64)
        split = data.train.data
        assert split.answers == ["(0, 255, 0)"] and (split.labels == IGNORE_INDEX).all()
        assert data.train.report.drops.counts == {"longer than data.max_length": 1, "no answer": 1}


def one_rank_policy(forward, settings: RLConfig, tokenizer, answers: list[str], target_length: int):
    """GRPO as one process runs it, rewarding completions by their closeness to `target_length` characters."""
    rewards = build_rewards([RewardSpec(kind="length", target_length=target_length)])
    stops, stop_ids = [tokenizer.eos_token], [tokenizer.eos_token_id]
    sampler = TransformersSampler(forward.plain, settings, stop_ids, tokenizer.pad_token_id, forward.precision, False)
    return GroupRelativePolicy(forward, settings, rewards, answers, tokenizer, stops, sampler, lambda v: [v])


def test_a_rollout_turns_each_prompt_into_its_groups_rows(tokenizer):
    from tuneforge.objective.forward import TokenForward

    from conftest import tiny_llama

    model = tiny_llama(tokenizer)
    settings = RLConfig(generations=3, max_completion_tokens=6, loss_type="grpo")
    prompts = [tokenizer("#00ff00\n", add_special_tokens=False)["input_ids"], tokenizer("hi\n")["input_ids"]]
    from tuneforge.data.tokenize import TokenizedData

    data = TokenizedData.from_samples([(p, [IGNORE_INDEX] * len(p), f"p{i}") for i, p in enumerate(prompts)])
    batch = collate(data, [[0], [1]], tokenizer.pad_token_id, False)
    policy = one_rank_policy(TokenForward(model, model, "fp32"), settings, tokenizer, ["a", "b"], 4)
    torch.manual_seed(0)
    made = policy.prepare_step([batch], 1)
    (rows,) = made.micro_batches
    assert rows.input_ids.size(0) == 6 and rows.advantages.shape == (6,)
    torch.testing.assert_close(rows.advantages.view(2, 3).sum(dim=1), torch.zeros(2), atol=1e-5, rtol=0)
    for row in range(6):
        prompt = prompts[row // 3]
        assert rows.input_ids[row, : len(prompt)].tolist() == prompt
        targets = rows.targets[row][rows.targets[row] != IGNORE_INDEX]
        completion = rows.input_ids[row, len(prompt) : len(prompt) + len(targets)]
        assert targets.tolist() == completion.tolist() and 1 <= len(targets) <= 6
    assert rows.global_samples == 6 and rows.global_targets == rows.num_targets
    assert {"reward", "reward_std", "reward/length", "frac_reward_zero_std", "completion_length"} <= made.figures.keys()
    loss, metrics = policy.evaluate(rows, None)
    assert torch.isfinite(loss) and float(metrics["clip_ratio"]) == 0


def test_the_math_reward_compares_answers_by_value():
    (reward,) = build_rewards([RewardSpec(kind="math")])
    completions = ["so the answer is $\\frac{1}{2}$", "x = 0.5", "it is 3", "no idea"]
    assert reward.score(completions, ["0.5", "$\\frac{1}{2}$", "4", "1"]) == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("fuse", [True, False], ids=["fused-output-layer", "model-logits"])
def test_the_loss_takes_log_probabilities_at_the_sampling_temperature(tokenizer, fuse):
    """Completions sampled at temperature T come from softmax(logits / T); the policy gradient is taken under that
    distribution (as TRL does), not the untempered one, through both ways the log-probabilities are computed."""
    from tuneforge.data.tokenize import TokenizedData
    from tuneforge.model.attention import model_inputs
    from tuneforge.objective.forward import TokenForward

    from conftest import tiny_llama

    model = tiny_llama(tokenizer)
    temperature = 0.5
    settings = RLConfig(generations=4, max_completion_tokens=5, temperature=temperature, loss_type="dapo")
    prompt = tokenizer("#00ff00\n", add_special_tokens=False)["input_ids"]
    data = TokenizedData.from_samples([(prompt, [IGNORE_INDEX] * len(prompt), "p0")])
    batch = collate(data, [[0]], tokenizer.pad_token_id, False)
    policy = one_rank_policy(TokenForward(model, model, "fp32", fuse=fuse), settings, tokenizer, ["a"], 3)
    torch.manual_seed(0)
    (rows,) = policy.prepare_step([batch], 1).micro_batches
    rows.advantages = torch.tensor([1.0, -0.5, 0.3, -0.8])  # some advantage to follow, whatever was sampled
    loss, _ = policy.evaluate(rows, None)
    loss.backward()
    got = model.lm_head.weight.grad.clone()
    model.zero_grad()
    logits = model(**model_inputs(model, rows, torch.device("cpu"))).logits / temperature
    mask = rows.targets != IGNORE_INDEX
    log_probs = torch.log_softmax(logits, dim=-1).gather(2, rows.targets.clamp(min=0)[..., None]).squeeze(2)[mask]
    completion = torch.arange(rows.targets.size(0))[:, None].expand_as(mask)[mask]
    (-(rows.advantages[completion] * log_probs).sum()).backward()  # dapo at ratio one: -sum of A x log p
    torch.testing.assert_close(got, model.lm_head.weight.grad, atol=1e-5, rtol=1e-4)


def test_a_later_update_takes_its_ratio_against_the_sampling_policys_log_probs(tokenizer):
    """With several updates per rollout the rollout keeps the sampling policy's log-probabilities; an update whose
    policy gives its tokens more probability than that (ratio above 1 + epsilon_high) at a positive advantage is
    clipped, and those tokens pass no gradient."""
    from tuneforge.data.tokenize import TokenizedData
    from tuneforge.objective.forward import TokenForward

    from conftest import tiny_llama

    model = tiny_llama(tokenizer)
    settings = RLConfig(generations=2, max_completion_tokens=4, updates_per_rollout=2, loss_type="dapo")
    prompt = tokenizer("#00ff00\n", add_special_tokens=False)["input_ids"]
    data = TokenizedData.from_samples([(prompt, [IGNORE_INDEX] * len(prompt), "p0")])
    forward = TokenForward(model, model, "fp32")
    policy = one_rank_policy(forward, settings, tokenizer, ["a"], 3)
    torch.manual_seed(0)
    (rows,) = policy.prepare_step([collate(data, [[0]], tokenizer.pad_token_id, False)], 1).micro_batches
    with torch.no_grad():
        current = forward.target_log_probs(rows)
    torch.testing.assert_close(rows.old_log_probs, current)  # taken at the rollout, before any update
    rows.advantages = torch.tensor([1.0, 1.0])
    rows.old_log_probs = current - 0.5  # the policy has since raised every token's probability by e^0.5
    loss, metrics = policy.evaluate(rows, None)
    assert float(metrics["clip_ratio"]) == rows.num_targets  # every token clipped (a sum over tokens for dapo)
    loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize("fuse", [True, False], ids=["fused-output-layer", "model-logits"])
def test_the_entropy_figure_is_the_policys_at_the_completion_tokens(tokenizer, fuse):
    from tuneforge.model.attention import model_inputs
    from tuneforge.objective.forward import TokenForward

    from conftest import tiny_llama

    model = tiny_llama(tokenizer)
    ids = tokenizer(["#00ff00\n(0, 255, 0)", "#0000ff\n(0, 0, 255)"], add_special_tokens=False)["input_ids"]
    from tuneforge.data.tokenize import TokenizedData

    data = TokenizedData.from_samples([(row, list(row), f"r{i}") for i, row in enumerate(ids)])  # all trained
    batch = collate(data, [[0, 1]], tokenizer.pad_token_id, False)
    log_probs, entropy = TokenForward(model, model, "fp32", fuse=fuse).target_log_probs_and_entropy(batch, 0.7)
    with torch.no_grad():
        logits = model(**model_inputs(model, batch, torch.device("cpu"))).logits / 0.7
    distribution = torch.log_softmax(logits, dim=-1)[batch.targets != IGNORE_INDEX]
    expected = -(distribution.exp() * distribution).sum(dim=-1)
    torch.testing.assert_close(entropy, expected, atol=1e-5, rtol=1e-5)
    assert not entropy.requires_grad and log_probs.requires_grad


def test_a_reward_model_is_checked_when_the_rewards_are_built(tmp_path, tokenizer):
    """Named by the config, a reward model is read as weights only; what is not one is refused before anything
    loads, with the fix."""
    from tuneforge.train.reward_model import reward_model_scorer

    with pytest.raises(ValueError, match="a model reward needs `path`"):
        RewardSpec(kind="model")
    with pytest.raises(UserError, match="is not a directory"):
        build_rewards([RewardSpec(kind="model", path=str(tmp_path / "missing"))], models=reward_model_scorer)
    from conftest import tiny_llama

    tiny_llama(tokenizer).save_pretrained(tmp_path / "causal")
    with pytest.raises(UserError, match=r"is not a reward model .*train\.objective: reward"):
        build_rewards([RewardSpec(kind="model", path=str(tmp_path / "causal"))], models=reward_model_scorer)
