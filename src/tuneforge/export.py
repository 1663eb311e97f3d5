"""`tuneforge export`: a checkpoint as a PEFT adapter, or as a merged full model, in the formats the ecosystem
loads (safetensors, tokenizer with a Jinja chat template, generation config)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from tuneforge.checkpoint_records import CHAT_META, read_chat_meta
from tuneforge.data.jinja_template import to_jinja
from tuneforge.data.templates import PromptTemplate, recorded_template
from tuneforge.errors import UserError
from tuneforge.export_stops import GENERATION_CONFIG, record_stops, trained_stop_ids, write_generation_config
from tuneforge.model.build import model_class
from tuneforge.model.portable_adapter import make_portable, plain_skeleton
from tuneforge.model.unloaded_weights import UNLOADED_FILE, copy_unloaded, recall
from tuneforge.model.vision import VisionParts
from tuneforge.train.checkpoint import remove_entry, share_as_umask_allows
from tuneforge.trained import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_base,
    allow_remote_code,
    base_dtype,
    check_checkpoint,
    is_adapter,
    is_vision_checkpoint,
    load_processor,
    load_trained,
    loading,
)

EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def attach_chat_template(tokenizer: PreTrainedTokenizerBase, meta: dict) -> str:
    """Give the tokenizer the chat template training used, as Jinja; returns what was done."""
    spec = meta.get("template")
    if spec is None:
        return "chat template: none recorded (no tuneforge.json); the tokenizer's own is kept"
    template = recorded_template(spec, Path(CHAT_META))
    if not isinstance(template, PromptTemplate):
        return "chat template: the tokenizer's own (as in training)"
    tokenizer.chat_template = to_jinja(template, meta.get("system"))
    return f"chat template: {spec if isinstance(spec, str) else 'inline'} written as Jinja into tokenizer_config.json"


TMP_MARKER = ".tuneforge-export"
"""Written first into `<parent>/.tmp-<name>`: an export that stopped half-way is recognised as one (and removed by
the next), and a directory of that name without it, which may be someone's data, is never deleted."""


def prepare_out(out: Path) -> Path:
    tmp = check_out(out)
    try:
        remove_entry(tmp)  # a half-written export of an earlier run (`check_out` made sure)
        tmp.mkdir(parents=True)
        (tmp / TMP_MARKER).write_text("tuneforge export in progress\n")
    except OSError as exc:
        raise UserError(f"--out {out}: cannot be created ({exc.strerror}); choose another directory") from None
    return tmp


def check_out(out: Path) -> Path:
    """Refusals of `--out` said before anything is loaded; returns the temporary directory written first."""
    if out.is_symlink():
        raise UserError(
            f"--out {out}: is a symbolic link (to {os.readlink(out)}); export writes a new directory at the path "
            "given and never through a link: pass the real path, or another one"
        )
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: a file of that name exists; export writes a directory: choose another path")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out}: directory exists and is not empty; remove it or choose another")
    from tuneforge.train.inputs import writable_problems

    if problems := writable_problems("--out", out):
        raise UserError(problems[0])
    tmp = out.parent / f".tmp-{out.name}"
    if tmp.is_symlink() or (tmp.exists() and not (tmp.is_dir() and (tmp / TMP_MARKER).is_file())):
        raise UserError(
            f"--out {out}: {tmp} exists and is not a half-written export of tuneforge's (it lacks {TMP_MARKER}, or "
            "is a link or a file); export writes there first: move it away or choose another --out"
        )
    return tmp


def finish_out(tmp: Path, out: Path) -> None:
    _drop_dangling_auto_map(tmp)
    if out.is_symlink():  # made since the export began: never followed, never replaced
        raise UserError(f"--out {out}: became a symbolic link while exporting; the export is left in {tmp}")
    (tmp / TMP_MARKER).unlink()
    share_as_umask_allows(tmp)
    if out.exists():
        out.rmdir()
    tmp.rename(out)


AUTO_MAP_FILES = ("config.json", "tokenizer_config.json")


def _drop_dangling_auto_map(directory: Path) -> None:
    """`auto_map` entries of the exported config and tokenizer config that name Python code not in `directory`
    (the checkpoint's own code, where transformers' native class was used instead, is not copied) are dropped:
    the export then loads with transformers' classes, without remote code, and never fetches code from elsewhere
    (a `repo--module.Class` entry)."""
    present = {path.stem for path in directory.glob("*.py")}

    def local(reference: object) -> bool:
        if reference is None:
            return True
        if not isinstance(reference, str) or "--" in reference:
            return False
        return reference.rpartition(".")[0] in present

    for name in AUTO_MAP_FILES:
        path = directory / name
        if not path.is_file():
            continue
        config = json.loads(path.read_text(encoding="utf-8"))
        auto_map = config.get("auto_map") if isinstance(config, dict) else None
        if auto_map is None:
            continue
        kept = {}
        if isinstance(auto_map, dict):
            for key, value in auto_map.items():
                references = value if isinstance(value, list | tuple) else [value]
                if all(local(reference) for reference in references):
                    kept[key] = value
        if kept == auto_map:
            continue
        if kept:
            config["auto_map"] = kept
        else:
            del config["auto_map"]
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def export(
    checkpoint: Path,
    out: Path,
    merge: bool,
    dtype_name: str | None,
    base: Path | None = None,
    trust_remote_code: bool = False,
) -> list[str]:
    """Write the export atomically; returns lines describing it."""
    check_out(out)  # before the model loads: a refused --out is said at once
    meta = read_chat_meta(checkpoint) or {}
    adapter = is_adapter(checkpoint)
    if adapter and not merge:
        check_checkpoint(checkpoint)  # the merge path checks it inside load_trained
        return _export_adapter(checkpoint, out, dtype_name, base, meta, trust_remote_code)
    trained = load_trained(checkpoint, base, merge=True, trust_remote_code=trust_remote_code)
    dtype = EXPORT_DTYPES[dtype_name] if dtype_name else base_dtype(trained.base or str(checkpoint))
    tmp = prepare_out(out)
    model = trained.model.to(dtype)
    scores = getattr(model, "generation_config", None) is None
    if scores:  # a reward model: transformers reads each conversation's score at its last token that is not the pad
        model.config.pad_token_id = trained.tokenizer.pad_token_id
    model.save_pretrained(tmp, safe_serialization=True)
    if not scores:
        record_stops(tmp, trained_stop_ids(trained.tokenizer, meta), trained.tokenizer.pad_token_id)
    carried = copy_unloaded(recall(trained.model), tmp)
    # A vision-language model's processor (image processor, tokenizer, chat template), for AutoProcessor.
    saved = trained.processor or trained.tokenizer
    note = attach_chat_template(trained.processor.tokenizer if trained.processor else trained.tokenizer, meta)
    saved.save_pretrained(tmp)
    (tmp / CHAT_META).write_text(json.dumps({k: v for k, v in meta.items() if k != "adapter"}, indent=2))
    finish_out(tmp, out)
    what = "merged into the dequantized base" if meta.get("adapter", {}).get("quantization") else "merged"
    kind = f"adapter {what}" if adapter else "full model"
    if scores:
        kind = f"reward model ({kind}; AutoModelForSequenceClassification)"
    lines = [f"exported {kind}: {out} ({str(dtype).removeprefix('torch.')}, safetensors)", note]
    if carried:
        lines.append(f"kept {recall(trained.model).describe()} unchanged, in {UNLOADED_FILE}")
    return lines


def _export_adapter(
    checkpoint: Path, out: Path, dtype_name: str | None, base: Path | None, meta: dict, trust_remote_code: bool
) -> list[str]:
    base_path = adapter_base(checkpoint, base)
    remote = allow_remote_code(base_path, trust_remote_code, bool(meta.get("adapter", {}).get("trust_remote_code")))
    tmp = prepare_out(out)
    config = json.loads((checkpoint / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = str(Path(base_path).resolve())
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    base_config = AutoConfig.from_pretrained(base_path, trust_remote_code=remote)
    base_class = model_class(config.get("task_type") == "SEQ_CLS", is_vision_checkpoint(base_path))
    portable = make_portable(tmp, base_config.model_type, plain_skeleton(base_class, base_config))
    weights = load_file(checkpoint / ADAPTER_WEIGHTS)
    if dtype_name:
        weights = {name: tensor.to(EXPORT_DTYPES[dtype_name]) for name, tensor in weights.items()}
    save_file(weights, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    # An adapter's tokenizer files are the checkpoint's: code they name never runs (transformers would ask).
    with loading("tokenizer", checkpoint):
        tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=False)
    processor = load_processor(checkpoint) if is_vision_checkpoint(base_path) else None
    note = attach_chat_template(processor.tokenizer if processor else tokenizer, meta)
    (processor or tokenizer).save_pretrained(tmp)
    stops = write_generation_config(tmp, base_path, tokenizer, meta)
    (tmp / CHAT_META).write_text(json.dumps(meta, indent=2))
    finish_out(tmp, out)
    lines = [f"exported adapter: {out} (base {base_path}; load with PeftModel.from_pretrained)", note]
    lines.append(f"stops at token ids {stops} ({GENERATION_CONFIG}: GenerationConfig.from_pretrained({out}))")
    if processor is not None and (beyond := adapters_beyond_language(checkpoint / ADAPTER_WEIGHTS, base_path)):
        lines.append(
            f"note: this adapter also changes the model's {beyond}; vLLM loads LoRA adapters on the language model "
            "only, so serve the merged form there (tuneforge export CHECKPOINT --out DIR --merge)"
        )
    if portable:
        lines.append(portable)
    if meta.get("adapter", {}).get("quantization"):
        lines.append(
            "note: trained against the k-bit base; load the base with the same BitsAndBytesConfig for the outputs "
            "seen in training, or export --merge (on MoE models with stacked experts, which tuneforge also stores "
            "in 4 bits and a BitsAndBytesConfig leaves in full precision, only tuneforge's loader or --merge does)"
        )
    return lines


def adapters_beyond_language(weights: Path, base_path: str) -> str:
    """The parts of a vision-language model besides its language model that an adapter's weights (`weights`, its
    safetensors file) change, as words (adapters on the tower, a projector saved whole); empty when it changes
    the language model alone."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        skeleton = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(base_path))
    parts = VisionParts.of(skeleton)
    if parts is None:
        return ""
    with safe_open(str(weights), framework="pt") as handle:
        names = {parts.part_of(key.removeprefix("base_model.model.")) for key in handle.keys()}  # noqa: SIM118
    return " and ".join(part for part in ("tower", "projector") if part in names)
