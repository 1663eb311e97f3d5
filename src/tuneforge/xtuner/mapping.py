"""An xtuner 0.1.x config, read by `evaluate`, mapped onto a tuneforge config.

Every field of every dict the mapping visits is either used, known to need nothing in tuneforge, or listed
as unmapped with its line and the reason. xtuner counts `save_steps`, `evaluation_freq` and logger
intervals in iterations (one micro-batch per rank); tuneforge counts optimizer steps, one per
`accumulative_counts` iterations: those are converted and the conversion is printed. Values a config
reaches through xtuner's own modules (`SYSTEM_TEMPLATE.x`, `PROMPT_TEMPLATE.x`) are read from xtuner's
installed templates.py with the same safe reader (never imported); without xtuner they are listed as unmapped.
Nothing but plain data reaches the YAML, and nothing but a UserError leaves `import_config`.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuneforge.data.templates import BUILT_IN
from tuneforge.errors import UserError
from tuneforge.xtuner.evaluate import Call, Module, Symbol, read_config

DEEPSPEED_PRESETS = {
    "deepspeed_zero1": {"engine": "deepspeed", "zero_stage": 1},
    "deepspeed_zero2": {"engine": "deepspeed", "zero_stage": 2},
    "deepspeed_zero2_offload": {"engine": "deepspeed", "zero_stage": 2, "cpu_offload": "optimizer"},
    "deepspeed_zero3": {"engine": "deepspeed", "zero_stage": 3},
    "deepspeed_zero3_offload": {"engine": "deepspeed", "zero_stage": 3, "cpu_offload": "all"},
}
MAP_FUNCTIONS = {"openai_map_fn": "openai", "alpaca_map_fn": "alpaca"}
"""xtuner dataset map functions and the tuneforge format that reads the same records."""
PREFERENCE_MODELS = {"DPO": "dpo", "ORPO": "orpo"}
"""xtuner's preference wrappers and the `train.objective` that trains the same loss."""
PAIR_MAP_FUNCTIONS = ("orpo_dpo_mix_40k_map_fn",)
"""xtuner map functions for preference rows that tuneforge's pair reader reads as they are: `chosen` and
`rejected` whole conversations sharing their prompt (the reader takes the shared first messages as it)."""
REFUSED_MODELS = {
    "LLaVAModel": "vision-language training (image encoder and projector); tuneforge fine-tunes text-only models",
    "InternVL_V1_5": "vision-language training (image encoder and projector); tuneforge fine-tunes text-only models",
    "RewardModel": "reward-model training; tuneforge trains causal LMs (SFT, DPO, ORPO), not scalar heads yet",
}
"""xtuner model wrappers whose training tuneforge does not do: the whole config is refused, with this reason."""
LOCAL_LOADERS = ("json", "parquet")
"""`load_dataset(path=...)` builders whose `data_files` tuneforge reads itself."""
TEMPLATE_SYMBOL = re.compile(r"xtuner\.utils(?:\.templates)?\.(SYSTEM_TEMPLATE|PROMPT_TEMPLATE)\.(\w+)")
TEMPLATE_KEYS = {
    "SYSTEM": "system",
    "INSTRUCTION": "instruction",
    "SUFFIX": "suffix",
    "SUFFIX_AS_EOS": "suffix_as_eos",
    "SEP": "sep",
    "STOP_WORDS": "stop_words",
}
"""xtuner PROMPT_TEMPLATE keys and the inline `data.template` fields with the same meaning."""
NO_XTUNER = "its text is in xtuner's package, not installed here: pip install xtuner==0.1.23 --no-deps, or set {}"
SHAREGPT_LIKE = ("sharegpt", "conversations")
NOT_NEEDED = {
    "remove_unused_columns": "tuneforge keeps only what it tokenizes",
    "padding_side": "tuneforge pads on the right",
    "task_type": "always a causal language model",
    "collate_fn": "tuneforge collates with minimal padding itself",
    "sampler": "tuneforge shuffles by seed and epoch and shards per rank itself",
    "num_workers": "tuneforge prepares and caches tokenized data up front; no loader workers are needed",
    "use_varlen_attn": "packed samples are always isolated (per-sample SDPA, eager with a block mask, flash varlen)",
    "shuffle_before_pack": "tuneforge packs with best-fit decreasing and shuffles the packed rows every epoch",
    "llm_int8_threshold": "bitsandbytes default (6.0)",
    "llm_int8_has_fp16_weight": "bitsandbytes default (False)",
    "load_in_8bit": "read together with load_in_4bit",
    "error_if_nonfinite": "tuneforge skips and reports non-finite steps (train.max_nonfinite_steps)",
    "convert_to_iter_based": "tuneforge schedules by optimizer step",
    "by_epoch": "tuneforge schedules by optimizer step",
}
RUNTIME_NOT_NEEDED = {
    "env_cfg": "tuneforge picks the backend (NCCL on GPU, gloo on CPU) and start method",
    "visualizer": "metrics go to metrics.jsonl",
    "log_level": "tuneforge's console output is fixed",
    "log_processor": "tuneforge logs by optimizer step",
    "load_from": "use model.path, or --resume",
    "resume": "use tuneforge train --resume auto",
    "train_cfg": "read for max_epochs / max_iters",
}


@dataclass
class Imported:
    config: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    """Conversions worth reading (iterations to steps, dtype choices)."""
    unmapped: list[tuple[int, str, str]] = field(default_factory=list)
    """(line, what, why) for everything that has no tuneforge equivalent."""
    launch: str = ""


def _name(value: Any) -> str:
    if isinstance(value, Symbol):
        return value.name
    if isinstance(value, Call):
        return _name(value.type) if value.type is not None else "dict"
    return value if isinstance(value, str) else type(value).__name__


def _show(value: Any) -> str:
    """A short rendering for report lines: dotted paths for symbols, `Type(...)` for calls."""
    if isinstance(value, Symbol):
        return value.path
    if isinstance(value, Call):
        return f"{_name(value)}({', '.join(value.fields)})"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _xtuner_templates() -> dict[str, Call] | None:
    """xtuner's own utils/templates.py where xtuner is installed, read by the safe reader: never imported.

    `find_spec` of a top-level package only locates it; its `__init__` is not run. None without xtuner.
    """
    try:
        spec = importlib.util.find_spec("xtuner")
    except (ImportError, ValueError):  # ValueError: a half-initialised module in sys.modules
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "utils" / "templates.py"
        if path.is_file():
            return _read_templates(path, path.stat().st_mtime_ns)
    return None


@functools.lru_cache(maxsize=8)
def _read_templates(path: Path, mtime_ns: int) -> dict[str, Call]:
    """The `NAME = ConfigDict(...)` tables of a templates.py (mtime_ns keys the cache to the file's version)."""
    try:
        module = read_config(path)
    except UserError:
        return {}
    return {name: value for name, value in module.values.items() if isinstance(value, Call)}


class Unresolved(Exception):
    """A value reached through xtuner that cannot be carried over; the message says why."""


def _plain(value: Any, where: str, line: int, origins: dict[int, int], unmapped: list) -> tuple[bool, Any]:
    """(ok, value) with tuples as lists; anything YAML cannot hold as plain data is listed as unmapped."""
    line = origins.get(id(value), line)
    if value is None or isinstance(value, (str, bool, int, float)):
        return True, value
    if isinstance(value, (list, tuple)):
        items = [_plain(item, f"{where}[{i}]", line, origins, unmapped) for i, item in enumerate(value)]
        # A list missing an element would mean something else (fewer files, other betas): all or nothing.
        return all(ok for ok, _ in items), [item for _, item in items]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        entries = {key: _plain(item, f"{where}.{key}", line, origins, unmapped) for key, item in value.items()}
        return True, {key: item for key, (ok, item) in entries.items() if ok}
    unmapped.append((line, f"{where} = {_show(value)}", "an xtuner or Python object, not a value tuneforge can hold"))
    return False, None


def _dtype(value: Any) -> str | None:
    name = _name(value).removeprefix("torch.")
    return {"float16": "float16", "half": "float16", "bfloat16": "bfloat16", "float32": "float32"}.get(name)


class Mapper:
    def __init__(self, module: Module, config_path: Path):
        self.module = module
        self.path = config_path
        self.result = Imported(config={"model": {}, "data": {}, "train": {}, "parallel": {}, "checkpoint": {}})
        self.used: set[tuple[int, str]] = set()
        self.origins: dict[int, int] = {}
        """id(value) -> the line it was read from, for locating values found unusable only at the end."""
        self.stage = "model"
        """The section being mapped, named when an unexpected value stops the mapping."""

    # -- helpers ---------------------------------------------------------------------------------------------
    def section(self, name: str) -> dict[str, Any]:
        return self.result.config.setdefault(name, {})

    def take(self, call: Call | None, key: str) -> Any:
        if not isinstance(call, Call) or key not in call.fields:
            return None
        self.used.add((id(call), key))
        value = call.fields[key]
        self.origins.setdefault(id(value), call.lines.get(key, call.line))
        return value

    def line(self, call: Call, key: str) -> int:
        return call.lines.get(key, call.line)

    def number(self, call: Call | None, key: str, where: str) -> int | float | None:
        """A numeric field, or None (listed as unmapped) when it is something the reader kept as a symbol or text."""
        value = self.take(call, key)
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return value
        assert isinstance(call, Call)
        self.unmapped(self.line(call, key), f"{where}.{key} = {_show(value)}", "not a number")
        return None

    def strings(self, value: Any, line: int, what: str, fix: str) -> list[str] | None:
        """One string or a list of them, as a list; anything else is listed as unmapped with `fix`."""
        if isinstance(value, str):
            return [value]
        if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
            return list(value)
        self.unmapped(line, f"{what} = {_show(value)}", f"not a string or a list of strings; {fix}")
        return None

    def xtuner_value(self, value: Any, setting: str) -> Any:
        """`SYSTEM_TEMPLATE.x` / `PROMPT_TEMPLATE.x` read from xtuner's installed templates.py; other values as is."""
        if not isinstance(value, Symbol):
            return value
        match = TEMPLATE_SYMBOL.fullmatch(value.path)
        if match is None:
            raise Unresolved(f"{value.path} is code, not a value; set {setting}")
        tables = _xtuner_templates()
        if tables is None:
            raise Unresolved(NO_XTUNER.format(setting))
        table = tables.get(match[1])
        if table is None or match[2] not in table.fields:
            raise Unresolved(f"the installed xtuner has no {match[1]}.{match[2]}; set {setting}")
        return table.fields[match[2]]

    def text(self, value: Any, line: int, what: str, setting: str) -> str | None:
        """A text setting (a system prompt) resolved through xtuner's templates, or None and an unmapped line."""
        try:
            value = self.xtuner_value(value, setting)
        except Unresolved as exc:
            self.unmapped(line, f"{what} = {_show(value)}", str(exc))
            return None
        if not isinstance(value, str):
            self.unmapped(line, f"{what} = {_show(value)}", f"not a text; set {setting}")
            return None
        return value

    def template(self, value: Any, line: int) -> str | dict[str, Any] | None:
        """A tuneforge built-in template of the same name, else the xtuner template's fields as an inline one."""
        if isinstance(value, Symbol) and value.name in BUILT_IN:
            return value.name
        try:
            fields = self.xtuner_value(value, "data.template")
        except Unresolved as exc:
            self.unmapped(line, f"prompt template {_show(value)}", str(exc))
            return None
        if isinstance(fields, Call) and fields.type is None:
            fields = fields.fields
        if not isinstance(fields, dict) or not fields:
            self.unmapped(line, f"prompt template {_show(value)}", "not a template; set data.template")
            return None
        inline = {TEMPLATE_KEYS[k]: v for k, v in fields.items() if k in TEMPLATE_KEYS}
        for key in fields.keys() - TEMPLATE_KEYS.keys():
            self.unmapped(line, f"prompt template {_show(value)}: {key}", "no tuneforge template field")
        if isinstance(value, Symbol):
            self.result.notes.append(f"{value.path}: not built in; its fields read from xtuner's templates.py")
        return inline

    def skip(self, call: Call, key: str) -> None:
        self.used.add((id(call), key))

    def unmapped(self, line: int, what: str, why: str) -> None:
        self.result.unmapped.append((line, what, why))

    def leftovers(self, call: Call, where: str) -> None:
        """Fields of `call` nothing took: explained when known not to be needed, else listed as unmapped."""
        for key, value in call.fields.items():
            if (id(call), key) in self.used:
                continue
            if key in NOT_NEEDED:
                continue
            self.unmapped(self.line(call, key), f"{where}.{key} = {_show(value)}", "no tuneforge equivalent")

    def iterations_to_steps(self, iterations: int, accumulation: int, what: str) -> int:
        steps = max(1, round(iterations / accumulation))
        self.result.notes.append(
            f"{what}: {iterations} iterations / accumulative_counts {accumulation} = "
            f"{iterations / accumulation:g} optimizer steps -> {steps}"
        )
        return steps

    # -- sections --------------------------------------------------------------------------------------------
    def run(self, deepspeed: str | None, nproc_per_node: int | None) -> Imported:
        values = self.module.values
        model = values.get("model")
        if not isinstance(model, Call):
            unread = [(line, why) for line, why in self.module.skipped if why.startswith("`model = ...`")]
            if unread:
                line, why = unread[-1]
                raise UserError(f"{self.path}:{line}: {why}; write that field as a literal value")
            raise UserError(f"{self.path}: no `model = dict(...)` found; is this an xtuner config?")
        if values.get("framework") == "huggingface":  # xtuner's other config kind: HF Trainer arguments
            raise UserError(
                f"{self.path}:{self.module.lines['framework']}: framework = 'huggingface' cannot be carried over: "
                "a config for xtuner's Hugging Face Trainer path; tuneforge maps its mmengine configs"
            )
        kind = _name(model.type)
        if kind != "SupervisedFinetune" and kind not in PREFERENCE_MODELS:
            why = REFUSED_MODELS.get(kind, "tuneforge maps xtuner's SupervisedFinetune, DPO and ORPO only")
            raise UserError(f"{self.path}:{model.line}: model type {kind} cannot be carried over: {why}")
        if kind in PREFERENCE_MODELS:
            self.map_preference(model, PREFERENCE_MODELS[kind])
        self.map_model(model, values.get("tokenizer"))
        self.stage = "train_dataloader"
        self.map_data(values.get("train_dataloader"))
        self.stage = "optim_wrapper"
        accumulation = self.map_optimizer(values.get("optim_wrapper"))
        self.stage = "param_scheduler"
        self.map_schedule(values.get("param_scheduler"), values.get("train_cfg"), accumulation)
        self.stage = "custom_hooks / default_hooks"
        self.map_hooks(values.get("custom_hooks") or [], values.get("default_hooks"), accumulation)
        self.stage = "runtime settings"
        self.map_runtime(deepspeed, nproc_per_node)
        return self.result

    def map_model(self, model: Call, tokenizer: Any) -> None:
        out = self.section("model")
        llm = self.take(model, "llm")
        if isinstance(llm, Call):
            path = self.take(llm, "pretrained_model_name_or_path")
            # A local directory is resolved from where xtuner would have been started; a hub id stays as is.
            out["path"] = str(Path(path).resolve()) if isinstance(path, str) and Path(path).is_dir() else path
            out["trust_remote_code"] = bool(self.take(llm, "trust_remote_code"))
            dtype = _dtype(self.take(llm, "torch_dtype"))
            if dtype == "float16":
                self.result.notes.append(
                    "torch_dtype float16 -> model.dtype bfloat16: tuneforge trains in bf16 (same memory as fp16, no "
                    "loss scaling); DeepSeek-V2 and most current models were trained in bf16"
                )
                dtype = "bfloat16"
            if dtype:
                out["dtype"] = dtype
            quantization = self.take(llm, "quantization_config")
            if isinstance(quantization, Call):
                out["quantization"] = self.map_quantization(quantization)
            self.leftovers(llm, "model.llm")
        lora = self.take(model, "lora")
        if isinstance(lora, Call):
            out["lora"] = self.map_lora(lora)
        checkpointing = self.take(model, "use_activation_checkpointing")
        self.section("train")["gradient_checkpointing"] = checkpointing is None or bool(checkpointing)
        if checkpointing is None:
            self.result.notes.append(
                "use_activation_checkpointing not set -> train.gradient_checkpointing: true (xtuner's default)"
            )
        if self.take(model, "use_varlen_attn"):
            self.result.notes.append("use_varlen_attn: packed samples are isolated in attention on every backend")
        self.leftovers(model, "model")
        if isinstance(tokenizer, Call):
            source = self.take(tokenizer, "pretrained_model_name_or_path")
            if source and source != out.get("path"):
                out["tokenizer"] = source
            self.take(tokenizer, "trust_remote_code")
            self.leftovers(tokenizer, "tokenizer")

    def map_preference(self, model: Call, objective: str) -> None:
        """DPO's and ORPO's own settings; the language model and its adapters are mapped as for SFT."""
        self.section("train")["objective"] = objective
        preference = self.section("preference")
        beta = self.number(model, "beta", "model")
        if objective == "orpo":
            if beta is not None:
                preference["lambda"] = beta  # xtuner's ORPO calls the odds-ratio weight beta
            return
        if beta is not None:
            preference["beta"] = beta
        loss_type = self.take(model, "loss_type")
        if loss_type == "kto_pair":
            self.unmapped(
                self.line(model, "loss_type"),
                "loss_type = 'kto_pair'",
                "its KL term is a mean over the whole batch, which accumulation and several ranks cannot reproduce; "
                "pick another preference.loss_type",
            )
        elif loss_type is not None:
            preference["loss_type"] = loss_type
        if (smoothing := self.number(model, "label_smoothing", "model")) is not None:
            preference["label_smoothing"] = smoothing
        lora = isinstance(model.get("lora"), Call)
        if self.take(model, "ref_llm") is not None or not lora:
            how = "the base with the adapters disabled" if lora else "precomputed once, before training"
            self.result.notes.append(f"DPO reference (xtuner: a copy of the model) -> {how}; no second model held")

    def map_quantization(self, call: Call) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.take(call, "load_in_8bit") and not call.get("load_in_4bit"):
            out["bits"] = 8
        elif self.take(call, "load_in_4bit"):
            out["bits"] = 4
        if (quant_type := self.take(call, "bnb_4bit_quant_type")) is not None:
            out["quant_type"] = quant_type
        if (double := self.take(call, "bnb_4bit_use_double_quant")) is not None:
            out["double_quant"] = bool(double)
        compute = _dtype(self.take(call, "bnb_4bit_compute_dtype"))
        if compute == "float16":
            self.result.notes.append("bnb_4bit_compute_dtype float16 -> bfloat16, as for the weights")
            compute = "bfloat16"
        if compute:
            out["compute_dtype"] = compute
        if call.get("llm_int8_threshold", 6.0) != 6.0 or call.get("llm_int8_has_fp16_weight", False):
            self.unmapped(call.line, "llm_int8_threshold / llm_int8_has_fp16_weight", "only the defaults are supported")
        self.leftovers(call, "quantization_config")
        return out

    def map_lora(self, call: Call) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for source, target in (("r", "r"), ("lora_alpha", "alpha"), ("lora_dropout", "dropout")):
            if (value := self.take(call, source)) is not None:
                out[target] = value
        if (targets := self.take(call, "target_modules")) is not None:
            out["targets"] = targets if targets != "all-linear" else "all-linear"
        else:
            # xtuner then adapts every linear layer but the output head, the routed experts of MoE models included.
            out["targets"], out["experts"] = "all-linear", True
            self.result.notes.append(
                "LoraConfig without target_modules -> model.lora.targets: all-linear, experts: true (as xtuner)"
            )
        bias = self.take(call, "bias")
        if bias not in (None, "none"):
            self.unmapped(self.line(call, "bias"), f"lora.bias = {bias!r}", "tuneforge trains no biases with LoRA")
        if (use_dora := self.take(call, "use_dora")) is not None:
            out["use_dora"] = bool(use_dora)
        if (use_rslora := self.take(call, "use_rslora")) is not None:
            out["use_rslora"] = bool(use_rslora)
        if (modules := self.take(call, "modules_to_save")) is not None:
            fix = "set model.lora.modules_to_save"
            if names := self.strings(modules, self.line(call, "modules_to_save"), "lora.modules_to_save", fix):
                out["modules_to_save"] = names
        self.leftovers(call, "lora")
        return out

    def map_data(self, dataloader: Any) -> None:
        train = self.section("train")
        if not isinstance(dataloader, Call):
            self.unmapped(0, "train_dataloader", "not found; set data.train_files yourself")
            return
        if (batch := self.number(dataloader, "batch_size", "train_dataloader")) is not None:
            train["micro_batch_size"] = batch
        dataset = self.take(dataloader, "dataset")
        for key in ("num_workers", "sampler", "collate_fn"):
            self.skip(dataloader, key)
        self.leftovers(dataloader, "train_dataloader")
        if isinstance(dataset, Call) and _name(dataset) == "ConcatDataset":
            parts = self.take(dataset, "datasets")
            self.leftovers(dataset, "ConcatDataset")
            for part in parts if isinstance(parts, list) else [parts]:
                self.map_dataset(part, self.line(dataset, "datasets"))
        else:
            self.map_dataset(dataset, self.line(dataloader, "dataset"))
        if files := self.section("data").get("train_files"):
            self.result.notes.append(f"data_files resolved from the current directory: {files}")

    def put(self, key: str, value: Any, line: int) -> None:
        """Set data.`key`; parts of a ConcatDataset that disagree on it are listed, as tuneforge takes one."""
        data = self.section("data")
        if key in data and data[key] != value:
            self.unmapped(line, f"ConcatDataset parts with data.{key} {data[key]!r} and {value!r}", "one per config")
        else:
            data[key] = value

    def map_dataset(self, dataset: Any, line: int) -> None:
        if not isinstance(dataset, Call):
            self.unmapped(line, f"train_dataset = {_show(dataset)}", "not a dataset dict; set data.train_files")
            return
        kind = _name(dataset)
        if kind == "build_preference_dataset":
            self.map_pairs(dataset)
            return
        if kind != "process_hf_dataset":
            self.unmapped(
                dataset.line,
                f"train_dataset type {kind}",
                "an xtuner dataset builder with no tuneforge equivalent; convert the data to OpenAI messages, "
                "ShareGPT or Alpaca JSONL and set data.train_files",
            )
            return
        self.map_source(self.take(dataset, "dataset"), self.line(dataset, "dataset"))
        map_fn = self.take(dataset, "dataset_map_fn")
        if map_fn is not None:
            name = _name(map_fn)
            if name in MAP_FUNCTIONS:
                self.put("format", MAP_FUNCTIONS[name], self.line(dataset, "dataset_map_fn"))
            elif any(key in name for key in SHAREGPT_LIKE):
                self.put("format", "sharegpt", self.line(dataset, "dataset_map_fn"))
            else:
                fix = "a custom map function; convert the data to OpenAI messages, ShareGPT or Alpaca records"
                if name == "alpaca_zh_map_fn":  # Alpaca records under other key names
                    fix = "reads instruction_zh/input_zh/output_zh: rename them to instruction/input/output (alpaca)"
                self.unmapped(self.line(dataset, "dataset_map_fn"), f"dataset_map_fn = {name}", fix)
        template_fn = self.take(dataset, "template_map_fn")
        if isinstance(template_fn, Call):
            template = self.take(template_fn, "template")
            if template is not None:
                resolved = self.template(template, self.line(template_fn, "template"))
                if resolved is not None:
                    self.put("template", resolved, self.line(template_fn, "template"))
            self.leftovers(template_fn, "template_map_fn")
        elif template_fn is not None:
            self.unmapped(self.line(dataset, "template_map_fn"), f"template_map_fn = {_show(template_fn)}", "not read")
        if (length := self.number(dataset, "max_length", "train_dataset")) is not None:
            self.put("max_length", int(length), self.line(dataset, "max_length"))
        if (pack := self.take(dataset, "pack_to_max_length")) is not None:
            self.put("packing", bool(pack), self.line(dataset, "pack_to_max_length"))
        self.take(dataset, "tokenizer")
        self.leftovers(dataset, "train_dataset")

    def map_pairs(self, dataset: Call) -> None:
        """xtuner's preference dataset: its source, map function and lengths. Pairs are packed with their answers
        in one row whatever xtuner's varlen settings, so those need nothing."""
        self.map_source(self.take(dataset, "dataset"), self.line(dataset, "dataset"))
        map_fn = self.take(dataset, "dataset_map_fn")
        if map_fn is not None and _name(map_fn) not in PAIR_MAP_FUNCTIONS:
            self.unmapped(
                self.line(dataset, "dataset_map_fn"),
                f"dataset_map_fn = {_name(map_fn)}",
                "a custom map function; write the pairs as prompt/chosen/rejected rows (messages) and set "
                "data.train_files",
            )
        self.put("template", "tokenizer", dataset.line)
        self.result.notes.append(
            "build_preference_dataset renders pairs with the tokenizer's chat template -> data.template: tokenizer"
        )
        if self.take(dataset, "is_reward"):
            self.unmapped(self.line(dataset, "is_reward"), "is_reward = True", "reward-model data is not read yet")
        if (length := self.number(dataset, "max_length", "train_dataset")) is not None:
            self.put("max_length", int(length), self.line(dataset, "max_length"))
        if self.take(dataset, "use_varlen_attn"):
            self.put("packing", True, self.line(dataset, "use_varlen_attn"))
        for key in ("tokenizer", "is_dpo", "reward_token_id", "num_proc", "max_packed_length", "shuffle_before_pack"):
            self.take(dataset, key)
        self.leftovers(dataset, "train_dataset")

    def map_source(self, source: Any, line: int) -> None:
        """`dataset=dict(type=load_dataset, path='json', data_files=...)`: the local files, resolved."""
        if not isinstance(source, Call) or _name(source) != "load_dataset":
            fix = "not datasets' load_dataset; save the data as JSONL and set data.train_files"
            self.unmapped(line, f"dataset = {_show(source)}", fix)
            return
        path, files = self.take(source, "path"), self.take(source, "data_files")
        if path not in LOCAL_LOADERS or files is None:
            self.unmapped(
                self.line(source, "path"),
                f"load_dataset path = {_show(path)}",
                "a Hugging Face Hub dataset or a loader tuneforge does not read; tuneforge reads local JSONL, "
                "JSON, parquet or save_to_disk directories: save it so and set data.train_files",
            )
        else:
            fields = files.fields if isinstance(files, Call) and files.type is None else files
            if isinstance(fields, dict) and "train" in fields:
                files = fields["train"]  # process_hf_dataset trains on the `train` split only
            fix = "set data.train_files"
            if (paths := self.strings(files, self.line(source, "data_files"), "data_files", fix)) is not None:
                # xtuner resolves data paths from the directory it is started in.
                resolved = [str(Path(f).expanduser().resolve()) for f in paths]
                self.section("data").setdefault("train_files", []).extend(resolved)
        self.leftovers(source, "dataset")

    def map_optimizer(self, wrapper: Any) -> int:
        train = self.section("train")
        if not isinstance(wrapper, Call):
            return 1
        accumulation = max(1, int(self.number(wrapper, "accumulative_counts", "optim_wrapper") or 1))
        train["gradient_accumulation"] = accumulation
        optimizer = self.take(wrapper, "optimizer")
        if isinstance(optimizer, Call):
            if _name(optimizer.type) != "AdamW":
                self.unmapped(optimizer.line, f"optimizer {_name(optimizer.type)}", "tuneforge trains with AdamW")
            for source, target in (("lr", "lr"), ("weight_decay", "weight_decay"), ("eps", "eps")):
                if (value := self.take(optimizer, source)) is not None:
                    train[target] = value
            if (betas := self.take(optimizer, "betas")) is not None:
                train["betas"] = list(betas) if isinstance(betas, (list, tuple)) else betas
            self.leftovers(optimizer, "optimizer")
        clip = self.take(wrapper, "clip_grad")
        if isinstance(clip, (Call, dict)):
            max_norm = clip.get("max_norm") if isinstance(clip, dict) else self.number(clip, "max_norm", "clip_grad")
            if max_norm is not None:
                train["max_grad_norm"] = max_norm
            if isinstance(clip, Call):
                self.skip(clip, "error_if_nonfinite")
                self.leftovers(clip, "clip_grad")
        dtype = self.take(wrapper, "dtype")
        scale = self.take(wrapper, "loss_scale")
        if _name(wrapper.type) == "AmpOptimWrapper":
            if dtype in (None, "float16"):
                self.result.notes.append(
                    f"AmpOptimWrapper dtype {dtype or 'float16'} with loss_scale {scale!r} -> train.precision bf16 "
                    "(bf16 autocast needs no loss scaling; on GPUs without bf16 use train.precision=fp16, which "
                    "scales dynamically)"
                )
            train["precision"] = "bf16"
        self.leftovers(wrapper, "optim_wrapper")
        return accumulation

    def map_schedule(self, schedulers: Any, train_cfg: Any, accumulation: int) -> None:
        train = self.section("train")
        max_epochs = self.number(train_cfg, "max_epochs", "train_cfg") if isinstance(train_cfg, Call) else None
        max_iters = self.number(train_cfg, "max_iters", "train_cfg") if isinstance(train_cfg, Call) else None
        if max_epochs is not None:
            train["epochs"] = int(max_epochs)
        if max_iters is not None:
            train["max_steps"] = self.iterations_to_steps(int(max_iters), accumulation, "max_iters")
        if isinstance(train_cfg, Call):
            self.leftovers(train_cfg, "train_cfg")
        for scheduler in schedulers if isinstance(schedulers, list) else [schedulers] if schedulers else []:
            if not isinstance(scheduler, Call):
                continue
            kind = _name(scheduler.type)
            where = f"param_scheduler {kind}"
            begin, end = self.number(scheduler, "begin", where) or 0, self.number(scheduler, "end", where)
            by_epoch = self.take(scheduler, "by_epoch")
            self.skip(scheduler, "convert_to_iter_based")
            if kind == "LinearLR":
                self.take(scheduler, "start_factor")
                if by_epoch and max_epochs and end is not None:
                    train["warmup_ratio"] = round((end - begin) / max_epochs, 6)
                    self.result.notes.append(
                        f"LinearLR warmup over epochs {begin}..{end:g} of {max_epochs} -> "
                        f"train.warmup_ratio {train['warmup_ratio']:g}"
                    )
                elif end is not None:
                    train["warmup_steps"] = self.iterations_to_steps(int(end - begin), accumulation, "LinearLR end")
            elif kind == "CosineAnnealingLR":
                train["schedule"] = "cosine"
                eta_min = self.number(scheduler, "eta_min", where)
                if eta_min:
                    train["min_lr"] = eta_min
            elif kind == "ConstantLR":
                train["schedule"] = "constant"
            else:
                self.unmapped(scheduler.line, f"param_scheduler {kind}", "tuneforge has cosine, linear and constant")
            self.leftovers(scheduler, f"param_scheduler {kind}")

    def map_hooks(self, custom_hooks: Any, default_hooks: Any, accumulation: int) -> None:
        evaluation, data = self.section("eval"), self.section("data")
        if not isinstance(custom_hooks, list):
            line = self.module.lines.get("custom_hooks", 0)
            self.unmapped(line, f"custom_hooks = {_show(custom_hooks)}", "not a list of hooks")
            custom_hooks = []
        for hook in custom_hooks:
            if not isinstance(hook, Call):
                continue
            kind = _name(hook.type)
            if kind == "EvaluateChatHook":
                if (inputs := self.take(hook, "evaluation_inputs")) is not None:
                    line, fix = self.line(hook, "evaluation_inputs"), "set eval.sample_prompts"
                    evaluation["sample_prompts"] = self.strings(inputs, line, "evaluation_inputs", fix) or []
                if (every := self.number(hook, "every_n_iters", "EvaluateChatHook")) is not None:
                    evaluation["sample_every_steps"] = self.iterations_to_steps(
                        int(every), accumulation, "EvaluateChatHook every_n_iters"
                    )
                system = self.take(hook, "system")
                if system:
                    # The prompt xtuner samples with is the one its map functions give the training data.
                    text = self.text(system, self.line(hook, "system"), "EvaluateChatHook.system", "data.system")
                    if text:
                        data["system"] = text
                if (tokens := self.number(hook, "max_new_tokens", "EvaluateChatHook")) is not None:
                    evaluation["sample_max_new_tokens"] = tokens
                for key in ("tokenizer", "prompt_template", "stop_words"):
                    self.take(hook, key)
                self.leftovers(hook, "EvaluateChatHook")
            elif kind in ("DatasetInfoHook", "VarlenAttnArgsToMessageHubHook", "ThroughputHook"):
                continue  # tuneforge prints the data report and throughput itself
            else:
                self.unmapped(hook.line, f"custom hook {kind}", "no tuneforge equivalent")
        if not isinstance(default_hooks, Call):
            return
        logger = self.take(default_hooks, "logger")
        if isinstance(logger, Call) and (interval := self.number(logger, "interval", "LoggerHook")) is not None:
            steps = self.iterations_to_steps(int(interval), accumulation, "LoggerHook interval")
            self.section("log")["every_steps"] = steps
        checkpoint = self.take(default_hooks, "checkpoint")
        if isinstance(checkpoint, Call):
            if (interval := self.number(checkpoint, "interval", "CheckpointHook")) is not None:
                steps = self.iterations_to_steps(int(interval), accumulation, "CheckpointHook interval (save_steps)")
                self.section("checkpoint")["every_steps"] = steps
            keep = self.number(checkpoint, "max_keep_ckpts", "CheckpointHook")
            if keep is not None:
                self.section("checkpoint")["keep_last"] = None if keep < 0 else int(keep)
            self.take(checkpoint, "by_epoch")
            self.leftovers(checkpoint, "CheckpointHook")
        for key in ("timer", "param_scheduler", "sampler_seed"):
            self.take(default_hooks, key)
        self.leftovers(default_hooks, "default_hooks")

    def map_runtime(self, deepspeed: str | None, nproc_per_node: int | None) -> None:
        values, lines = self.module.values, self.module.lines
        randomness = values.get("randomness")
        seed = self.number(randomness, "seed", "randomness") if isinstance(randomness, Call) else None
        if isinstance(randomness, Call):
            if self.take(randomness, "deterministic"):
                self.result.notes.append("randomness.deterministic: tuneforge runs are reproducible by seed on CPU")
            self.leftovers(randomness, "randomness")
        if seed is not None:
            self.section("train")["seed"] = int(seed)
        else:
            self.result.notes.append("randomness.seed is None (random in xtuner) -> train.seed 42, for reproducibility")
        parallel_size = values.get("sequence_parallel_size", 1)
        line = lines.get("sequence_parallel_size", 0)
        if isinstance(parallel_size, int) and not isinstance(parallel_size, bool) and parallel_size > 1:
            self.section("parallel")["sequence_parallel"] = parallel_size
            self.result.notes.append(
                f"sequence_parallel_size = {parallel_size} (line {line}) -> parallel.sequence_parallel: each sample "
                f"split across {parallel_size} ranks; train.micro_batch_size is per group of {parallel_size} ranks, "
                "as in xtuner; the process count must be a multiple of it"
            )
        elif parallel_size not in (None, 1):
            self.unmapped(line, f"sequence_parallel_size = {_show(parallel_size)}", "not a whole number of ranks")
        if deepspeed is not None:
            if deepspeed not in DEEPSPEED_PRESETS:
                raise UserError(f"--deepspeed {deepspeed}: not an xtuner preset; one of {', '.join(DEEPSPEED_PRESETS)}")
            self.section("parallel").update(DEEPSPEED_PRESETS[deepspeed])
        for name, why in RUNTIME_NOT_NEEDED.items():
            if name in values and name != "train_cfg":
                self.result.notes.append(f"{name} (line {lines[name]}): not needed: {why}")
        processes = nproc_per_node or 1
        self.result.launch = "tuneforge train OUT.yaml" + (f" --nproc-per-node {processes}" if processes > 1 else "")
        if processes > 1 and deepspeed is None:
            self.result.notes.append(
                "several processes without --deepspeed: tuneforge will use DDP (parallel.engine auto)"
            )


def import_config(path: Path, deepspeed: str | None = None, nproc_per_node: int | None = None) -> Imported:
    """The tuneforge equivalent of an xtuner config; a UserError, never another exception, for one it cannot read."""
    module = read_config(path)
    mapper = Mapper(module, path)
    try:
        result = mapper.run(deepspeed, nproc_per_node)
    except UserError:
        raise
    except Exception as exc:  # a value of a shape no rule expects: refuse the config, naming where, not crash
        raise UserError(
            f"{path}: {mapper.stage} cannot be carried over: a value of an unexpected shape "
            f"({type(exc).__name__}: {exc}); set it in the YAML yourself"
        ) from None
    for line, why in module.skipped:
        result.unmapped.append((line, "statement", why))
    _, config = _plain(result.config, "config", 0, mapper.origins, result.unmapped)
    result.config = {key: value for key, value in config.items() if value}
    result.unmapped.sort(key=lambda entry: entry[0])
    return result


def _comment(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")  # one report line stays one comment line


def to_yaml(result: Imported, source: Path, out: Path | None = None) -> str:
    """The native config, headed by how to launch it, what was converted and what could not be mapped.

    Values YAML cannot hold as plain data never reach the dumper: they become NOT MAPPED lines here too.
    """
    import yaml

    unmapped = list(result.unmapped)
    _, config = _plain(result.config, "config", 0, {}, unmapped)
    header = [f"# tuneforge config imported from {source}"]
    if result.launch:
        launch = result.launch.replace("OUT.yaml", str(out)) if out else result.launch
        header.append(f"# launch: {launch}" + ("" if out else "  (OUT.yaml: this file)"))
    header += [f"# conversion: {note}" for note in result.notes]
    header += [f"# NOT MAPPED{f' (line {line})' if line else ''}: {what}: {why}" for line, what, why in unmapped]
    body = yaml.safe_dump(config, allow_unicode=True, sort_keys=False, width=110)
    return "\n".join(_comment(line) for line in header) + "\n" + body
