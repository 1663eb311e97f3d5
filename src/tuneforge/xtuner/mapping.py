"""An xtuner 0.1.x config, read by `evaluate`, mapped onto a tuneforge config.

Every field of every dict the mapping visits is either used, known to need nothing in tuneforge, or listed
as unmapped with its line and the reason. xtuner counts `save_steps`, `evaluation_freq` and logger
intervals in iterations (one micro-batch per rank); tuneforge counts optimizer steps, one per
`accumulative_counts` iterations: those are converted and the conversion is printed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuneforge.data.templates import BUILT_IN
from tuneforge.errors import UserError
from tuneforge.xtuner.evaluate import Call, Module, Symbol

DEEPSPEED_PRESETS = {
    "deepspeed_zero1": {"engine": "deepspeed", "zero_stage": 1},
    "deepspeed_zero2": {"engine": "deepspeed", "zero_stage": 2},
    "deepspeed_zero2_offload": {"engine": "deepspeed", "zero_stage": 2, "cpu_offload": "optimizer"},
    "deepspeed_zero3": {"engine": "deepspeed", "zero_stage": 3},
    "deepspeed_zero3_offload": {"engine": "deepspeed", "zero_stage": 3, "cpu_offload": "all"},
}
MAP_FUNCTIONS = {"openai_map_fn": "openai", "alpaca_map_fn": "alpaca", "alpaca_zh_map_fn": "alpaca"}
"""xtuner dataset map functions and the tuneforge format that reads the same records."""
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
    return value.name if isinstance(value, Symbol) else str(value)


def _dtype(value: Any) -> str | None:
    name = _name(value).removeprefix("torch.")
    return {"float16": "float16", "half": "float16", "bfloat16": "bfloat16", "float32": "float32"}.get(name)


class Mapper:
    def __init__(self, module: Module, config_path: Path):
        self.module = module
        self.path = config_path
        self.result = Imported(config={"model": {}, "data": {}, "train": {}, "parallel": {}, "checkpoint": {}})
        self.used: set[tuple[int, str]] = set()

    # -- helpers ---------------------------------------------------------------------------------------------
    def section(self, name: str) -> dict[str, Any]:
        return self.result.config.setdefault(name, {})

    def take(self, call: Call | None, key: str) -> Any:
        if not isinstance(call, Call) or key not in call.fields:
            return None
        self.used.add((id(call), key))
        return call.fields[key]

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
            self.unmapped(call.lines.get(key, call.line), f"{where}.{key} = {value!r}", "no tuneforge equivalent")

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
            raise UserError(f"{self.path}: no `model = dict(...)` found; is this an xtuner config?")
        self.map_model(model, values.get("tokenizer"))
        dataloader = values.get("train_dataloader")
        self.map_data(dataloader)
        accumulation = self.map_optimizer(values.get("optim_wrapper"))
        self.map_schedule(values.get("param_scheduler"), values.get("train_cfg"), accumulation)
        self.map_hooks(values.get("custom_hooks") or [], values.get("default_hooks"), accumulation)
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
            note = "LoraConfig without target_modules -> model.lora.targets: all-linear, experts: true (as xtuner)"
            if out.get("dropout"):
                note += (
                    f"; lora_dropout {out['dropout']} -> 0: PEFT takes no dropout on routed experts stored as stacked "
                    "weights (transformers 5); set model.lora.experts=false to keep the dropout on the other layers"
                )
                out["dropout"] = 0.0
            self.result.notes.append(note)
        bias = self.take(call, "bias")
        if bias not in (None, "none"):
            self.unmapped(call.lines["bias"], f"lora.bias = {bias!r}", "tuneforge trains no biases with LoRA")
        if (use_dora := self.take(call, "use_dora")) is not None:
            out["use_dora"] = bool(use_dora)
        if (use_rslora := self.take(call, "use_rslora")) is not None:
            out["use_rslora"] = bool(use_rslora)
        if (modules := self.take(call, "modules_to_save")) is not None:
            out["modules_to_save"] = list(modules)
        self.leftovers(call, "lora")
        return out

    def map_data(self, dataloader: Any) -> None:
        data, train = self.section("data"), self.section("train")
        if not isinstance(dataloader, Call):
            self.unmapped(0, "train_dataloader", "not found; set data.train_files yourself")
            return
        if (batch := self.take(dataloader, "batch_size")) is not None:
            train["micro_batch_size"] = batch
        dataset = self.take(dataloader, "dataset")
        for key in ("num_workers", "sampler", "collate_fn"):
            self.skip(dataloader, key)
        self.leftovers(dataloader, "train_dataloader")
        if not isinstance(dataset, Call):
            return
        source = self.take(dataset, "dataset")
        if isinstance(source, Call):
            files = self.take(source, "data_files")
            files = [files] if isinstance(files, str) else list(files or [])
            # xtuner resolves data paths from the directory it is started in.
            data["train_files"] = [str(Path(f).expanduser().resolve()) for f in files]
            if files:
                self.result.notes.append(f"data_files resolved from the current directory: {data['train_files']}")
            self.take(source, "path")
            self.leftovers(source, "dataset")
        map_fn = self.take(dataset, "dataset_map_fn")
        if map_fn is not None:
            name = _name(map_fn)
            if name in MAP_FUNCTIONS:
                data["format"] = MAP_FUNCTIONS[name]
            elif any(key in name for key in SHAREGPT_LIKE):
                data["format"] = "sharegpt"
            else:
                self.unmapped(
                    dataset.lines["dataset_map_fn"],
                    f"dataset_map_fn = {name}",
                    "a custom map function; convert the data to OpenAI messages, ShareGPT or Alpaca records",
                )
        template_fn = self.take(dataset, "template_map_fn")
        template = self.take(template_fn, "template") if isinstance(template_fn, Call) else None
        if template is not None:
            name = _name(template)
            if name in BUILT_IN:
                data["template"] = name
            else:
                self.unmapped(dataset.lines["template_map_fn"], f"prompt template {name}", "not a built-in template")
        if (length := self.take(dataset, "max_length")) is not None:
            data["max_length"] = length
        if (pack := self.take(dataset, "pack_to_max_length")) is not None:
            data["packing"] = bool(pack)
        self.take(dataset, "tokenizer")
        self.leftovers(dataset, "train_dataset")

    def map_optimizer(self, wrapper: Any) -> int:
        train = self.section("train")
        if not isinstance(wrapper, Call):
            return 1
        accumulation = int(self.take(wrapper, "accumulative_counts") or 1)
        train["gradient_accumulation"] = accumulation
        optimizer = self.take(wrapper, "optimizer")
        if isinstance(optimizer, Call):
            if _name(optimizer.type) != "AdamW":
                self.unmapped(optimizer.line, f"optimizer {_name(optimizer.type)}", "tuneforge trains with AdamW")
            for source, target in (("lr", "lr"), ("weight_decay", "weight_decay"), ("eps", "eps")):
                if (value := self.take(optimizer, source)) is not None:
                    train[target] = value
            if (betas := self.take(optimizer, "betas")) is not None:
                train["betas"] = list(betas)
            self.leftovers(optimizer, "optimizer")
        clip = self.take(wrapper, "clip_grad")
        if isinstance(clip, (Call, dict)):
            max_norm = clip.get("max_norm") if isinstance(clip, dict) else self.take(clip, "max_norm")
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
        max_epochs = self.take(train_cfg, "max_epochs") if isinstance(train_cfg, Call) else None
        max_iters = self.take(train_cfg, "max_iters") if isinstance(train_cfg, Call) else None
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
            begin, end = self.take(scheduler, "begin") or 0, self.take(scheduler, "end")
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
                eta_min = self.take(scheduler, "eta_min")
                if eta_min:
                    train["min_lr"] = eta_min
            elif kind == "ConstantLR":
                train["schedule"] = "constant"
            else:
                self.unmapped(scheduler.line, f"param_scheduler {kind}", "tuneforge has cosine, linear and constant")
            self.leftovers(scheduler, f"param_scheduler {kind}")

    def map_hooks(self, custom_hooks: list, default_hooks: Any, accumulation: int) -> None:
        evaluation, data = self.section("eval"), self.section("data")
        for hook in custom_hooks:
            if not isinstance(hook, Call):
                continue
            kind = _name(hook.type)
            if kind == "EvaluateChatHook":
                evaluation["sample_prompts"] = list(self.take(hook, "evaluation_inputs") or [])
                if (every := self.take(hook, "every_n_iters")) is not None:
                    evaluation["sample_every_steps"] = self.iterations_to_steps(
                        int(every), accumulation, "EvaluateChatHook every_n_iters"
                    )
                system = self.take(hook, "system")
                if system:
                    data["system"] = system
                if (tokens := self.take(hook, "max_new_tokens")) is not None:
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
        if isinstance(logger, Call) and (interval := self.take(logger, "interval")) is not None:
            steps = self.iterations_to_steps(int(interval), accumulation, "LoggerHook interval")
            self.section("log")["every_steps"] = steps
        checkpoint = self.take(default_hooks, "checkpoint")
        if isinstance(checkpoint, Call):
            if (interval := self.take(checkpoint, "interval")) is not None:
                steps = self.iterations_to_steps(int(interval), accumulation, "CheckpointHook interval (save_steps)")
                self.section("checkpoint")["every_steps"] = steps
            keep = self.take(checkpoint, "max_keep_ckpts")
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
        seed = self.take(randomness, "seed") if isinstance(randomness, Call) else None
        if isinstance(randomness, Call):
            if self.take(randomness, "deterministic"):
                self.result.notes.append("randomness.deterministic: tuneforge runs are reproducible by seed on CPU")
            self.leftovers(randomness, "randomness")
        if seed is not None:
            self.section("train")["seed"] = int(seed)
        else:
            self.result.notes.append("randomness.seed is None (random in xtuner) -> train.seed 42, for reproducibility")
        parallel_size = values.get("sequence_parallel_size", 1)
        if parallel_size not in (None, 1):
            self.unmapped(lines["sequence_parallel_size"], f"sequence_parallel_size = {parallel_size}", "not supported")
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
    from tuneforge.xtuner.evaluate import read_config

    module = read_config(path)
    result = Mapper(module, path).run(deepspeed, nproc_per_node)
    for line, why in module.skipped:
        result.unmapped.append((line, "statement", why))
    result.unmapped.sort()
    result.config = {k: v for k, v in result.config.items() if v}
    return result


def to_yaml(result: Imported, source: Path) -> str:
    """The native config, headed by what was converted and what could not be mapped, as comments."""
    import yaml

    header = [f"# tuneforge config imported from {source}"]
    header += [f"# conversion: {note}" for note in result.notes]
    header += [f"# NOT MAPPED (line {line}): {what}: {why}" for line, what, why in result.unmapped]
    body = yaml.safe_dump(result.config, allow_unicode=True, sort_keys=False, width=110)
    return "\n".join(header) + "\n" + body
