"""The token ids a trained model's replies end at, as every export records them: the tokenizer's EOS and each stop
word of the training chat template that is one token (`<|eot_id|>`, `<|im_end|>`). A server or `generate` that
knows only the EOS runs on past a reply the model ended with its template's own stop token."""

from __future__ import annotations

from pathlib import Path

from transformers import GenerationConfig, PreTrainedTokenizerBase

from tuneforge.checkpoint_records import CHAT_META
from tuneforge.data.templates import recorded_template
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


def write_generation_config(
    directory: Path, base: str | Path, tokenizer: PreTrainedTokenizerBase, meta: dict
) -> list[int]:
    """`generation_config.json` beside an adapter: the base's own (if it has one) stopping at the trained stop
    ids too, for `GenerationConfig.from_pretrained` and vLLM's `--generation-config`. Returns those ids."""
    try:
        config = GenerationConfig.from_pretrained(base)
    except OSError:  # the base has none
        config = GenerationConfig()
    stop_ids = trained_stop_ids(tokenizer, meta)
    config.eos_token_id = with_stops(config.eos_token_id, stop_ids)
    if tokenizer.pad_token_id is not None:
        config.pad_token_id = tokenizer.pad_token_id
    config.save_pretrained(directory)
    return stop_ids
