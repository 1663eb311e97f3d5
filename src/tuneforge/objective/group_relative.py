"""Group-relative policy optimisation's arithmetic, on tensors: each completion's advantage from the rewards of
its prompt's group, and the clipped policy-gradient loss of each loss type, summed over its unit so the step's
mean is over the unit the loss type names.

Loss types, by how the per-token terms are reduced (each returns a sum; the step divides by the unit's count
over all ranks):
- `grpo`: the mean over each completion's tokens, summed over completions (unit: completions).
- `dapo`: the sum over every completion token (unit: completion tokens of the whole step).
- `dr_grpo`: each completion's token sum over the longest allowed completion (unit: completions): no length
  bias either way.
- `gspo`: one importance ratio per completion, the exponential of its mean token log-ratio, clipped as a whole
  (unit: completions).
- `rloo`: the leave-one-out baseline (each completion against the mean of the others in its group), reduced as
  `grpo` (unit: completions).

The clipped surrogate takes the smaller of ratio x A and clip(ratio, 1 - eps_low, 1 + eps_high) x A; with one
update per rollout the ratio is one and the gradient is the plain policy gradient. The KL term against a
reference is the k3 estimator exp(ref - logp) - (ref - logp) - 1, zero where they agree.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tuneforge.config.schema import RLConfig
from tuneforge.data.batching import MicroBatch
from tuneforge.data.conversation import Conversation
from tuneforge.data.templates import IGNORE_INDEX
from tuneforge.keyed_sampling import completion_keys
from tuneforge.model.router_balance import RouterBalance
from tuneforge.objective.base import Objective, StepData, SumAcrossRanks
from tuneforge.objective.forward import TokenForward
from tuneforge.objective.rewards import Reward
from tuneforge.rollout_samplers import CompletionSampler

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "gspo", "rloo")
TOKEN_UNIT_LOSSES = ("dapo",)
"""Loss types whose step mean is over completion tokens; the others' is over completions."""


def group_advantages(rewards: torch.Tensor, scale: str, loss_type: str = "grpo", eps: float = 1e-4) -> torch.Tensor:
    """(prompts, generations) rewards -> advantages of the same shape. The baseline is the group's mean (the
    others' mean for `rloo`); `scale` divides by the group's standard deviation (`group`), the whole batch's
    (`batch`) or nothing (`none`)."""
    generations = rewards.size(1)
    if loss_type == "rloo":
        if generations < 2:
            raise ValueError("rloo needs at least 2 generations per prompt")
        others = (rewards.sum(dim=1, keepdim=True) - rewards) / (generations - 1)
        advantages = rewards - others
    else:
        advantages = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "group":
        advantages = advantages / (rewards.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        advantages = advantages / (rewards.std() + eps)
    elif scale != "none":
        raise ValueError(f"unknown reward scaling {scale!r}")
    return advantages


@dataclass(frozen=True)
class PolicyLoss:
    loss: torch.Tensor
    """The sum over the loss type's units (the step divides by their count)."""
    clipped: torch.Tensor
    """The clipped share summed over the units (tokens for `dapo`, else each completion's share of its tokens)."""
    kl: torch.Tensor
    """The KL estimate summed over the units likewise (zero without a reference)."""
    entropy: torch.Tensor
    """The policy's entropy at the completion tokens, summed over the units likewise (zero when not given)."""


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    completion: torch.Tensor,
    loss_type: str,
    eps_low: float,
    eps_high: float,
    max_completion_tokens: int,
    reference_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
) -> PolicyLoss:
    """Over the completion tokens of a micro-batch, flat: `log_probs` (with gradient), `old_log_probs` (the policy
    that sampled them) and `reference_log_probs` of each token, `completion` the index of its completion, and
    `advantages` one per completion."""
    count = advantages.numel()
    tokens = torch.zeros(count, dtype=log_probs.dtype, device=log_probs.device).index_add_(
        0, completion, torch.ones_like(log_probs)
    )
    per_completion = tokens.clamp(min=1)

    def by_completion(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(count, dtype=values.dtype, device=values.device).index_add_(0, completion, values)

    log_ratio = log_probs - old_log_probs
    if loss_type == "gspo":
        # One ratio per completion, the geometric mean of its tokens', each token carrying its own gradient.
        sequence = by_completion(log_ratio.detach()) / per_completion
        log_ratio = log_probs - log_probs.detach() + sequence[completion]
    ratio = torch.exp(log_ratio)
    gain = advantages[completion]
    kept, bounded = ratio * gain, ratio.clamp(1 - eps_low, 1 + eps_high) * gain
    per_token = -torch.minimum(kept, bounded)
    clipped = (kept > bounded).to(log_probs.dtype)
    per_token_kl = torch.zeros_like(log_probs)
    if reference_log_probs is not None and kl_coef:
        difference = reference_log_probs - log_probs
        per_token_kl = torch.exp(difference) - difference - 1
        per_token = per_token + kl_coef * per_token_kl
    per_token_entropy = torch.zeros_like(log_probs) if entropy is None or not entropy.numel() else entropy.detach()
    if loss_type == "dapo":
        return PolicyLoss(per_token.sum(), clipped.sum(), per_token_kl.detach().sum(), per_token_entropy.sum())
    if loss_type == "dr_grpo":
        loss = per_token.sum() / max_completion_tokens
    elif loss_type in ("grpo", "rloo", "gspo"):
        loss = (by_completion(per_token) / per_completion).sum()
    else:
        raise ValueError(f"unknown loss type {loss_type!r}")

    def per_unit(values: torch.Tensor) -> torch.Tensor:
        return (by_completion(values) / per_completion).sum()

    return PolicyLoss(loss, per_unit(clipped), per_unit(per_token_kl.detach()), per_unit(per_token_entropy))


class GroupRelativePolicy(Objective):
    """`train.objective: grpo`. Each step's micro-batches hold prompts; `rollout` samples `rl.generations`
    completions of each with the policy's current weights, rewards them, and turns each prompt into that many
    rows (prompt then completion, the completion's tokens the targets) with their advantages; the loss is the
    clipped policy gradient of `rl.loss_type` over them."""

    metric_names = ("clip_ratio", "kl", "entropy")
    generates = True

    def __init__(
        self,
        forward: TokenForward,
        settings: RLConfig,
        rewards: list[Reward],
        answers: list[str],
        tokenizer,
        stop_strings: list[str],
        sampler: CompletionSampler,
        gather: Callable[[object], list[object]],
        reference: Callable[[MicroBatch], torch.Tensor] | None = None,
        balance: RouterBalance | None = None,
        sum_across_ranks: SumAcrossRanks | None = None,
        seed: int = 0,
        prompts: Callable[[int], Conversation] | None = None,
    ):
        super().__init__(forward, balance, sum_across_ranks)
        self.seed = seed
        self.prompts = prompts
        self.settings = settings
        self.rewards = rewards
        self.answers = answers
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.sampler = sampler
        self.gather = gather
        self.reference = reference
        self.token_unit = settings.loss_type in TOKEN_UNIT_LOSSES
        self.updates_per_step = settings.updates_per_rollout

    def count(self, batch: MicroBatch) -> int:
        return batch.num_targets if self.token_unit else int(_trained_rows(batch).sum())

    def global_count(self, batch: MicroBatch) -> int:
        return batch.global_targets if self.token_unit else batch.global_samples

    def prepare_step(self, micro_batches: list[MicroBatch], step: int) -> StepData:
        """The rollout: every prompt's completions sampled, rewarded and turned into rows with advantages. Each
        completion's draws are keyed by (seed, step, prompt, its number in the group): the same on any rank."""
        settings = self.settings
        built, local = [], _Figures(len(self.rewards))
        samples = []
        started = time.monotonic()
        self.sampler.begin()
        for batch in micro_batches:
            prompts = [
                row[mask.bool()].tolist() for row, mask in zip(batch.input_ids, batch.attention_mask, strict=True)
            ]
            keys = completion_keys(self.seed, step, batch.sample_indices, settings.generations)
            completions, truncated = self.sampler.sample(prompts, keys)
            rows_of = [index for index in batch.sample_indices for _ in range(settings.generations)]
            answers = [self.answers[index] for index in rows_of]
            texts = [self._text(ids) for ids in completions]

            def prompts_of(rows: list[int] = rows_of) -> list[Conversation]:
                assert self.prompts is not None, "a reward that reads prompts needs their conversations"
                return [self.prompts(index) for index in rows]

            scores = torch.tensor(
                [reward.scores(texts, answers, prompts_of) for reward in self.rewards], dtype=torch.float64
            )
            total = (torch.tensor([r.weight for r in self.rewards], dtype=torch.float64)[:, None] * scores).sum(0)
            groups = total.view(len(prompts), settings.generations)
            advantages = group_advantages(groups.float(), settings.scale_rewards, settings.loss_type).flatten()
            rows = _rollout_rows(batch, prompts, completions, truncated, settings, self.tokenizer.pad_token_id)
            rows.advantages = advantages
            built.append(rows)
            local.add(scores, total, groups, completions, truncated, rows)
            if not samples:
                samples = [
                    {"prompt": self.tokenizer.decode(prompts[0]), "reply": text, "reward": float(value)}
                    for text, value in zip(texts, total.tolist()[: settings.generations], strict=False)
                ]
        self.sampler.end()
        if self.updates_per_step > 1:
            # The later updates' ratios are against the policy that sampled: its log-probabilities, taken now.
            with torch.no_grad():
                for rows in built:
                    rows.old_log_probs = self.forward.target_log_probs(rows, settings.temperature)
        local.seconds = time.monotonic() - started
        every = self.gather(local)
        figures = _Figures.combine(every, [r.name for r in self.rewards])
        # Each micro-batch's units over all ranks, known now that the completions are: the step's divisor.
        for index, rows in enumerate(built):
            rows.global_samples = max(1, sum(f.rows[index][0] for f in every))
            rows.global_targets = max(1, sum(f.rows[index][1] for f in every))
        return StepData(built, figures, samples)

    def _text(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((text.find(s) for s in self.stop_strings if s and s in text), default=len(text))
        return text[:cut]

    def prepare(self, batch: MicroBatch) -> torch.Tensor | None:
        if self.reference is None or not self.settings.kl_coef:
            return None
        with torch.no_grad():
            return self.reference(batch)

    def evaluate(self, batch: MicroBatch, prepared: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert batch.advantages is not None, "grpo trains on rollout rows"
        settings = self.settings
        # At the sampling temperature: the distribution the completions came from.
        log_probs, entropy = self.forward.target_log_probs_and_entropy(batch, settings.temperature)
        targets = batch.targets != IGNORE_INDEX
        completion = torch.arange(targets.size(0))[:, None].expand_as(targets)[targets]
        # With one update per rollout the sampling policy is the current one: the ratio is one, its gradient kept.
        old = log_probs.detach() if batch.old_log_probs is None else batch.old_log_probs.to(log_probs.device)
        result = policy_loss(
            log_probs,
            old,
            batch.advantages.to(log_probs.device, log_probs.dtype),
            completion.to(log_probs.device),
            settings.loss_type,
            settings.epsilon_low,
            settings.epsilon_high,
            settings.max_completion_tokens,
            prepared,
            settings.kl_coef,
            entropy,
        )
        return result.loss, {"clip_ratio": result.clipped, "kl": result.kl, "entropy": result.entropy}


def _trained_rows(batch: MicroBatch) -> torch.Tensor:
    return (batch.targets != IGNORE_INDEX).any(dim=1)


def _rollout_rows(
    batch: MicroBatch,
    prompts: list[list[int]],
    completions: list[list[int]],
    truncated: list[bool],
    settings: RLConfig,
    pad_id: int,
) -> MicroBatch:
    """Prompt then completion per row, right-padded; the targets are the completion's tokens (none for a
    truncated one under `rl.mask_truncated`)."""
    generations = settings.generations
    sequences = [prompts[i // generations] + completion for i, completion in enumerate(completions)]
    width = max(len(s) for s in sequences)
    shape = (len(sequences), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    targets = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    sequence_ids = torch.full(shape, -1, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        prompt_length = len(prompts[row // generations])
        input_ids[row, : len(sequence)] = torch.tensor(sequence)
        sequence_ids[row, : len(sequence)] = 0
        if not (settings.mask_truncated and truncated[row]):
            targets[row, prompt_length - 1 : len(sequence) - 1] = torch.tensor(sequence[prompt_length:])
    position_ids = torch.arange(width).expand(shape).clone()
    origins = [batch.origins[row // generations] for row in range(len(sequences))]
    indices = [batch.sample_indices[row // generations] for row in range(len(sequences))]
    return MicroBatch(
        input_ids,
        (sequence_ids >= 0).long(),
        targets,
        position_ids,
        sequence_ids,
        False,
        origins,
        sample_indices=indices,
    )


@dataclass
class _Figures:
    """This rank's rollout figures, summed so that ranks combine by adding."""

    reward_count: int
    completions: int = 0
    reward_sum: float = 0.0
    reward_squares: float = 0.0
    per_reward: list[float] = field(default_factory=list)
    groups: int = 0
    zero_std_groups: int = 0
    tokens: int = 0
    longest: int = 0
    truncated: int = 0
    rows: list[tuple[int, int]] = field(default_factory=list)
    """(trained completions, completion tokens trained) of each micro-batch."""
    seconds: float = 0.0
    """Wall time of this rank's rollout (generation and rewards)."""

    def __post_init__(self) -> None:
        self.per_reward = [0.0] * self.reward_count

    def add(self, scores, total, groups, completions, truncated, rows: MicroBatch) -> None:
        self.completions += len(completions)
        self.reward_sum += float(total.sum())
        self.reward_squares += float((total**2).sum())
        self.per_reward = [s + float(v) for s, v in zip(self.per_reward, scores.sum(1).tolist(), strict=True)]
        self.groups += groups.size(0)
        self.zero_std_groups += int((groups.std(dim=1) == 0).sum())
        lengths = [len(c) for c in completions]
        self.tokens += sum(lengths)
        self.longest = max(self.longest, *lengths)
        self.truncated += sum(truncated)
        self.rows.append((int(_trained_rows(rows).sum()), rows.num_targets))

    @staticmethod
    def combine(every: list[_Figures], names: list[str]) -> dict[str, float]:
        count = sum(f.completions for f in every)
        mean = sum(f.reward_sum for f in every) / count
        variance = max(0.0, sum(f.reward_squares for f in every) / count - mean**2)
        figures = {"reward": mean, "reward_std": variance**0.5}
        for index, name in enumerate(names):
            figures[f"reward/{name}"] = sum(f.per_reward[index] for f in every) / count
        figures["frac_reward_zero_std"] = sum(f.zero_std_groups for f in every) / sum(f.groups for f in every)
        figures["completion_length"] = sum(f.tokens for f in every) / count
        figures["completion_length_max"] = max(f.longest for f in every)
        figures["truncated"] = sum(f.truncated for f in every) / count
        figures["rollout_s"] = max(f.seconds for f in every)  # the slowest rank's: the others wait for it
        return figures
