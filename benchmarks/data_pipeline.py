"""Data pipeline figures: preprocessing throughput (cold and cached) and padding waste per batching strategy.

    .venv/bin/python benchmarks/data_pipeline.py [--samples 20000] [--max-length 1024] [--micro-batch 8]

The corpus is synthetic chat data in the OpenAI `messages` format with a long-tailed length
distribution (log-normal, median about 300 tokens, clipped at max_length), tokenized with the
built-in byte-level tokenizer (one token per byte), so token counts equal UTF-8 lengths.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from tuneforge.config.schema import DataConfig
from tuneforge.data.batching import best_fit_decreasing, padding_fraction, plan_epoch
from tuneforge.data.byte_tokenizer import build_byte_tokenizer
from tuneforge.data.pipeline import prepare_split
from tuneforge.data.templates import get_template

WORDS = [
    "the",
    "a",
    "model",
    "token",
    "data",
    "train",
    "loss",
    "rank",
    "step",
    "batch",
    "layer",
    "expert",
    "router",
    "adapter",
    "weight",
    "chat",
    "reply",
]


def make_corpus(path: Path, samples: int, max_length: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    # Total characters per conversation; the template adds about 60 more.
    sizes = np.clip(rng.lognormal(mean=np.log(200), sigma=0.7, size=samples), 20, max_length - 80).astype(int)
    with path.open("w") as handle:
        for size in sizes:
            turns = int(rng.integers(1, 4))
            messages = []
            for _ in range(turns):
                for role, share in (("user", 0.3), ("assistant", 0.7)):
                    length = max(4, int(size * share / turns))
                    words = rng.choice(WORDS, size=length // 5 + 1)
                    messages.append({"role": role, "content": " ".join(words)[:length]})
            handle.write(json.dumps({"messages": messages}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args()

    tokenizer = build_byte_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        make_corpus(corpus, args.samples, args.max_length)
        cfg = DataConfig(
            train_files=[str(corpus)], template="qwen_chat", max_length=args.max_length, cache_dir=f"{tmp}/cache"
        )
        template = get_template(cfg.template)
        start = time.perf_counter()
        split, cached = prepare_split("train", cfg, cfg.train_files, tokenizer, template)
        cold = time.perf_counter() - start
        assert not cached
        start = time.perf_counter()
        _, cached = prepare_split("train", cfg, cfg.train_files, tokenizer, template)
        warm = time.perf_counter() - start
        assert cached

    lengths = split.data.lengths
    print(
        f"corpus: {len(lengths)} samples kept of {split.report.read}; tokens per sample "
        + ", ".join(f"{k} {v}" for k, v in split.report.length_percentiles.items())
    )
    print(
        f"preprocess (read, convert, template, tokenize, cache write): {cold:.2f}s = "
        f"{len(lengths) / cold:,.0f} samples/s, {int(lengths.sum()) / cold:,.0f} tokens/s"
    )
    print(f"cached start: {warm:.3f}s = {cold / warm:.0f}x faster than preprocessing")

    start = time.perf_counter()
    rows = best_fit_decreasing(lengths, args.max_length)
    packing_s = time.perf_counter() - start
    print(f"packing {len(lengths)} samples into {len(rows)} rows of {args.max_length}: {packing_s:.2f}s")
    waste = {
        strategy: padding_fraction(plan_epoch(lengths, args.micro_batch, strategy, 0, 0, rows), lengths)
        for strategy in ("random", "grouped", "packed")
    }
    for strategy, share in waste.items():
        # Computed tokens = real tokens / (1 - padding share); compared with random batching.
        ratio = (1 - waste["random"]) / (1 - share)
        print(
            f"{strategy:>7} batches of {args.micro_batch}: padding {share:6.1%} of computed tokens; "
            f"computes {ratio:.2f}x the tokens of random batches"
        )


if __name__ == "__main__":
    main()
