"""Weights a checkpoint holds that transformers does not load, carried through every full-model save unchanged.

transformers drops tensors its model class has no place for: DeepSeek-V3's multi-token-prediction layer, Qwen3.5's
`mtp.*`, an extra head. A model fine-tuned and saved through it has none of them, and a server that uses them
(speculative decoding in vLLM or SGLang) then gets garbage or zero acceptance. They never train here; each time a
full model is written (a checkpoint of full fine-tuning, a merged export) they are copied bit for bit from the
directory the model was loaded from into `UNLOADED_FILE`, and the safetensors index lists them, so loaders that
read the index (transformers, vLLM, SGLang) find every tensor the original had.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

UNLOADED_FILE = "unloaded-weights.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
ATTRIBUTE = "_tuneforge_unloaded"


@dataclass(frozen=True)
class UnloadedWeights:
    source: Path
    names: tuple[str, ...]

    def describe(self, shown: int = 4) -> str:
        listed = ", ".join(self.names[:shown]) + (
            f" and {len(self.names) - shown} more" if len(self.names) > shown else ""
        )
        return f"{len(self.names)} weight(s) transformers does not load ({listed})"


def weight_map(directory: Path) -> dict[str, str]:
    """Tensor name -> safetensors file of a model directory (the index's map, or the single file's keys)."""
    index = directory / INDEX_FILE
    if index.exists():
        return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    single = directory / SINGLE_FILE
    if not single.exists():
        return {}
    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), SINGLE_FILE)


def find_unloaded(model: Any, directory: Path, loading_info: dict) -> UnloadedWeights | None:
    """What of `directory`'s tensors the model did not load: transformers' unexpected keys, the keys its class
    tells it to ignore silently (`_keys_to_ignore_on_load_unexpected`), and what an earlier save put in
    `UNLOADED_FILE`."""
    stored = weight_map(directory)
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    names = set(loading_info.get("unexpected_keys") or ())
    names |= {name for name in stored if any(re.search(pattern, name) for pattern in patterns)}
    names |= {name for name, file in stored.items() if file == UNLOADED_FILE}
    names &= set(stored)  # only tensors that exist on disk under that name can be copied
    return UnloadedWeights(directory, tuple(sorted(names))) if names else None


def load_keeping_unloaded(model_class: Any, path: str | Path, **options: Any) -> Any:
    """`model_class.from_pretrained(path, **options)`, remembering on the model what it did not load."""
    model, info = model_class.from_pretrained(path, output_loading_info=True, **options)
    remember(model, find_unloaded(model, model_directory(path, options), info))
    return model


def model_directory(path: str | Path, options: dict[str, Any]) -> Path:
    """Where `from_pretrained(path)` read the weights: `path` itself, or for a hub id the snapshot of the local
    hub cache it was downloaded into (at the revision and cache directory the options name)."""
    local = Path(path)
    if local.is_dir():
        return local
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(
            str(path), "config.json", cache_dir=options.get("cache_dir"), revision=options.get("revision")
        )
    except ValueError:  # not a hub id either
        return local
    return Path(found).parent if isinstance(found, str) else local


def remember(model: Any, unloaded: UnloadedWeights | None) -> None:
    object.__setattr__(model, ATTRIBUTE, unloaded)  # plain data on the instance, outside nn.Module's registries


def recall(model: Any) -> UnloadedWeights | None:
    """What `model` (or the model a PEFT wrapper holds) did not load; None when everything loaded."""
    for candidate in (
        model,
        getattr(model, "base_model", None),
        getattr(getattr(model, "base_model", None), "model", None),
    ):
        if candidate is not None and ATTRIBUTE in vars(candidate):
            return vars(candidate)[ATTRIBUTE]
    return None


def copy_unloaded(unloaded: UnloadedWeights | None, directory: Path) -> int:
    """Copy the unloaded tensors into `directory` (just written by `save_pretrained`) and list them in its index;
    returns how many were copied."""
    if unloaded is None:
        return 0
    files = weight_map(unloaded.source)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted({files[name] for name in unloaded.names}):
        with safe_open(str(unloaded.source / file), framework="pt") as handle:
            for name in unloaded.names:
                if files[name] == file:
                    tensors[name] = handle.get_tensor(name)
    saved = weight_map(directory)
    if clashes := sorted(set(tensors) & set(saved)):
        raise ValueError(f"{directory}: {clashes[0]} is both saved by the model and one it did not load")
    save_file(tensors, directory / UNLOADED_FILE, metadata={"format": "pt"})
    total = sum(_file_bytes(directory, file) for file in set(saved.values()))
    total += sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": {**saved, **dict.fromkeys(tensors, UNLOADED_FILE)}}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return len(tensors)


DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1}


def _file_bytes(directory: Path, file: str) -> int:
    """The bytes of a safetensors file's tensors (the index's `total_size` counts those, not headers)."""
    total = 0
    with safe_open(str(directory / file), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
            piece = handle.get_slice(name)
            total += math.prod(piece.get_shape()) * DTYPE_BYTES.get(piece.get_dtype(), 1)
    return total
