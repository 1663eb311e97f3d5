"""`tuneforge export CKPT --format gguf`: the checkpoint (adapters merged) as `model.gguf` and a `Modelfile`."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig

from tuneforge.checkpoint_records import CHAT_META, read_chat_meta
from tuneforge.data.templates import PromptTemplate, recorded_template
from tuneforge.errors import UserError
from tuneforge.export import attach_chat_template, check_out, finish_out, prepare_out
from tuneforge.export_stops import trained_stop_ids
from tuneforge.gguf_export.architectures import gguf_architecture
from tuneforge.gguf_export.modelfile import go_template, modelfile
from tuneforge.gguf_export.write import OUTTYPES, write_gguf
from tuneforge.train.checkpoint import remove_entry
from tuneforge.trained import adapter_base, is_adapter, is_reward_model, is_vision_checkpoint, load_trained

GGUF_FILE = "model.gguf"
MODELFILE = "Modelfile"


def _refuse_early(model_dir: Path, outtype: str) -> None:
    """What is refused before the model loads (minutes, for a large one); `model_dir` the full model or an
    adapter's base."""
    if outtype not in OUTTYPES:
        raise UserError(f"--outtype {outtype}: choose one of {', '.join(OUTTYPES)}")
    if is_vision_checkpoint(model_dir):
        raise UserError(
            "export --format gguf: vision-language models are not converted (llama.cpp keeps their vision tower "
            "in a separate mmproj file); export --merge for transformers, vLLM or SGLang"
        )
    if (model_dir / "config.json").exists():
        gguf_architecture(AutoConfig.from_pretrained(model_dir, trust_remote_code=False))


def export_gguf(
    checkpoint: Path, out: Path, outtype: str, base: Path | None = None, trust_remote_code: bool = False
) -> list[str]:
    check_out(out)
    if is_reward_model(checkpoint):
        raise UserError("export --format gguf: a reward model scores text; llama.cpp's GGUF here holds chat models")
    _refuse_early(Path(adapter_base(checkpoint, base)) if is_adapter(checkpoint) else checkpoint, outtype)
    meta = read_chat_meta(checkpoint) or {}
    trained = load_trained(checkpoint, base, merge=True, trust_remote_code=trust_remote_code)
    tokenizer = trained.tokenizer
    note = attach_chat_template(tokenizer, meta)
    template = recorded_template(meta["template"], Path(CHAT_META)) if meta.get("template") is not None else None
    tmp = prepare_out(out)
    try:
        stop_ids = trained_stop_ids(tokenizer, meta)
        written = write_gguf(
            trained.model, tokenizer, tokenizer.chat_template, tmp / GGUF_FILE, outtype, out.name, stop_ids
        )
    except BaseException:
        remove_entry(tmp)
        raise
    if isinstance(template, PromptTemplate):
        go = go_template(template, tokenizer.bos_token, tokenizer.eos_token, meta.get("system"))
        stops = template.stop_strings(tokenizer)
    else:
        go, stops = None, [tokenizer.eos_token]
    (tmp / MODELFILE).write_text(modelfile(GGUF_FILE, go, stops), encoding="utf-8")
    (tmp / CHAT_META).write_text(json.dumps({k: v for k, v in meta.items() if k != "adapter"}, indent=2))
    finish_out(tmp, out)
    size = written.bytes / 2**20
    lines = [
        f"exported GGUF: {out / GGUF_FILE} ({written.arch}, {outtype}, {written.tensors} tensors, {size:.1f} MiB; "
        f"tokenizer pre-split {written.scheme!r})",
        note.replace("into tokenizer_config.json", "into the GGUF (tokenizer.chat_template)"),
        f"Ollama: ollama create NAME -f {out / MODELFILE}"
        + ("" if go else " (the GGUF's own Jinja template is the tokenizer's; Ollama may map it to a known one)"),
    ]
    return lines
