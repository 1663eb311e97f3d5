"""Reward models: a scalar score per conversation, trained to rank each pair's chosen answer above its rejected one.

The model is transformers' sequence classification form of the network (`score`, a linear layer to one value,
in place of the LM head). A conversation's score is the head's output at its last token that is not the pad
token: where transformers' own `XForSequenceClassification` reads it, so an exported reward model scores a
conversation as training did. Pairs are laid out as for DPO (answer 2k chosen, 2k+1 rejected, each a whole
conversation isolated by the attention); the step's mean is over pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tuneforge.data.batching import MicroBatch
from tuneforge.model.attention import model_inputs
from tuneforge.model.precision import autocast
from tuneforge.model.router_balance import RouterBalance
from tuneforge.model.transfer import to_device
from tuneforge.objective.base import Metrics, SumAcrossRanks
from tuneforge.objective.forward import TokenForward
from tuneforge.objective.preference import AnswerLayout, PairObjective, add_shards

SCORE_BOUND = 5.0
"""The log barrier keeps scores inside (-5, 5) (InternLM2's bounds, as xtuner uses them)."""
BARRIER_MARGIN = 1e-3
FOCAL_GAMMA = 2


def score_head(model: nn.Module) -> nn.Module:
    """The module giving every position's score: `score`, or PEFT's wrapper around it."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "score":
            return module
    raise ValueError(f"{type(model).__name__} has no score head: train.objective: reward needs one")


def score_positions(batch: MicroBatch, pad_id: int) -> torch.Tensor:
    """The flat position (row-major over the batch) of each answer's score, in answer order: the last position of
    the answer's conversation whose token is not `pad_id` (-1 where there is none). From the CPU copy of the batch."""
    sequence = batch.sequence_ids
    per_row = (sequence.max(dim=1).values + 1).clamp(min=0)
    first = torch.cumsum(per_row, 0) - per_row
    answer = first[:, None] + sequence
    scored = (sequence >= 0) & (batch.input_ids != pad_id)
    flat = torch.arange(sequence.numel()).reshape(sequence.shape)
    positions = torch.full((int(per_row.sum()),), -1, dtype=torch.long)
    return positions.scatter_reduce(0, answer[scored], flat[scored], "amax")


def local_positions(batch: MicroBatch, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each answer's scoring position within this batch's tensors (0 where it is not here), and whether it is
    here: under sequence parallelism a row's positions are split into equal contiguous shards."""
    rows = batch.whole_rows if batch.whole_rows is not None else batch
    positions = score_positions(rows, pad_id)
    width, local_width = rows.input_ids.size(1), batch.input_ids.size(1)
    start = batch.sequence_shard[0] * local_width
    row, column = positions // width, positions % width
    held = (positions >= 0) & (column >= start) & (column < start + local_width)
    return torch.where(held, row * local_width + column - start, 0), held


def ranking_losses(chosen: torch.Tensor, rejected: torch.Tensor, loss_type: str) -> torch.Tensor:
    """Per pair: -log sigmoid(chosen - rejected), for `focal` weighted by (1 - 2 max(0, p - 1/2))^2, p the sigmoid."""
    margin = chosen - rejected
    losses = -F.logsigmoid(margin)
    if loss_type == "ranking":
        return losses
    if loss_type == "focal":
        return (1 - 2 * torch.relu(torch.sigmoid(margin) - 0.5)) ** FOCAL_GAMMA * losses
    raise ValueError(f"unknown reward loss {loss_type!r}")


def score_penalty(scores: torch.Tensor, penalty: str) -> torch.Tensor:
    """Per score: what keeps it in a stable range."""
    if penalty == "log_barrier":
        inside = scores.clamp(-SCORE_BOUND + BARRIER_MARGIN, SCORE_BOUND - BARRIER_MARGIN)
        return -torch.log(SCORE_BOUND - inside) - torch.log(inside + SCORE_BOUND)
    if penalty == "l2":
        return scores**2
    if penalty == "none":
        return torch.zeros_like(scores)
    raise ValueError(f"unknown reward penalty {penalty!r}")


class RewardRanking(PairObjective):
    """A reward model's loss: the ranking loss of each pair's scores plus `penalty_weight` times the penalty of
    both scores."""

    def __init__(
        self,
        forward: TokenForward,
        pad_id: int,
        loss_type: str = "ranking",
        penalty: str = "log_barrier",
        penalty_weight: float = 0.01,
        balance: RouterBalance | None = None,
        sum_across_ranks: SumAcrossRanks | None = None,
    ):
        super().__init__(forward, balance, sum_across_ranks)
        self.pad_id = pad_id
        self.loss_type = loss_type
        self.penalty = penalty
        self.penalty_weight = penalty_weight
        self._head = score_head(forward.plain)

    def scores(self, batch: MicroBatch, layout: AnswerLayout | None = None) -> torch.Tensor:
        """Each answer's score (fp32, on the model's device), in answer order. Under sequence parallelism the
        shard holding a conversation's scoring position gives it, and the group's shards add them up.
        `layout`: the batch's, when the caller has it already."""
        inputs = model_inputs(self.forward.plain, batch, self.forward.device)
        # The head's output at every position, taken as the engine's forward computes it (under ZeRO-3 or FSDP
        # the head's weight is whole only inside that forward), by a hook that lives only while scores are taken.
        outputs: list[torch.Tensor] = []
        hook = self._head.register_forward_hook(lambda _module, _args, output: outputs.append(output))
        try:
            with autocast(self.forward.precision, self.forward.device):
                self.forward.model(**inputs, use_cache=False)
        finally:
            hook.remove()
        per_position = outputs.pop().reshape(-1)
        local, held = local_positions(batch, self.pad_id)
        device = self.forward.device
        values = per_position.index_select(0, to_device(local, device)).float() * to_device(held.float(), device)
        layout = layout if layout is not None else AnswerLayout.of(batch, device)
        return add_shards(values, layout.group)

    def evaluate(self, batch: MicroBatch, prepared: object) -> tuple[torch.Tensor, Metrics]:
        layout = AnswerLayout.of(batch, self.forward.device)
        scores = self.scores(batch, layout)
        chosen, rejected = scores[0::2], scores[1::2]
        losses = ranking_losses(chosen, rejected, self.loss_type)
        if self.penalty_weight and self.penalty != "none":
            penalty = score_penalty(chosen, self.penalty) + score_penalty(rejected, self.penalty)
            losses = losses + self.penalty_weight * penalty
        real = layout.real_pairs()
        return (losses * real).sum(), self._rewards(chosen, rejected, real)
