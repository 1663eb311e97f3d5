"""Files -> records -> conversations -> tokenized splits, cached on disk, with a report of every drop."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import sys
import time
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from tuneforge.config.schema import DataConfig
from tuneforge.data.conversation import Conversation, SampleError, check_image_marks
from tuneforge.data.formats import detect_format, to_conversation
from tuneforge.data.image_tokens import ImageTokens
from tuneforge.data.images import resolve_source
from tuneforge.data.pairs import answer_origin, is_pair_record, read_pairs
from tuneforge.data.prompts import read_prompts, tokenize_prompts
from tuneforge.data.report import DropLog, ItemizedDrops, SplitReport, image_stats, length_stats
from tuneforge.data.sources import MALFORMED_JSON, read_records
from tuneforge.data.templates import IGNORE_INDEX, ChatTemplate
from tuneforge.data.tokenize import TokenizedData, tokenize
from tuneforge.errors import UserError, first_line

DATA_VERSION = "4"
"""Bump when tokenization output or the cache layout changes (3: a manifest of file sizes), so stale caches are
never reused (4: online RL prompts keep their messages, for a reward model)."""


@dataclass
class Split:
    data: TokenizedData
    report: SplitReport


@dataclass
class PreparedData:
    train: Split
    validation: Split | None

    def training_units(self, paired: bool) -> int:
        """What a micro-batch counts in the training split: samples, or pairs (two answers each)."""
        return len(self.train.data) // (2 if paired else 1)


OTHER_FORMAT = "another format than the file's first record"


TEXT_MODEL_IMAGE = "image for a text-only model"


def _with_sources_resolved(conversation: Conversation, cfg: DataConfig, path: str, vision: bool) -> Conversation:
    """Image sources made absolute (against `data.image_root`, else the data file's folder); a sample with
    images for a text-only model is refused."""
    if not conversation.images:
        if vision:  # a literal mark would read as an image once the processor's template renders it
            check_image_marks(conversation.turns, 0)
        return conversation
    if not vision:
        raise SampleError(TEXT_MODEL_IMAGE, "this model reads no images: train a vision-language model, or drop them")
    root = Path(cfg.image_root) if cfg.image_root is not None else Path(path).parent
    return replace(conversation, images=tuple(resolve_source(source, root) for source in conversation.images))


def read_conversations(
    cfg: DataConfig, files: list[str], drops: DropLog, vision: bool = False
) -> tuple[list[Conversation], int]:
    """All convertible conversations of `files`, and how many records were read. `vision`: the model reads
    images (their sources are resolved here)."""
    conversations: list[Conversation] = []
    read = 0
    for path in files:
        file_format = None if cfg.format == "auto" else cfg.format
        decided_by = "data.format"
        for record in read_records(path, cfg.on_error, cfg.split):
            read += 1
            if record.error is not None:
                drops.add(MALFORMED_JSON, f"{record.origin}: {record.error}")
                continue
            if file_format is None:
                file_format = detect_format(record.value)
                decided_by = record.origin
                if file_format is None:
                    keys = ", ".join(map(str, record.value)) if isinstance(record.value, dict) else "none"
                    if is_pair_record(record.value):
                        raise UserError(
                            f"{record.origin}: this row is a preference pair (keys: {keys}), and train.objective "
                            "sft trains on conversations; set train.objective: dpo, orpo or reward to train on pairs"
                        )
                    raise UserError(
                        f"{record.origin}: cannot tell the data format from this record (keys: {keys}); expected "
                        '"messages" (openai), "conversations" (sharegpt) or "instruction"/"output" (alpaca); '
                        "set data.format to force one"
                    )
            try:
                conversation = to_conversation(record.value, file_format, record.origin)
                conversations.append(_with_sources_resolved(conversation, cfg, path, vision))
            except SampleError as exc:
                reason, detail = exc.reason, exc.detail
                looks_like = detect_format(record.value) if cfg.format == "auto" else None
                if looks_like is not None and looks_like != file_format:
                    # A file mixing formats: the first record decided, say so rather than call the rest broken.
                    reason = OTHER_FORMAT
                    detail = (
                        f"looks like {looks_like}, but {decided_by} made the file {file_format}; give each format "
                        "its own file, or set data.format"
                    )
                drops.add(reason, f"{record.origin}: {detail}" if detail else record.origin)
    return conversations, read


def build_split(
    name: str,
    cfg: DataConfig,
    files: list[str],
    tokenizer: PreTrainedTokenizerBase,
    template: ChatTemplate,
    pairs: bool = False,
    images: ImageTokens | None = None,
    prompt_room: int | None = None,
) -> Split:
    """Read and tokenize `files`. With `prompt_room`, the files hold online RL's prompts with their answers, a
    prompt at most that many tokens. With `pairs`, the samples are each pair's chosen then rejected answer, side by
    side; a pair one of whose answers is dropped is dropped whole, counted once under that answer's reason.
    `images`: the model's image tokens (a vision-language model; pairs are text only)."""
    drops = DropLog()
    if prompt_room is not None:
        prompts, read = read_prompts(cfg, files, drops)
        data = tokenize_prompts(prompts, tokenizer, template, prompt_room, cfg.system, drops)
        return Split(data, _report(name, files, read, 0, drops, data))
    if not pairs:
        conversations, read = read_conversations(cfg, files, drops, vision=images is not None)
        kept, truncated = tokenize(
            conversations, tokenizer, template, cfg.max_length, cfg.truncation, cfg.system, drops, images=images
        )
    else:
        both, read = read_pairs(cfg, files, drops)
        sides = ItemizedDrops()
        encoded, truncated = tokenize(
            [c for pair in both for c in pair], tokenizer, template, cfg.max_length, cfg.truncation, cfg.system, sides
        )
        by_origin = {origin: (ids, labels) for ids, labels, origin in encoded}
        dropped = {answer_origin(where): (reason, where) for reason, where in reversed(sides.items)}
        kept = []
        for chosen, rejected in both:
            if chosen.origin in by_origin and rejected.origin in by_origin:
                kept += [(*by_origin[c.origin], c.origin) for c in (chosen, rejected)]
            else:
                drops.add(*dropped.get(chosen.origin) or dropped[rejected.origin])
    data = TokenizedData.from_samples(kept, with_images=images is not None)
    report = _report(name, files, read, truncated, drops, data, 2 if pairs else 1)
    if images is not None:
        report.images = image_stats(data.input_ids, data.offsets, data.image_offsets, images.image_token_id)
    return Split(data, report)


def _report(name, files, read, truncated, drops, data: TokenizedData, group: int = 1) -> SplitReport:
    """`group`: samples per kept record (2 for pairs)."""
    trained = int((data.labels != IGNORE_INDEX).sum())
    percentiles, fraction = length_stats(data.lengths, trained, len(data.input_ids))
    return SplitReport(name, list(files), read, len(data) // group, truncated, drops, percentiles, fraction)


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    targets = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for target in targets:
        digest.update(str(target.relative_to(path) if path.is_dir() else target.name).encode())
        with target.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def _tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocabulary = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps([tokenizer.special_tokens_map, getattr(tokenizer, "chat_template", None)], sort_keys=True)
    return hashlib.sha256((vocabulary + extra).encode()).hexdigest()


IMAGE_SETTINGS = {"image_root", "image_max_pixels", "image_min_pixels", "image_pixel_limit"}


def fingerprint(
    cfg: DataConfig,
    files: list[str],
    tokenizer: PreTrainedTokenizerBase,
    pairs: bool = False,
    images: ImageTokens | None = None,
    prompt_room: int | None = None,
) -> str:
    """Changes whenever a file's content or any setting that affects tokenization changes. The images' own
    bytes are not read for it: their tokens depend on their sizes, checked again when they are loaded."""
    fields = {"format", "split", "template", "system", "max_length", "truncation", "on_error"}
    settings = cfg.model_dump(mode="json", include=fields | (IMAGE_SETTINGS if images is not None else set()))
    if images is not None:
        settings["image_tokens"] = images.fingerprint()
        # Relative image paths resolve against the data files' folders when no image root is set.
        settings["image_folders"] = [str(Path(f).resolve().parent) for f in files]
    if prompt_room is not None:
        settings["prompt_room"] = prompt_room
    digest = hashlib.sha256(DATA_VERSION.encode() + (b":pairs" if pairs else b""))
    digest.update(json.dumps(settings, sort_keys=True).encode())
    digest.update(_tokenizer_digest(tokenizer).encode())
    for path in files:
        digest.update(_file_digest(Path(path)).encode())
    return digest.hexdigest()[:24]


def _relocated(origin: str, sources: list[str], targets: list[str]) -> str:
    """`origin` (a `file:line`-style place, or a message starting with one) with its file from `sources` replaced
    by the file at the same position in `targets`."""
    for index in sorted(range(len(sources)), key=lambda i: -len(sources[i])):  # longest first: `a` vs `a.bak`
        if origin.startswith(sources[index]):
            return targets[index] + origin[len(sources[index]) :]
    return origin


def _placeholders(files: list[str]) -> list[str]:
    return [f"<data file {index}>" for index in range(len(files))]


def _relocate_split(split: Split, sources: list[str], targets: list[str]) -> Split:
    """The split with its samples' origins and its report's drop examples pointing at `targets` instead of
    `sources` (file for file: the cache key hashes the files' contents in order)."""
    origins = [_relocated(origin, sources, targets) for origin in split.data.origins]
    report = split.report
    examples = {
        reason: [_relocated(example, sources, targets) for example in shown]
        for reason, shown in report.drops.examples.items()
    }
    drops = DropLog(dict(report.drops.counts), examples)
    report = replace(report, files=[_relocated(f, sources, targets) for f in report.files], drops=drops)
    return Split(replace(split.data, origins=origins), report)


CACHE_MANIFEST = "manifest.json"
"""Each file of a cache entry with its size and CRC-32, written last: an entry cut short or changed since is
rebuilt. Checking reads the entry once per run (about 1 s per GB here), the price of never training on tokens that
are not the data's."""


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


class DamagedCache(Exception):
    pass


def _save(split: Split, directory: Path, files: list[str]) -> None:
    """Into the cache with its data files as placeholders: a later run with the same contents elsewhere (or
    under other names) reports its own files, never ones that may be gone."""
    # Each node's first rank may build the same entry in a cache shared by the nodes: a name per process.
    tmp = directory.with_name(f".tmp-{directory.name}-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_entry(split, tmp, files)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays in the cache
        raise
    try:
        tmp.rename(directory)
    except OSError:  # another process finished the same cache first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)


def _write_entry(split: Split, tmp: Path, files: list[str]) -> None:
    tmp.mkdir(parents=True)
    for field in ("input_ids", "labels", "offsets"):
        np.save(tmp / f"{field}.npy", getattr(split.data, field))
    if split.data.answers is not None:
        (tmp / "answers.json").write_text(json.dumps(split.data.answers))
        (tmp / "prompts.json").write_text(json.dumps(split.data.prompts))
    if split.data.image_offsets is not None:
        np.save(tmp / "image_offsets.npy", split.data.image_offsets)
        (tmp / "images.json").write_text(json.dumps(split.data.images))
    stored = _relocate_split(split, [str(Path(f)) for f in files], _placeholders(files))
    (tmp / "origins.json").write_text(json.dumps(stored.data.origins))
    (tmp / "report.json").write_text(json.dumps(stored.report.to_json()))
    sums = {file.name: [file.stat().st_size, _crc32(file)] for file in sorted(tmp.iterdir())}
    (tmp / CACHE_MANIFEST).write_text(json.dumps(sums))


def _load(directory: Path, files: list[str]) -> Split:
    """The cached split; DamagedCache when a file is missing, of another size than written, or unreadable."""
    try:
        sums = json.loads((directory / CACHE_MANIFEST).read_text())
        for name, (size, crc) in sums.items():
            file = directory / Path(name).name
            if file.stat().st_size != size:
                raise DamagedCache(f"{file} changed size since it was written")
            if _crc32(file) != crc:
                raise DamagedCache(f"{file} changed since it was written (its checksum differs)")
        arrays = {f: np.load(directory / f"{f}.npy", mmap_mode="r") for f in ("input_ids", "labels", "offsets")}
        origins = json.loads((directory / "origins.json").read_text())
        if "answers.json" in sums:
            arrays["answers"] = json.loads((directory / "answers.json").read_text())
            arrays["prompts"] = json.loads((directory / "prompts.json").read_text())
        if "images.json" in sums:
            arrays["image_offsets"] = np.load(directory / "image_offsets.npy")
            arrays["images"] = json.loads((directory / "images.json").read_text())
        report = SplitReport.from_json(json.loads((directory / "report.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # missing, cut short, or not ours
        raise DamagedCache(f"{directory}: {first_line(exc)}") from None
    return _relocate_split(Split(TokenizedData(origins=origins, **arrays), report), _placeholders(files), files)


def _set_aside(directory: Path, why: str) -> None:
    """Move a damaged cache entry out of the way (kept beside it for inspection) and say so."""
    aside = directory.with_name(f".damaged-{directory.name}-{os.getpid()}")
    with contextlib.suppress(OSError):
        directory.rename(aside)
    print(f"data cache: {why}; rebuilding it (the damaged entry is kept as {aside})", file=sys.stderr)


def _load_intact(directory: Path, files: list[str], timeout_s: float, rank: int) -> Split:
    """Another rank's view of the cache its node's first rank writes: wait while it is missing or being
    rebuilt."""
    started = time.monotonic()
    while True:
        _wait_for(directory, timeout_s, rank, started)
        try:
            return _load(directory, files)
        except DamagedCache:
            if time.monotonic() - started > timeout_s:
                raise
            time.sleep(0.5)  # the node's first rank sets it aside and writes it again


def _wait_for(directory: Path, timeout_s: float, rank: int, start: float | None = None) -> None:
    start = time.monotonic() if start is None else start
    last_note = time.monotonic()
    while not directory.exists():
        now = time.monotonic()
        if now - start > timeout_s:
            raise UserError(
                f"local rank {rank}: this node's local rank 0 did not finish preprocessing the data into "
                f"{directory} within {timeout_s:g}s (data.preprocess_timeout_s); check its log"
            )
        if now - last_note >= 30:
            print(
                f"local rank {rank}: waiting for this node's local rank 0 to preprocess the data ({now - start:.0f}s)",
                file=sys.stderr,
            )
            last_note = now
        time.sleep(0.5)


def prepare_split(
    name: str,
    cfg: DataConfig,
    files: list[str],
    tokenizer: PreTrainedTokenizerBase,
    template: ChatTemplate,
    local_rank: int = 0,
    local_ranks: int = 1,
    pairs: bool = False,
    images: ImageTokens | None = None,
    prompt_room: int | None = None,
) -> tuple[Split, bool]:
    """The tokenized split and whether it came from the cache. With a cache and several ranks on a node, the
    node's local rank 0 builds it while the node's others wait (with their own timeout, independent of the
    training watchdog): per node, since `data.cache_dir` (by default under the home directory) may be on each
    node's own disk, where the ranks of other nodes would wait for it in vain."""
    if cfg.cache_dir is None:
        return build_split(name, cfg, files, tokenizer, template, pairs, images, prompt_room), False
    directory = Path(cfg.cache_dir).expanduser() / fingerprint(cfg, files, tokenizer, pairs, images, prompt_room)
    here = [str(Path(f)) for f in files]
    if local_rank != 0 and local_ranks > 1:
        try:
            return _load_intact(directory, here, cfg.preprocess_timeout_s, local_rank), True
        except DamagedCache as damaged:
            raise UserError(
                f"data cache {damaged} and this node's local rank 0 did not rebuild it; check its log"
            ) from None
    if directory.exists():
        try:
            return _load(directory, here), True
        except DamagedCache as damaged:
            _set_aside(directory, f"{damaged}")
    split = build_split(name, cfg, files, tokenizer, template, pairs, images, prompt_room)
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        _save(split, directory, files)
    except OSError as exc:  # a full disk, or a cache dir that became unwritable: the data itself is fine
        why = f"data cache: not written to {directory} ({exc.strerror or exc})"
        if local_ranks > 1:  # the node's other ranks wait for it: stop them, rather than let them time out
            raise UserError(f"{why}; free space there or set data.cache_dir: null") from None
        print(f"{why}; this run goes on without it")
    return split, False


def hold_out(split: Split, fraction: float, seed: int, group: int = 1) -> tuple[Split, Split]:
    """Move a seeded `fraction` of the records (at least one; a record is `group` samples side by side, 2 for
    pairs) into a validation split."""
    count = len(split.data) // group
    size = max(1, round(count * fraction))
    if size >= count:
        raise UserError(f"data.validation_fraction={fraction} leaves no training samples out of {count}")
    chosen = set(np.random.default_rng(seed).permutation(count)[:size].tolist())

    def samples(records: list[int]) -> list[int]:
        return [record * group + member for record in records for member in range(group)]

    train = split.data.subset(samples([i for i in range(count) if i not in chosen]))
    validation = split.data.subset(samples(sorted(chosen)))
    report = split.report
    train_report = _report("train", report.files, report.read, report.truncated, report.drops, train, group)
    validation_report = _report(
        f"validation ({fraction:.0%} held out)", report.files, 0, 0, DropLog(), validation, group
    )
    return Split(train, train_report), Split(validation, validation_report)


def prepare_data(
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    template: ChatTemplate,
    local_rank: int = 0,
    local_ranks: int = 1,
    pairs: bool = False,
    images: ImageTokens | None = None,
    prompt_room: int | None = None,
) -> PreparedData:
    """The train and validation splits; `pairs`: the files hold preference pairs (`train.objective` dpo, orpo,
    reward); `images`: a vision-language model's image tokens."""
    train, _ = prepare_split(
        "train", cfg, cfg.train_files, tokenizer, template, local_rank, local_ranks, pairs, images, prompt_room
    )
    validation = None
    if cfg.validation_files:
        validation, _ = prepare_split(
            "validation",
            cfg,
            cfg.validation_files,
            tokenizer,
            template,
            local_rank,
            local_ranks,
            pairs,
            images,
            prompt_room,
        )
    elif cfg.validation_fraction:
        train, validation = hold_out(train, cfg.validation_fraction, cfg.split_seed, 2 if pairs else 1)
    return PreparedData(train, validation)
