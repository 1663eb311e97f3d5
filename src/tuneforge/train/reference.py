"""DPO's reference for full fine-tuning: every answer's log-probability under the model before training,
computed in one pass over the pairs, stored in the work dir and read again on resume.

With LoRA the reference is the base with its adapters disabled; a fully fine-tuned model has no such switch, and
a frozen copy would double the memory of the model. The reference's log-probabilities are all DPO needs of it,
and they depend only on the initial weights and the data: one forward pass over the pairs before the first step
gives them for the whole run. The pass is split over the data-parallel ranks like a validation pass (every rank
runs the same number of forwards, so sharded engines' collectives pair up) and summed across ranks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tuneforge.config.schema import Config
from tuneforge.data.batching import MicroBatch
from tuneforge.data.pipeline import PreparedData
from tuneforge.data.tokenize import TokenizedData
from tuneforge.distributed import Layout
from tuneforge.engines import Engine
from tuneforge.errors import first_line
from tuneforge.model.transfer import to_device
from tuneforge.objective import TokenForward
from tuneforge.objective.preference import answer_log_probs, answer_of_targets
from tuneforge.train.validate import validation_batches
from tuneforge.watchdog import StallWatchdog

REFERENCE_DIR = "reference"


def reference_key(data: TokenizedData, model_identity: dict) -> str:
    """Changes with any token of the data and with the model the reference is computed from."""
    digest = hashlib.sha256(json.dumps(model_identity, sort_keys=True, default=str).encode())
    for array in (data.input_ids, data.labels, data.offsets):
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()[:20]


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


def reference_log_probs(
    work_dir: Path,
    split: str,
    key: str,
    size: int,
    compute: Callable[[], torch.Tensor],
    is_main: bool,
    say: Callable[[str], None],
) -> torch.Tensor:
    """The reference log-probabilities of `split`: read from `reference/SPLIT-KEY.safetensors` when there (a
    resume, or a rerun of the same data and model), else computed. Either happens before a resumed run loads its
    checkpoint, so `compute` sees the model as it was before training."""
    path = work_dir / REFERENCE_DIR / f"{split}-{key}.safetensors"
    if path.exists():
        try:
            table = load_file(path)["log_probs"]
        except (OSError, KeyError, ValueError) as exc:  # a damaged file is computed again, not trusted
            say(f"dpo reference: {path} unreadable ({first_line(exc)}); computing it again")
        else:
            if table.dtype == torch.float32 and table.shape == (size,):
                say(f"dpo reference: {split} log-probabilities read from {path}")
                return table
    say(f"dpo reference: computing the {split} log-probabilities of the model before training (one pass)")
    table = compute()
    if is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file({"log_probs": table.contiguous()}, str(tmp))
        tmp.replace(path)
    return table


def reference_tables(
    cfg: Config,
    engine: Engine,
    data: PreparedData,
    validation: list[MicroBatch] | None,
    pad_id: int,
    layout: Layout,
    work_dir: Path,
    watchdog: StallWatchdog,
) -> Callable[..., torch.Tensor]:
    """DPO's precomputed reference, as one table: the train split's answers, then the validation split's (whose
    batches' sample indices are moved past the train split's to look them up)."""
    identity = {"model": cfg.model.model_dump(mode="json"), "precision": cfg.train.precision, "seed": cfg.train.seed}
    splits = [("train", data.train.data)]
    if validation is not None and data.validation is not None:
        splits.append(("validation", data.validation.data))
        for batch in validation:
            batch.sample_indices = [i + len(data.train.data) for i in batch.sample_indices]

    def tables(forward: TokenForward, say: Callable[[str], None], is_main: bool) -> torch.Tensor:
        found = []
        for name, split in splits:
            compute = partial(
                compute_reference,
                engine,
                forward,
                split,
                cfg.train.micro_batch_size,
                pad_id,
                layout,
                cfg.data.max_length,
                lambda: watchdog.beat("model", training=False),
            )
            key = reference_key(split, identity)
            found.append(reference_log_probs(work_dir, name, key, len(split), compute, is_main, say))
        return torch.cat(found)

    return tables
