"""Samples -> padded micro-batches with shifted targets, in a seeded order per epoch."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tuneforge.data.tokenize import IGNORE_INDEX, TokenizedSample


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    """`targets[b, t]` is the token to predict after position t (already shifted), or -100."""
    origins: list[str]

    @property
    def num_targets(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def collate(samples: list[TokenizedSample], pad_id: int) -> MicroBatch:
    """Right-pad to the longest sample. Shifting here keeps the loss free of boundary cases."""
    width = max(len(s.input_ids) for s in samples)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
    targets = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)
        input_ids[row, :n] = torch.tensor(sample.input_ids)
        attention_mask[row, :n] = 1
        targets[row, : n - 1] = torch.tensor(sample.labels[1:])
    return MicroBatch(input_ids, attention_mask, targets, [s.origin for s in samples])


class EpochBatches:
    """Micro-batches of one epoch; the order depends only on (seed, epoch), so runs reproduce."""

    def __init__(self, samples: list[TokenizedSample], micro_batch_size: int, pad_id: int, shuffle: bool, seed: int):
        self.samples = samples
        self.micro_batch_size = micro_batch_size
        self.pad_id = pad_id
        self.shuffle = shuffle
        self.seed = seed

    def __len__(self) -> int:
        return -(-len(self.samples) // self.micro_batch_size)

    def epoch(self, epoch: int) -> Iterator[MicroBatch]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(len(self.samples), generator=generator).tolist()
        else:
            order = list(range(len(self.samples)))
        for start in range(0, len(order), self.micro_batch_size):
            chunk = [self.samples[i] for i in order[start : start + self.micro_batch_size]]
            yield collate(chunk, self.pad_id)
