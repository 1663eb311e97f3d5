"""Keyed sampling: each completion's draws come from its own key, so a rollout does not depend on which rank
samples it or beside which prompts; and the draws follow the distribution at the temperature within top-p."""

from __future__ import annotations

import pytest
import torch

from tuneforge.errors import UserError
from tuneforge.generate import sample_completions
from tuneforge.keyed_sampling import completion_keys, draw, uniforms

from conftest import tiny_llama


def test_the_uniforms_are_uniform_and_differ_by_every_part_of_the_key():
    keys = completion_keys(seed=0, step=1, sample_indices=list(range(5000)), generations=4)
    assert keys.unique().numel() == keys.numel()
    values = uniforms(keys, 0)
    assert float(values.min()) > 0 and float(values.max()) < 1
    histogram = torch.histc(values, bins=10, min=0, max=1) / values.numel()
    torch.testing.assert_close(histogram, torch.full((10,), 0.1), atol=0.01, rtol=0)
    # Position, step, seed and generation each change the draws.
    for other in (
        uniforms(keys, 1),
        uniforms(completion_keys(0, 2, list(range(5000)), 4), 0),
        uniforms(completion_keys(1, 1, list(range(5000)), 4), 0),
    ):
        assert float((other == values).float().mean()) < 0.01
    assert not torch.equal(values.view(5000, 4)[:, 0], values.view(5000, 4)[:, 1])


@pytest.mark.parametrize(
    ("temperature", "top_p", "expected"),
    [
        (1.0, 1.0, [0.5, 0.3, 0.2]),
        (1.0, 0.6, [0.5 / 0.8, 0.3 / 0.8, 0.0]),  # the nucleus: the likeliest tokens holding 0.6
        (2.0, 1.0, None),  # softmax(log p / 2)
    ],
)
def test_draws_follow_the_distribution_at_the_temperature_within_top_p(temperature, top_p, expected):
    probabilities = torch.tensor([0.2, 0.5, 0.3])  # not in order: the nucleus sorts
    rows = 40_000
    scores = probabilities.log().expand(rows, 3)
    keys = completion_keys(seed=3, step=7, sample_indices=list(range(rows)), generations=1)
    chosen = draw(scores, uniforms(keys, 0), temperature, top_p)
    frequencies = torch.bincount(chosen, minlength=3).float() / rows
    if expected is None:
        wanted = torch.softmax(probabilities.log() / temperature, dim=0)
    else:
        wanted = torch.tensor([expected[2], expected[0], expected[1]])
    torch.testing.assert_close(frequencies, wanted, atol=0.01, rtol=0)


def test_a_prompts_completions_do_not_depend_on_the_prompts_beside_it(tokenizer):
    """What makes 2 ranks equal 1: prompt B alone samples what it samples beside prompt A (another padding
    width, another batch), and the same key draws the same completion again."""
    model = tiny_llama(tokenizer)
    a = tokenizer("#00ff00\n", add_special_tokens=False)["input_ids"]
    b = tokenizer("a much longer prompt\n", add_special_tokens=False)["input_ids"]
    eos, pad = [tokenizer.eos_token_id], tokenizer.pad_token_id

    def sample(prompts, indices, step=1):
        keys = completion_keys(0, step, indices, 3)
        return sample_completions(model, prompts, 3, 8, 1.5, 0.95, eos, pad, keys)[0]

    together = sample([a, b], [10, 11])
    assert sample([b], [11]) == together[3:] and sample([a], [10]) == together[:3]
    torch.manual_seed(123)  # the global generator plays no part
    assert sample([a, b], [10, 11]) == together
    assert len({tuple(c) for c in together[:3]}) > 1  # a group's completions differ
    assert sample([a, b], [10, 11], step=2) != together
    # The model's own generation defaults (Qwen2.5's ship a repetition penalty and top-k) do not reshape the
    # distribution the loss assumes.
    reshaping = {"repetition_penalty": 50.0, "top_k": 1, "no_repeat_ngram_size": 1, "min_new_tokens": 8}
    reshaping |= {"suppress_tokens": [tokenizer.eos_token_id]}
    for name, value in reshaping.items():
        setattr(model.generation_config, name, value)
    assert sample([a, b], [10, 11]) == together
    model.generation_config.bad_words_ids = [[5]]
    with pytest.raises(UserError, match=r"generation_config\.json sets bad_words_ids"):
        sample([a], [10])
