"""Sampling whose randomness belongs to the completion, not to the process: each sampled token is drawn with a
uniform number computed from (run seed, step, prompt's data index, generation, token position).

So a prompt's completions are the same whichever rank samples them, beside whichever other prompts, and after
a resume: rollouts do not depend on the number of ranks or on the order prompts are batched, and a run with
2 ranks draws what one process draws. Everything stays on the device (integer mixing, a cumulative sum, a
search), with no host read per token.

The draw is inverse-CDF sampling: the token whose cumulative probability first exceeds the uniform, over the
distribution at the sampling temperature restricted to its top-p nucleus. It runs as a logits processor of
Hugging Face's greedy search, which then picks the only token left: the model's own KV-cached generation, its
lockstep across ranks (`synced_gpus`) and its stopping included.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

_MASK32 = 0xFFFFFFFF


def _times(values: torch.Tensor, constant: int) -> torch.Tensor:
    """values x constant modulo 2^32, for values below 2^32 in int64 without overflow: in 16-bit halves."""
    low, high = constant & 0xFFFF, constant >> 16
    return (values * low + (((values * high) & 0xFFFF) << 16)) & _MASK32


def mix(values: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply, two rounds): nearby inputs give unrelated outputs."""
    values = values & _MASK32
    values = values ^ (values >> 16)
    values = _times(values, 0x7FEB352D)
    values = values ^ (values >> 15)
    values = _times(values, 0x846CA68B)
    return values ^ (values >> 16)


def completion_keys(seed: int, step: int, sample_indices: list[int], generations: int) -> torch.Tensor:
    """One key per completion, prompt by prompt (each prompt's `generations` in a row), from what identifies
    it in the run: the seed, the step, the prompt's index in the data and its number within the group."""
    prompts = torch.tensor(sample_indices, dtype=torch.int64).repeat_interleave(generations)
    within = torch.arange(generations, dtype=torch.int64).repeat(len(sample_indices))
    base = mix(mix(torch.tensor(seed & _MASK32, dtype=torch.int64)) ^ (step & _MASK32))
    return mix(mix(base ^ mix(prompts & _MASK32)) ^ within)


def uniforms(keys: torch.Tensor, position: int) -> torch.Tensor:
    """A uniform number in (0, 1) per key for the token at `position` of each completion (float32, keys' device)."""
    bits = mix(keys ^ mix(torch.full_like(keys, position & _MASK32)))
    # 24 bits: what float32 holds exactly; the half step keeps 0 and 1 out.
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def draw(scores: torch.Tensor, uniform: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """(rows,) token ids sampled from softmax(scores / temperature) within its top-p nucleus, one uniform per row."""
    probs = torch.softmax(scores.float() / temperature, dim=-1)
    order = None
    if top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True)
        before = probs.cumsum(dim=-1) - probs
        probs = probs * (before < top_p)  # the smallest set of likeliest tokens holding top_p; never empty
    cumulative = probs.cumsum(dim=-1)
    target = (uniform * cumulative[:, -1]).unsqueeze(1)
    index = torch.searchsorted(cumulative, target, right=True).clamp(max=scores.size(-1) - 1)
    return index.squeeze(1) if order is None else order.gather(1, index).squeeze(1)


class KeyedSampler(LogitsProcessor):
    """Leaves only the keyed draw of each row finite, so greedy search takes it. `keys`: one per row of the
    generation batch; `prompt_width`: the padded prompt length, where position 0 of the completions is."""

    def __init__(self, keys: torch.Tensor, prompt_width: int, temperature: float, top_p: float):
        self.keys = keys
        self.prompt_width = prompt_width
        self.temperature = temperature
        self.top_p = top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        position = input_ids.size(1) - self.prompt_width  # a shape: no read of the device
        if self.keys.device != scores.device:
            self.keys = self.keys.to(scores.device)
        chosen = draw(scores, uniforms(self.keys, position), self.temperature, self.top_p)
        only = torch.full_like(scores, float("-inf"))
        return only.scatter_(1, chosen.unsqueeze(1), 0.0)
