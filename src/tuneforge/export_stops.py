"""The token ids a trained model's replies end at, as every export records them: the tokenizer's EOS and each stop
word of the training chat template that is one token (`<|eot_id|>`, `<|im_end|>`). A server or `generate` that
knows only the EOS runs on past a reply the model ended with its template's own stop token."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from tuneforge.checkpoint_records import CHAT_META
from tuneforge.data.templates import recorded_template
from tuneforge.errors import UserError
from tuneforge.generate import stop_token_ids

GENERATION_CONFIG = "generation_config.json"


def trained_stop_ids(tokenizer: PreTrainedTokenizerBase, meta: dict) -> list[int]:
    """EOS first, then the recorded template's one-token stop words (none recorded: the EOS alone)."""
    spec = meta.get("template")
    stops = [tokenizer.eos_token] if spec is None else recorded_template(spec, Path(CHAT_META)).stop_strings(tokenizer)
    others = [i for i in stop_token_ids(tokenizer, [s for s in stops if s]) if i != tokenizer.eos_token_id]
    return [i for i in [tokenizer.eos_token_id, *others] if i is not None]


def with_stops(existing: int | list[int] | None, stop_ids: list[int]) -> int | list[int] | None:
    """A generation config's `eos_token_id` that also stops at `stop_ids` (the base's own kept: stopping at a token
    training never produced costs nothing); one id stays a plain int, as transformers writes it."""
    kept = [existing] if isinstance(existing, int) else list(existing or [])
    merged = list(dict.fromkeys([*stop_ids, *kept]))
    return merged[0] if len(merged) == 1 else merged or None


def record_stops(directory: Path, stop_ids: list[int], pad_id: int | None, base: str | Path | None = None) -> None:
    """`directory/generation_config.json` stopping at `stop_ids` too, its other settings kept: the one written
    there (a merged export's), else the base's (beside an adapter, so that vLLM's `--generation-config` keeps the
    base's sampling defaults), else a new one. Edited as JSON: transformers' own save validates the whole config
    and refuses some that hub models ship (a temperature without sampling), which are not the export's to fix."""
    path = directory / GENERATION_CONFIG
    source = path if path.is_file() else Path(base) / GENERATION_CONFIG if base is not None else None
    config = _read(source) if source is not None and source.is_file() else {}
    config["eos_token_id"] = with_stops(config.get("eos_token_id"), stop_ids)
    if pad_id is not None:
        config["pad_token_id"] = pad_id
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _read(source: Path) -> dict:
    try:
        config = json.loads(source.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{source}: not a readable generation config ({exc}); fix or remove the file") from None
    if not isinstance(config, dict):
        raise UserError(f"{source}: a generation config is a JSON object; fix or remove the file")
    return config


def write_generation_config(
    directory: Path, base: str | Path, tokenizer: PreTrainedTokenizerBase, meta: dict
) -> list[int]:
    """`generation_config.json` beside an adapter (`record_stops`, from the base's); returns the stop ids."""
    stop_ids = trained_stop_ids(tokenizer, meta)
    record_stops(directory, stop_ids, tokenizer.pad_token_id, base)
    return stop_ids
