"""Rewards of online RL (`rl.rewards`): each scores a batch of completions against their prompts' answers.

The built-ins are data: a received config can name them and no code of its own runs; so is a reward model,
whose weights are read without running code. A `python` reward imports a function by name, which runs code: it
is built only when the user passes `--allow-reward-code` on the command line, never because a config asks.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from tuneforge.config.schema import RewardSpec
from tuneforge.errors import UserError

Score = Callable[[list[str], list[str]], list[float]]

ALLOW_REWARD_CODE = "TUNEFORGE_ALLOW_REWARD_CODE"
"""Set to 1 by `tuneforge train --allow-reward-code` for the run's processes: python rewards may be imported."""

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


@dataclass(frozen=True)
class Reward:
    name: str
    weight: float
    score: Callable[..., list[float]]
    """(completions, answers) -> one float each; with `needs_prompts`, (completions, answers, prompts)."""
    needs_prompts: bool = False
    """The score reads each completion's prompt conversation too (a reward model)."""

    def scores(self, completions: list[str], answers: list[str], prompts: Callable[[], list]) -> list[float]:
        """`prompts` gives the completions' prompt conversations, built only for a reward that reads them."""
        if self.needs_prompts:
            return self.score(completions, answers, prompts())
        return self.score(completions, answers)


def exact_match(completions: list[str], answers: list[str]) -> list[float]:
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answers, strict=True)]


def last_number(text: str) -> float | None:
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def numeric(completions: list[str], answers: list[str]) -> list[float]:
    """1 when the completion's last number equals the answer's (relative tolerance 1e-6)."""
    scores = []
    for completion, answer in zip(completions, answers, strict=True):
        got, wanted = last_number(completion), last_number(answer)
        scores.append(float(got is not None and wanted is not None and math.isclose(got, wanted, rel_tol=1e-6)))
    return scores


def json_valid(completions: list[str], answers: list[str]) -> list[float]:
    def parses(text: str) -> bool:
        try:
            json.loads(text)
        except (ValueError, RecursionError):
            return False
        return True

    return [float(parses(c.strip())) for c in completions]


def pattern_reward(pattern: str) -> Score:
    compiled = re.compile(pattern)

    def score(completions: list[str], answers: list[str]) -> list[float]:
        return [float(compiled.search(c) is not None) for c in completions]

    return score


def length_reward(target: int) -> Score:
    def score(completions: list[str], answers: list[str]) -> list[float]:
        return [max(0.0, 1.0 - abs(len(c) - target) / target) for c in completions]

    return score


def math_equivalence() -> Score:
    try:
        from math_verify import parse, verify
    except ImportError:
        raise UserError("rl.rewards: a math reward needs math-verify: pip install math-verify") from None

    def score(completions: list[str], answers: list[str]) -> list[float]:
        scores = []
        for completion, answer in zip(completions, answers, strict=True):
            try:
                scores.append(float(verify(parse(answer), parse(completion))))
            except Exception:  # an unparsable completion earns nothing; it never stops the run
                scores.append(0.0)
        return scores

    return score


def imported_function(path: str, allow_code: bool, where: str) -> Score:
    if not allow_code:
        raise UserError(
            f"{where}: a python reward ({path}) runs code; pass --allow-reward-code to tuneforge train if you "
            "trust it (a config someone hands over never runs code by itself)"
        )
    module_name, name = path.split(":")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"{where}: cannot import {path} ({exc}); install its package") from None
    if not callable(function):
        raise UserError(f"{where}: {path} is not a function")

    def score(completions: list[str], answers: list[str]) -> list[float]:
        values = [float(value) for value in function(completions, answers)]
        if len(values) != len(completions):
            raise UserError(f"{where}: {path} returned {len(values)} rewards for {len(completions)} completions")
        return values

    return score


ModelScorer = Callable[[RewardSpec, str], Callable[..., list[float]]]
"""Makes a `kind: model` reward from its spec and its place in the config (the training side's reward models)."""


def _score(spec: RewardSpec, allow_code: bool, where: str, models: ModelScorer | None) -> Callable[..., list[float]]:
    if spec.kind == "model":
        if models is None:
            raise UserError(f"{where}: a reward model is scored only during training")
        return models(spec, where)
    if spec.kind == "regex":
        return pattern_reward(spec.pattern)
    if spec.kind == "length":
        return length_reward(spec.target_length)
    if spec.kind == "math":
        return math_equivalence()
    if spec.kind == "python":
        return imported_function(spec.function, allow_code, where)
    return {"exact_match": exact_match, "numeric": numeric, "json": json_valid}[spec.kind]


def build_rewards(specs: list[RewardSpec], allow_code: bool = False, models: ModelScorer | None = None) -> list[Reward]:
    rewards, names = [], set()
    for index, spec in enumerate(specs):
        where = f"rl.rewards[{index}]"
        score = _score(spec, allow_code, where, models)
        name = spec.name or spec.kind
        if name in names:
            name = f"{name}_{index}"
        names.add(name)
        rewards.append(Reward(name, spec.weight, score, getattr(score, "needs_prompts", False)))
    return rewards


def load_reward_models(rewards: list[Reward], device, precision: str) -> None:
    """Read each reward model onto the policy's device (a named step of setup, after the policy loads)."""
    for reward in rewards:
        if hasattr(reward.score, "load"):
            reward.score.load(device, precision)
