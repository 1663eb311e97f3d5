"""DPO's reference for full fine-tuning: every answer's log-probability under the model before training,
computed in one pass over the pairs, stored in the work dir and read again on resume.

With LoRA the reference is the base with its adapters disabled; a fully fine-tuned model has no such switch, and
a frozen copy would double the memory of the model. The reference's log-probabilities are all DPO needs of it,
and they depend only on the initial weights and the data: one forward pass over the pairs before the first step
gives them for the whole run. The pass is split over the data-parallel ranks like a validation pass (every rank
runs the same number of forwards, so sharded engines' collectives pair up) and summed across ranks.

A table is named by a key of everything its values depend on (`reference_parts`): the model's files (their
content, not their path), the model settings, the tokenizer, the chat template, the precision and the data's
tokens. New weights at the same path get a new key, so an old table is never read for them. Each table carries a
checksum of its values, so one altered after it was written is computed again rather than trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tuneforge.config.schema import Config, ModelConfig
from tuneforge.data.pipeline import PreparedData
from tuneforge.data.templates import template_spec
from tuneforge.data.tokenize import TokenizedData
from tuneforge.distributed import Layout, gather_objects
from tuneforge.engines import Engine
from tuneforge.errors import first_line
from tuneforge.model.transfer import to_device
from tuneforge.objective import TokenForward
from tuneforge.objective.preference import answer_log_probs, answer_of_targets
from tuneforge.run_files import RunFiles
from tuneforge.train.objectives import policy_forward
from tuneforge.train.validate import validation_batches
from tuneforge.watchdog import StallWatchdog

DIGEST_CACHE = "file-digests.json"
"""In `reference/`: the sha256 of each model file hashed, by the file's identity on disk (see `file_digests`)."""

WHAT = {
    "weights": "model files",
    "model": "model settings",
    "tokenizer": "tokenizer",
    "template": "chat template",
    "precision": "precision",
    "data": "data",
}
"""What each part of a table's key stands for, as said when an old table is not used."""


def _sha256(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def data_digest(data: TokenizedData) -> str:
    """Changes with any token of the data (and with what each token trains)."""
    digest = hashlib.sha256()
    for array in (data.input_ids, data.labels, data.offsets):
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def tokenizer_digest(tokenizer) -> str:
    """The vocabulary and special tokens. (The data's tokens are keyed too, and they are what the tokenizer made
    of the text; this part says, when an old table is set aside, that it was the tokenizer that changed.)"""
    return _sha256([sorted(tokenizer.get_vocab().items()), tokenizer.special_tokens_map])


def model_dir(path: str) -> Path | None:
    """The directory transformers loads `model.path` from: the directory itself, or a hub id's cached snapshot
    (the model is loaded by then, so it is cached); None where neither is found."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, local_files_only=True))
    except (OSError, ValueError):  # not cached, or not a hub id
        return None


NOT_MODEL_FILES = frozenset(
    {
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "chat_template.json",
    }
)
"""JSON files beside a model that do not change its log-probabilities: generation settings, and the tokenizer's
files (the tokenizer and chat template are keyed by what they hold, `tokenizer_digest` and the template part)."""


def model_files(directory: Path) -> list[Path]:
    """The files transformers builds the model from: its weights (safetensors where there are any, as
    transformers prefers them, else `pytorch_model*.bin`), its config and its code. Other files (an `original/`
    checkpoint, a README) are left out: hashing them would cost time and change nothing the model computes."""
    files = [p for p in directory.iterdir() if p.is_file()]
    weights = [p for p in files if p.name.endswith(".safetensors")]
    weights = weights or [p for p in files if p.name.startswith("pytorch_model") and p.name.endswith(".bin")]
    described = [p for p in files if p.suffix in (".json", ".py") and p.name not in NOT_MODEL_FILES]
    return sorted({*weights, *described})


def _identity(path: Path) -> list[int]:
    """What changes whenever a file's content may have: a write sets the inode's change time (ctime), which,
    unlike the modification time, `touch` or a copy that keeps times cannot set back; a file replaced by another
    has another inode."""
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(16 << 20):
            digest.update(chunk)  # releases the GIL: files hash in parallel threads
    return digest.hexdigest()


def file_digests(
    files: Iterable[Path], cache: Path | None, say: Callable[[str], None], beat: Callable[[], None]
) -> dict[str, str]:
    """The sha256 of each file's whole content, by file name. A full content hash, because a fingerprint of
    sizes and times (or of the safetensors header) misses weights rewritten in place with the same shapes.
    sha256 runs at 1-1.6 GB/s per core (SHA extensions; 4.3 GB of shards took 6-7 s on 2 busy cores), one thread
    per file, so an 8B model's 16 GB take about 10 s where the disk keeps up: less than loading it. And it is
    paid once per work dir: each digest is kept in `cache` under the file's identity on disk (`_identity`) and
    reused while that is unchanged, so a resume or a rerun reads no weights."""
    try:
        known = json.loads(cache.read_text(encoding="utf-8")) if cache is not None and cache.exists() else {}
    except (OSError, ValueError):
        known = {}
    found: dict[str, str] = {}
    todo: list[tuple[Path, str, list[int]]] = []
    for path in files:
        real = str(path.resolve())  # a hub snapshot's files are links to its blobs
        identity = _identity(path)
        entry = known.get(real)
        if isinstance(entry, dict) and entry.get("identity") == identity and isinstance(entry.get("sha256"), str):
            found[path.name] = entry["sha256"]
        else:
            todo.append((path, real, identity))
    if todo:
        size = sum(identity[0] for _, _, identity in todo)
        amount = f"{size / 1e9:.1f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"
        say(f"dpo reference: hashing {len(todo)} model file(s) ({amount}; once per work dir) to key its table")
        with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1, 8)) as pool:
            for (path, real, identity), digest in zip(todo, pool.map(_file_sha256, [t[0] for t in todo]), strict=True):
                found[path.name] = digest
                if _identity(path) == identity:  # not cached if the file changed while it was read
                    known[real] = {"identity": identity, "sha256": digest}
                beat()
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f".{cache.name}.tmp")
            tmp.write_text(json.dumps(known, indent=1), encoding="utf-8")
            tmp.replace(cache)
    return found


def weights_digest(cfg: ModelConfig, cache: Path | None, say: Callable[[str], None], beat: Callable[[], None]) -> str:
    """A fresh model's weights follow from its settings and seed (keyed as the model settings); a loaded
    model's from its files' content."""
    if cfg.path is None:
        return "fresh"
    directory = model_dir(cfg.path)
    if directory is None:  # cannot happen once the model loaded, but a key of its path is better than none
        return _sha256(cfg.path)
    return _sha256(file_digests(model_files(directory), cache, say, beat))


def reference_parts(cfg: Config, tokenizer, weights: str, fresh_init: str) -> dict[str, str]:
    """Every part of a table's key but the data. `fresh_init`: the device a fresh model is initialised on (its
    random stream differs between host and GPU)."""
    model = {"settings": cfg.model.model_dump(mode="json")}
    if cfg.model.architecture is not None:
        model |= {"seed": cfg.train.seed, "init": fresh_init}
    spec = template_spec(cfg.data.template)
    template = spec if isinstance(spec, str) else spec.model_dump(mode="json")
    return {
        "weights": weights,
        "model": _sha256(model),
        "tokenizer": tokenizer_digest(tokenizer),
        "template": _sha256([template, tokenizer.chat_template]),
        "precision": cfg.train.precision,
    }


def reference_key(parts: dict[str, str]) -> str:
    return _sha256(parts)[:20]


def compute_reference(
    engine: Engine,
    forward: TokenForward,
    data: TokenizedData,
    micro_batch_size: int,
    pad_id: int,
    layout: Layout,
    max_length: int,
    beat: Callable[[], None],
) -> torch.Tensor:
    """Each sample's (answer's) log-probability under the model as it is now, on every rank (fp32, CPU)."""
    device = forward.device
    sums = torch.zeros(len(data), dtype=torch.float64, device=device)
    seen = torch.zeros(len(data), dtype=torch.float64, device=device)
    engine.model.eval()
    with torch.no_grad():
        for batch in validation_batches(data, micro_batch_size, pad_id, layout, False, max_length, group=2):
            values = answer_log_probs(forward, batch).double()
            # Rows repeated to give every rank a batch have their targets masked: those answers are left out.
            _, tokens = answer_of_targets(batch)
            keep = to_device(tokens > 0, device)
            indices = to_device(torch.tensor(batch.sample_indices), device)
            sums.index_add_(0, indices, torch.where(keep, values, 0.0))
            seen.index_add_(0, indices, keep.double())
            beat()
    engine.model.train()
    engine.sum_tensor_across_ranks(sums)
    engine.sum_tensor_across_ranks(seen)
    values, counts = sums.cpu(), seen.cpu()
    assert bool((counts > 0).all()), "every answer is in some rank's batch"
    return (values / counts).float()


def _checksum(table: torch.Tensor, key: str) -> str:
    return hashlib.sha256(key.encode() + table.contiguous().numpy().tobytes()).hexdigest()


def read_table(path: Path, key: str, size: int) -> tuple[torch.Tensor | None, str]:
    """The table at `path` if it holds what was written there under `key`; else None and why not."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            table = handle.get_tensor("log_probs")
    except (OSError, SafetensorError, KeyError, ValueError) as exc:  # a damaged file is computed again, not trusted
        return None, f"unreadable ({first_line(exc)})"
    if "checksum" not in metadata:
        return None, "has no checksum (written by an older tuneforge, or not by tuneforge)"
    if table.dtype != torch.float32 or table.shape != (size,) or metadata["checksum"] != _checksum(table, key):
        return None, "altered since it was written (its values no longer match its checksum)"
    return table, ""


def _set_aside(directory: Path, split: str, path: Path, parts: dict[str, str]) -> str:
    """What the newest other table of `split` was computed for that this run differs in ("" when none is
    there, or it says nothing): read from its metadata alone."""
    others = [p for p in directory.glob(f"{split}-*.safetensors") if p != path]
    if not others:
        return ""
    newest = max(others, key=lambda p: p.stat().st_mtime_ns)
    try:
        with safe_open(str(newest), framework="pt") as handle:
            theirs = json.loads((handle.metadata() or {}).get("parts", "{}"))
    except (OSError, SafetensorError, ValueError):
        return ""
    if not isinstance(theirs, dict):
        return ""
    changed = [WHAT[name] for name in WHAT if name in theirs and theirs[name] != parts[name]]
    return f"{newest} was computed for other {', '.join(changed)}" if changed else ""


def reference_log_probs(
    work_dir: Path,
    split: str,
    parts: dict[str, str],
    size: int,
    compute: Callable[[], torch.Tensor],
    is_main: bool,
    say: Callable[[str], None],
    all_ranks_have: Callable[[bool], bool] = lambda found: found,
) -> torch.Tensor:
    """The reference log-probabilities of `split`: read from `reference/SPLIT-KEY.safetensors` when there and
    intact (a resume, or a rerun of the same data and model), else computed. Either happens before a resumed run
    loads its checkpoint, so `compute` sees the model as it was before training. `parts`: what the key is made
    of (`reference_parts` and the data's), kept in the table's metadata to say later what an old table was for.
    `all_ranks_have`: whether every rank found the table (a collective): all read it or all compute it, since
    ranks that computed it while others read it would wait on each other's collectives (a work dir on each
    node's own disk may hold it on one node only)."""
    key = reference_key(parts)
    path = RunFiles(work_dir).reference / f"{split}-{key}.safetensors"
    table, why = read_table(path, key, size) if path.exists() else (None, "")
    if all_ranks_have(table is not None):
        say(f"dpo reference: {split} log-probabilities read from {path}")
        return table
    if why:
        say(f"dpo reference: {path} {why}; computing it again")
    elif table is not None:
        say(f"dpo reference: {path} is missing on another rank's node; computing it again on every rank")
    elif aside := _set_aside(path.parent, split, path, parts):
        say(f"dpo reference: {aside}; not used")
    say(f"dpo reference: computing the {split} log-probabilities of the model before training (one pass)")
    table = compute().contiguous()
    if is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        metadata = {"key": key, "checksum": _checksum(table, key), "parts": json.dumps(parts, sort_keys=True)}
        save_file({"log_probs": table}, str(tmp), metadata=metadata)
        tmp.replace(path)
    return table


def reference_pass(
    cfg: Config,
    engine: Engine,
    data: PreparedData,
    tokenizer,
    layout: Layout,
    work_dir: Path,
    watchdog: StallWatchdog,
    say: Callable[[str], None],
) -> torch.Tensor:
    """DPO's precomputed reference, as one table: every answer's log-probability under the model before training,
    the train split's answers, then the validation split's (whose batches are built with their sample indices
    past the train split's, `validation_split`). Read from the work dir where an intact table of the same key is
    there, else computed in one pass over the ranks, heartbeat by heartbeat (phase `model`)."""
    splits = [("train", data.train.data)]
    if data.validation is not None and len(data.validation.data):
        splits.append(("validation", data.validation.data))
    beat = partial(watchdog.beat, "model", training=False)
    # Where `build_model` initialises a fresh model: on the GPU unless a sharding engine places it from the host.
    fresh_init = "cuda" if engine.info.device.type == "cuda" and not engine.sharded else "cpu"
    forward = policy_forward(engine, cfg.train.precision)
    is_main = engine.info.is_main
    # The first rank hashes the model's files and tells the others: every rank must look for the same table
    # (ranks that computed it while others read it would wait on each other's collectives).
    cache = RunFiles(work_dir).reference / DIGEST_CACHE if is_main else None
    weights = weights_digest(cfg.model, cache, say, beat) if is_main else None
    weights = str(gather_objects(weights, engine.info)[0])
    parts = reference_parts(cfg, tokenizer, weights, fresh_init)
    found = []
    for name, split in splits:
        compute = partial(
            compute_reference,
            engine,
            forward,
            split,
            cfg.train.micro_batch_size,
            tokenizer.pad_token_id,
            layout,
            cfg.data.max_length,
            beat,
        )
        split_parts = {**parts, "data": data_digest(split)}
        found.append(
            reference_log_probs(
                work_dir,
                name,
                split_parts,
                len(split),
                compute,
                is_main,
                say,
                lambda found: all(gather_objects(found, engine.info)),
            )
        )
    return torch.cat(found)
