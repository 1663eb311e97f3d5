"""xtuner's optimizer wrapper, schedulers, hooks and runtime settings."""

from __future__ import annotations

from typing import Any

from tuneforge.errors import UserError
from tuneforge.xtuner.evaluate import Call
from tuneforge.xtuner.mapper_base import MapperBase, dtype_name, shown, type_name

DEEPSPEED_PRESETS = {
    "deepspeed_zero1": {"engine": "deepspeed", "zero_stage": 1},
    "deepspeed_zero2": {"engine": "deepspeed", "zero_stage": 2},
    "deepspeed_zero2_offload": {"engine": "deepspeed", "zero_stage": 2, "cpu_offload": "optimizer"},
    "deepspeed_zero3": {"engine": "deepspeed", "zero_stage": 3},
    "deepspeed_zero3_offload": {"engine": "deepspeed", "zero_stage": 3, "cpu_offload": "all"},
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


def amp_note(dtype: str | None, scale: Any) -> str:
    """What xtuner's mixed precision (AmpOptimWrapper, float16 unless its dtype says otherwise) becomes.

    Both dtypes map to `auto`, which is bf16 where the hardware computes it natively (GPUs that have it) and fp32
    where a half precision would be emulated (bf16 on most CPUs is ~3x slower than fp32), so the intent, mixed
    precision for speed, holds on every machine. float16 too: xtuner's config templates write it whatever the
    GPU, bf16 computes as fast with no loss scaling, and CPUs emulate fp16 as well. Only on GPUs without bf16
    (V100, T4) is fp16 the fast choice: there auto computes in fp32 and says so, and this note names
    train.precision=fp16, xtuner's own numerics, for them."""
    auto = "train.precision auto: bf16 where the hardware computes it natively, fp32 where it would be emulated"
    if dtype == "bfloat16":
        return f"AmpOptimWrapper dtype bfloat16 -> {auto} (most CPUs); train.precision=bf16 forces it everywhere"
    return (
        f"AmpOptimWrapper dtype {dtype or 'float16'} with loss_scale {scale!r} -> {auto} (most CPUs), and bf16 "
        "needs no loss scaling; on GPUs without bf16, such as V100 or T4, set train.precision=fp16, which scales "
        "dynamically as xtuner did"
    )


class TrainingMapping(MapperBase):
    def map_optimizer(self, wrapper: Any) -> int:
        train = self.section("train")
        if not isinstance(wrapper, Call):
            return 1
        accumulation = max(1, int(self.number(wrapper, "accumulative_counts", "optim_wrapper") or 1))
        train["gradient_accumulation"] = accumulation
        optimizer = self.take(wrapper, "optimizer")
        if isinstance(optimizer, Call):
            if type_name(optimizer.type) != "AdamW":
                self.unmapped(optimizer.line, f"optimizer {type_name(optimizer.type)}", "tuneforge trains with AdamW")
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
        if type_name(wrapper.type) == "AmpOptimWrapper":
            train["precision"] = "auto"
            self.result.notes.append(amp_note(dtype_name(dtype) if dtype is not None else "float16", scale))
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
            kind = type_name(scheduler.type)
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
        evaluation = self.section("eval")
        if not isinstance(custom_hooks, list):
            line = self.module.lines.get("custom_hooks", 0)
            self.unmapped(line, f"custom_hooks = {shown(custom_hooks)}", "not a list of hooks")
            custom_hooks = []
        for hook in custom_hooks:
            if not isinstance(hook, Call):
                continue
            kind = type_name(hook.type)
            if kind == "EvaluateChatHook" and self.section("train").get("objective") == "reward":
                self.result.notes.append(
                    f"EvaluateChatHook (line {hook.line}): not carried over: a reward model scores and does not "
                    "write answers; validation reports the ranking accuracy of held-out pairs"
                )
                for key in list(hook.fields):
                    self.take(hook, key)
            elif kind == "EvaluateChatHook" and hook.get("evaluation_images") is not None:
                images = self.take(hook, "evaluation_images")
                self.unmapped(
                    self.line(hook, "evaluation_images"),
                    f"EvaluateChatHook.evaluation_images = {shown(images)}",
                    "chats about an image: tuneforge's sample prompts (eval.sample_prompts) are text, and nothing "
                    "downloads during training; its prompts, which ask about that image, are not carried over",
                )
                for key in list(hook.fields):
                    self.take(hook, key)
            elif kind == "EvaluateChatHook":
                if (inputs := self.take(hook, "evaluation_inputs")) is not None:
                    line, fix = self.line(hook, "evaluation_inputs"), "set eval.sample_prompts"
                    evaluation["sample_prompts"] = self.strings(inputs, line, "evaluation_inputs", fix) or []
                if (every := self.number(hook, "every_n_iters", "EvaluateChatHook")) is not None:
                    evaluation["sample_every_steps"] = self.iterations_to_steps(
                        int(every), accumulation, "EvaluateChatHook every_n_iters"
                    )
                system = self.take(hook, "system")
                if system:
                    # The prompt xtuner samples with only; the map functions the importer reads (openai, alpaca,
                    # sharegpt) add none to the training data, so data.system stays as it is.
                    line = self.line(hook, "system")
                    text = self.text(system, line, "EvaluateChatHook.system", "eval.sample_system")
                    if text:
                        evaluation["sample_system"] = text
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
            self.unmapped(line, f"sequence_parallel_size = {shown(parallel_size)}", "not a whole number of ranks")
        if deepspeed is not None:
            if deepspeed not in DEEPSPEED_PRESETS:
                raise UserError(f"--deepspeed {deepspeed}: not an xtuner preset; one of {', '.join(DEEPSPEED_PRESETS)}")
            self.section("parallel").update(DEEPSPEED_PRESETS[deepspeed])
            model = self.section("model")
            if DEEPSPEED_PRESETS[deepspeed]["zero_stage"] == 3 and "quantization" in model and "lora" in model:
                self.result.notes.append(
                    f"QLoRA under --deepspeed {deepspeed}: kept as launched; when the k-bit base fits each GPU whole "
                    "(DeepSeek-V2-Lite's is about 9 GB), parallel.engine=ddp is faster and has no per-layer gathers "
                    "for a rank to miss: `tuneforge doctor OUT.yaml --nproc-per-node N --gpu GPU` compares both"
                )
        for name, why in RUNTIME_NOT_NEEDED.items():
            if name in values and name != "train_cfg":
                self.result.notes.append(f"{name} (line {lines[name]}): not needed: {why}")
        processes = nproc_per_node or 1
        self.result.launch = "tuneforge train OUT.yaml" + (f" --nproc-per-node {processes}" if processes > 1 else "")
        if processes > 1 and deepspeed is None:
            self.result.notes.append(
                "several processes without --deepspeed: tuneforge will use DDP (parallel.engine auto)"
            )
