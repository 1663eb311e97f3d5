"""Micro-batch plans (random, length-grouped, packed), equal shards per rank, and collation.

A plan is a list of micro-batches; a micro-batch is a list of rows; a row is a list of sample
indices (one sample, or several when packed). The order depends only on (seed, epoch), so runs
reproduce, and every rank gets the same number of micro-batches, so no rank waits in a
collective that another never enters.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from tuneforge.data.templates import IGNORE_INDEX
from tuneforge.data.tokenize import TokenizedData

Plan = list[list[list[int]]]
GROUP_WINDOW = 64
"""Length grouping sorts windows of this many micro-batches, so batches stay random across the epoch."""


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    """1 for real tokens, 0 for padding."""
    targets: torch.Tensor
    """`targets[b, t]` is the token to predict after position t (already shifted), or -100."""
    position_ids: torch.Tensor
    """Restart at 0 at the start of every sample, packed or not."""
    sequence_ids: torch.Tensor
    """Index of the sample within its row, -1 for padding: attention never crosses these boundaries."""
    packed: bool
    origins: list[str]
    whole_position_ids: torch.Tensor | None = None
    """Under sequence parallelism, the positions of the whole rows this rank holds a shard of (the tensors
    above are the shard); None otherwise."""
    global_targets: int = -1
    """Target tokens of the whole global micro-batch this is a rank's share of, known from the plan every rank
    holds, so a step's token-weighted mean needs no collective to find its divisor. `collate` sets this batch's
    own count (right for one process); `BatchPlanner` sets the global one."""
    global_samples: int = -1
    """Samples of the whole global micro-batch, likewise (a preference step's mean is over pairs of them)."""
    sample_indices: list[int] = field(default_factory=list)
    """The data index of each sample, in the order of `origins` (row by row): where per-sample values computed
    once (a preference reference's log-probs) are looked up."""
    whole_rows: MicroBatch | None = None
    """Under sequence parallelism, the whole rows this batch is shard `sequence_shard[0]` of; None otherwise.
    Per-sample values (an answer's log-probability, a conversation's score) are sums over the shards."""
    sequence_shard: tuple[int, int] = (0, 1)
    """(shard, shards) of the rows under sequence parallelism."""
    images: list[str] = field(default_factory=list)
    """Image sources of a vision-language model's samples, in the order of their tokens in the rows."""
    vision: dict[str, torch.Tensor] | None = None
    """The model's pixel inputs for those images (`pixel_values` and what the family adds), set by
    `ImageBatches.attach`; None for a text-only model."""
    advantages: torch.Tensor | None = None
    """Online RL's rollout rows: each row's completion advantage (one per row); None otherwise."""
    old_log_probs: torch.Tensor | None = None
    """Online RL's rollout rows, when a rollout serves several updates: log p(target) under the policy that
    sampled them, in the order of `targets != IGNORE_INDEX`; None otherwise."""

    def __post_init__(self) -> None:
        if self.global_targets < 0:
            self.global_targets = self.num_targets
        if self.global_samples < 0:
            self.global_samples = self.num_samples

    @property
    def num_samples(self) -> int:
        return len(self.origins)

    @property
    def num_targets(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def collate(
    data: TokenizedData, rows: list[list[int]], pad_id: int, packed: bool, width_multiple: int = 1
) -> MicroBatch:
    """Rows are padded on the right to the longest row, rounded up to `width_multiple`. Targets are shifted
    inside each sample."""
    row_lengths = [int(sum(data.lengths[i] for i in row)) for row in rows]
    width = -(-max(row_lengths) // width_multiple) * width_multiple
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    targets = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    sequence_ids = torch.full(shape, -1, dtype=torch.long)
    origins = []
    images = []
    for r, row in enumerate(rows):
        cursor = 0
        for s, index in enumerate(row):
            images += data.images_of(index)
            ids, labels = data.sample(index)
            n = len(ids)
            input_ids[r, cursor : cursor + n] = torch.from_numpy(ids.astype(np.int64))
            targets[r, cursor : cursor + n - 1] = torch.from_numpy(labels[1:].astype(np.int64))
            position_ids[r, cursor : cursor + n] = torch.arange(n)
            sequence_ids[r, cursor : cursor + n] = s
            cursor += n
            origins.append(data.origins[index])
        # Padding continues as one run of positions: attention split where positions restart treats it as
        # one stretch (never attended by a sample) rather than one piece per padding token.
        position_ids[r, cursor:] = torch.arange(width - cursor)
    attention_mask = (sequence_ids >= 0).long()
    indices = [index for row in rows for index in row]
    return MicroBatch(
        input_ids,
        attention_mask,
        targets,
        position_ids,
        sequence_ids,
        packed,
        origins,
        sample_indices=indices,
        images=images,
    )


def shard_rows(batch: MicroBatch, shard: int, size: int) -> MicroBatch:
    """Shard `shard` of `size` of every row: a contiguous 1/size of each row's width (a multiple of `size`), the
    whole rows' positions kept alongside for attention. Targets were shifted within samples before, so each
    token's target travels with it."""
    if size == 1:
        return batch
    width = batch.input_ids.size(1)
    assert width % size == 0, "rows are collated to a multiple of the sequence-parallel size"
    part = slice(shard * width // size, (shard + 1) * width // size)
    return MicroBatch(
        batch.input_ids[:, part],
        batch.attention_mask[:, part],
        batch.targets[:, part],
        batch.position_ids[:, part],
        batch.sequence_ids[:, part],
        batch.packed,
        batch.origins,
        whole_position_ids=batch.position_ids,
        global_targets=batch.global_targets,
        global_samples=batch.global_samples,
        sample_indices=batch.sample_indices,
        whole_rows=batch,
        sequence_shard=(shard, size),
    )


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Pack samples into rows of at most `capacity` tokens: longest first, each into the fullest row it fits."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (remaining capacity, row index), sorted
    for index in order:
        need = int(lengths[index])
        assert need <= capacity, "samples longer than max_length are dropped or truncated before packing"
        slot = bisect.bisect_left(free, (need, -1))
        if slot < len(free):
            remaining, row = free.pop(slot)
        else:
            remaining, row = capacity, len(rows)
            rows.append([])
        rows[row].append(index)
        if remaining - need > 0:
            bisect.insort(free, (remaining - need, row))
    return rows


def plan_epoch(
    lengths: np.ndarray,
    micro_batch_size: int,
    strategy: str,
    seed: int,
    epoch: int,
    packed_rows: list[list[int]] | None = None,
) -> Plan:
    """`random`: shuffled samples; `grouped`: shuffled, then sorted by length within windows (less padding);
    `packed`: the rows of `packed_rows` in shuffled order. Micro-batches hold `micro_batch_size` rows."""
    rng = np.random.default_rng([seed, epoch])
    if strategy == "packed":
        assert packed_rows is not None
        rows = [packed_rows[i] for i in rng.permutation(len(packed_rows))]
    else:
        order = rng.permutation(len(lengths))
        if strategy == "grouped":
            window = micro_batch_size * GROUP_WINDOW
            order = (
                np.concatenate(
                    [sorted(order[s : s + window], key=lambda i: -lengths[i]) for s in range(0, len(order), window)]
                )
                if len(order)
                else order
            )
        rows = [[int(i)] for i in order]
    batches = [rows[s : s + micro_batch_size] for s in range(0, len(rows), micro_batch_size)]
    if strategy == "grouped":
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def rows_for_rank(batch: list[list[int]], rank: int, world_size: int, filler: list[list[int]]) -> list[list[int]]:
    """This rank's contiguous share of a global micro-batch. Shares differ by at most one row, and a batch with
    fewer rows than ranks is topped up from `filler` (rows repeated, never dropped), so every rank always
    runs a micro-batch: a rank that skipped one would leave the others waiting in a collective."""
    if len(batch) < world_size:
        batch = batch + [filler[i % len(filler)] for i in range(world_size - len(batch))]
    bounds = share_bounds(len(batch), world_size)
    return batch[bounds[rank] : bounds[rank + 1]]


def share_bounds(rows: int, world_size: int) -> np.ndarray:
    """Where each rank's contiguous share of `rows` rows starts (and the last one ends): shares differ by at most
    one row."""
    return np.linspace(0, rows, world_size + 1).round().astype(int)


def mask_filler_rows(batch: MicroBatch, rank: int, world_size: int, real: int) -> None:
    """The targets of this rank's rows that `rows_for_rank` repeated to top up a global batch of `real` rows (fewer
    than the ranks), masked: they keep the rank in step with the others and train nothing."""
    if real >= world_size:
        return
    start = int(share_bounds(world_size, world_size)[rank])  # a topped-up batch has a row per rank
    for local in range(batch.targets.shape[0]):
        if start + local >= real:
            batch.targets[local] = IGNORE_INDEX


def padding_fraction(plan: Plan, lengths: np.ndarray) -> float:
    """Share of padding tokens when each micro-batch is padded to its longest row."""
    real = padded = 0
    for batch in plan:
        row_lengths = [int(sum(lengths[i] for i in row)) for row in batch]
        real += sum(row_lengths)
        padded += max(row_lengths) * len(row_lengths)
    return 1.0 - real / padded if padded else 0.0


class BatchPlanner:
    """Micro-batches of this rank for each epoch. The plan is made for the global micro-batch
    (`micro_batch_size` rows per data-parallel rank x data-parallel ranks) and each rank takes its share, so N
    ranks see exactly the batches one process would see with an N times larger micro-batch. Under sequence
    parallelism (`sequence_shard` = (shard, size)) the `size` ranks of a group are one data-parallel rank: they
    take the same rows, each a 1/size shard of them.

    `group` samples in a row of the data make one unit that is never split (2 for preference pairs: a chosen
    and a rejected answer): a row holds one unit, or with packing as many as fit `max_length` per sample, each
    sample isolated from the others by the attention. `attach_images`: a vision-language model's pixel inputs
    for each micro-batch (`ImageBatches.attach`)."""

    def __init__(
        self,
        data: TokenizedData,
        micro_batch_size: int,
        pad_id: int,
        seed: int,
        strategy: str,
        max_length: int,
        rank: int = 0,
        world_size: int = 1,
        sequence_shard: tuple[int, int] = (0, 1),
        group: int = 1,
        attach_images: Callable[[MicroBatch], MicroBatch] | None = None,
    ):
        assert len(data) % group == 0, "a unit's samples are stored side by side"
        self.attach_images = attach_images
        self.data = data
        self.global_micro_batch = micro_batch_size * world_size
        self.pad_id = pad_id
        self.seed = seed
        self.strategy = strategy
        self.rank = rank
        self.world_size = world_size
        self.sequence_shard = sequence_shard
        self.group = group
        self.unit_lengths = data.lengths.reshape(-1, group).sum(axis=1) if group > 1 else data.lengths
        capacity = max_length * group
        self.packed_rows = best_fit_decreasing(self.unit_lengths, capacity) if strategy == "packed" else None
        self.target_counts = data.target_counts()

    def plan(self, epoch: int) -> Plan:
        return [rows for rows, _, _, _ in self._shares(epoch)]

    def _shares(self, epoch: int) -> list[tuple[list[list[int]], int, int, int]]:
        """(this rank's rows, target tokens, samples and rows of the whole global micro-batch) for every
        micro-batch of `epoch`."""
        whole = plan_epoch(
            self.unit_lengths, self.global_micro_batch, self.strategy, self.seed, epoch, self.packed_rows
        )
        if self.group > 1:
            whole = [[self._samples_of(row) for row in batch] for batch in whole]
        shares = []
        for batch in whole:
            # Rows repeated to top up a batch with fewer rows than ranks are not counted (and train nothing).
            samples = [i for row in batch for i in row]
            rows = rows_for_rank(batch, self.rank, self.world_size, whole[0])
            shares.append((rows, sum(int(self.target_counts[i]) for i in samples), len(samples), len(batch)))
        return shares

    def _samples_of(self, units: list[int]) -> list[int]:
        return [unit * self.group + member for unit in units for member in range(self.group)]

    def __len__(self) -> int:
        rows = len(self.packed_rows) if self.packed_rows is not None else len(self.unit_lengths)
        return math.ceil(rows / self.global_micro_batch)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[MicroBatch]:
        """This rank's micro-batches of `epoch`, from the `start`-th on."""
        packed = self.strategy == "packed" or self.group > 1  # a unit's samples share a row, isolated
        shard, size = self.sequence_shard
        for rows, global_targets, global_samples, real in self._shares(epoch)[start:]:
            batch = collate(self.data, rows, self.pad_id, packed, sequence_width_multiple(size))
            batch.global_targets, batch.global_samples = global_targets, global_samples
            mask_filler_rows(batch, self.rank, self.world_size, real)
            batch = shard_rows(batch, shard, size)
            yield self.attach_images(batch) if self.attach_images is not None else batch


def sequence_width_multiple(size: int) -> int:
    """Rows split into `size` shards of equal width, each at least 2 tokens (a one-token forward would be taken
    for a generation step); 1 without sequence parallelism."""
    return 1 if size == 1 else 2 * size
