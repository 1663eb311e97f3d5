"""What happened to the data: samples read, dropped by reason (with examples), lengths, padding waste."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

EXAMPLES_PER_REASON = 3


@dataclass
class DropLog:
    """Counts per reason, with the first few origins of each so the user can look at them."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < EXAMPLES_PER_REASON:
            shown.append(where)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass
class ItemizedDrops(DropLog):
    """A drop log that also keeps every (reason, where) it was given, in order."""

    items: list[tuple[str, str]] = field(default_factory=list)

    def add(self, reason: str, where: str) -> None:
        super().add(reason, where)
        self.items.append((reason, where))


@dataclass
class SplitReport:
    name: str
    files: list[str]
    read: int
    kept: int
    truncated: int
    drops: DropLog
    length_percentiles: dict[str, int]
    trained_fraction: float
    """Share of tokens that carry a label."""
    padding: dict[str, float] = field(default_factory=dict)
    """Fraction of padding tokens in the micro-batches of an epoch, per batching strategy."""
    images: dict[str, float] = field(default_factory=dict)
    """A vision-language model's data: images, samples with images, image tokens per image (p50, max) and
    their share of all tokens (`image_stats`); empty for text."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> SplitReport:
        return SplitReport(**{**data, "drops": DropLog(**data["drops"])})


def length_stats(lengths: np.ndarray, labels_trained: int, total_tokens: int) -> tuple[dict[str, int], float]:
    if len(lengths) == 0:
        return {}, 0.0
    percentiles = {f"p{p}": int(np.percentile(lengths, p)) for p in (50, 90, 99)}
    percentiles["max"] = int(lengths.max())
    return percentiles, labels_trained / max(total_tokens, 1)


def nothing_trains(report: SplitReport) -> str:
    """Why no sample is left to train on, for the one error line after the report."""
    files = ", ".join(report.files)
    if report.read == 0:
        return f"data: no records in {files}: the file(s) are empty or hold only blank lines"
    return (
        f"data: all {report.read} records of {files} were dropped, for the reasons listed above; fix those "
        "records, or the settings the reasons name (data.max_length, data.template, data.truncation)"
    )


def format_report(report: SplitReport) -> list[str]:
    """Plain lines; the same text goes to the console and to `data check`."""
    lines = [
        f"{report.name}: {report.read} records read from {len(report.files)} source(s); {report.kept} kept, "
        f"{report.drops.total} dropped, {report.truncated} truncated to whole turns"
    ]
    for reason, count in sorted(report.drops.counts.items(), key=lambda item: -item[1]):
        lines.append(f"  dropped {count} x {reason}, e.g. {'; '.join(report.drops.examples[reason])}")
    if report.length_percentiles:
        stats = ", ".join(f"{k} {v}" for k, v in report.length_percentiles.items())
        lines.append(f"  tokens per sample: {stats}; trained tokens {report.trained_fraction:.1%}")
    if report.images:
        stats = report.images
        lines.append(
            f"  images: {int(stats['images'])} in {int(stats['samples_with_images'])} samples "
            f"({report.kept - int(stats['samples_with_images'])} text-only); image tokens per image "
            f"p50 {int(stats['tokens_p50'])}, max {int(stats['tokens_max'])}; {stats['token_share']:.1%} of all tokens"
        )
    if report.padding:
        waste = ", ".join(f"{name} {share:.1%}" for name, share in report.padding.items())
        lines.append(f"  padding per epoch: {waste}")
    return lines


def image_stats(input_ids: np.ndarray, offsets: np.ndarray, image_offsets: np.ndarray, image_token: int) -> dict:
    """Images per sample and image tokens per image of tokenized samples (`image_token`: the id that stands
    for one token of an image's features)."""
    per_sample_images = np.diff(image_offsets)
    is_image = input_ids == image_token
    running = np.concatenate([[0], np.cumsum(is_image, dtype=np.int64)])
    per_sample_tokens = running[offsets[1:]] - running[offsets[:-1]]
    with_images = per_sample_images > 0
    per_image = per_sample_tokens[with_images] / per_sample_images[with_images]
    if not with_images.any():
        return {"images": 0, "samples_with_images": 0, "tokens_p50": 0, "tokens_max": 0, "token_share": 0.0}
    return {
        "images": int(per_sample_images.sum()),
        "samples_with_images": int(with_images.sum()),
        "tokens_p50": float(np.percentile(per_image, 50)),
        "tokens_max": float(per_image.max()),
        "token_share": float(is_image.sum() / max(len(input_ids), 1)),
    }
