"""xtuner's `model = dict(...)`: the language model, its quantization and adapters, and DPO's or ORPO's own
settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tuneforge.xtuner.evaluate import Call
from tuneforge.xtuner.mapper_base import MapperBase, dtype_name, shown

PREFERENCE_MODELS = {"DPO": "dpo", "ORPO": "orpo", "RewardModel": "reward"}
"""xtuner's preference wrappers and the `train.objective` that trains the same loss."""


class ModelMapping(MapperBase):
    def map_moe_implementation(self, llm: Call) -> None:
        """xtuner's `moe_implementation='shard'` regroups the remote code's per-expert modules into shards of
        `expert_in_one_shard` so that ZeRO-3 gathers a few large pieces instead of 64 small ones. tuneforge gets
        the same from transformers' own stacked experts, each MoE block gathered whole (`parallel.moe_safety`):
        nothing to set. It is no expert parallelism (experts sharded across ranks, tokens exchanged)."""
        implementation = self.take(llm, "moe_implementation")
        per_shard = self.take(llm, "expert_in_one_shard")
        if implementation is None:
            return
        line = self.line(llm, "moe_implementation")
        if implementation not in ("shard", "origin"):
            self.unmapped(line, f"model.llm.moe_implementation = {shown(implementation)}", "not an xtuner value")
            return
        self.result.notes.append(
            f"model.llm.moe_implementation = {implementation!r} (line {line})"
            + (f", expert_in_one_shard = {per_shard}" if per_shard is not None else "")
            + ": not needed: transformers' stacked experts are one tensor per MoE block, gathered whole by ZeRO-3 "
            "and FSDP (parallel.moe_safety); no experts are sharded across ranks either way"
        )

    def map_model(self, model: Call, tokenizer: Any, quantize: bool = True) -> None:
        """The language model, its adapters and the tokenizer. `quantize` False: the caller maps the language
        model's quantization_config itself (a frozen one, which tuneforge does not quantize)."""
        out = self.section("model")
        llm = self.take(model, "llm")
        if isinstance(llm, Call):
            path = self.take(llm, "pretrained_model_name_or_path")
            # A local directory is resolved from where xtuner would have been started; a hub id stays as is.
            out["path"] = str(Path(path).resolve()) if isinstance(path, str) and Path(path).is_dir() else path
            out["trust_remote_code"] = bool(self.take(llm, "trust_remote_code"))
            dtype = dtype_name(self.take(llm, "torch_dtype"))
            if dtype == "float16":
                self.result.notes.append(
                    "torch_dtype float16 -> model.dtype bfloat16: tuneforge trains in bf16 (same memory as fp16, no "
                    "loss scaling); DeepSeek-V2 and most current models were trained in bf16"
                )
                dtype = "bfloat16"
            if dtype:
                out["dtype"] = dtype
            quantization = self.take(llm, "quantization_config")
            if isinstance(quantization, Call) and quantize:
                out["quantization"] = self.map_quantization(quantization)
            self.map_moe_implementation(llm)
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
        """DPO's, ORPO's and the reward model's own settings; the language model and its adapters are mapped as
        for SFT."""
        self.section("train")["objective"] = objective
        preference = self.section("preference")
        if objective == "reward":
            self.map_reward(model, preference)
            return
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

    def map_reward(self, model: Call, preference: dict[str, Any]) -> None:
        """xtuner's RewardModel: its loss, penalty and penalty weight (its defaults: ranking, log_barrier, 0.01,
        which are tuneforge's too). Its head becomes transformers' score head."""
        if (loss := self.take(model, "loss_type")) is not None:
            preference["reward_loss"] = loss
        if (penalty := self.take(model, "penalty_type")) is not None:
            preference["penalty"] = {"L2": "l2"}.get(penalty, penalty)
        if (weight := self.number(model, "penalty_weight", "model")) is not None:
            preference["penalty_weight"] = weight
        self.take(model, "reward_token_id")  # said with the dataset's, where xtuner uses it
        self.result.notes.append(
            "RewardModel -> train.objective: reward; its value head -> the score head of transformers' "
            "sequence classification model (exports load with AutoModelForSequenceClassification)"
        )

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
        compute = dtype_name(self.take(call, "bnb_4bit_compute_dtype"))
        if compute == "float16":
            self.result.notes.append("bnb_4bit_compute_dtype float16 -> bfloat16, as for the weights")
            compute = "bfloat16"
        if compute:
            out["compute_dtype"] = compute
        if call.get("llm_int8_threshold", 6.0) != 6.0 or call.get("llm_int8_has_fp16_weight", False):
            self.unmapped(call.line, "llm_int8_threshold / llm_int8_has_fp16_weight", "only the defaults are supported")
        self.leftovers(call, "quantization_config")
        return out

    def map_lora(
        self, call: Call, source: str = "lora", target: str = "model.lora", experts: bool = True
    ) -> dict[str, Any]:
        """The PEFT LoraConfig of xtuner's field `source` as the tuneforge section `target` (LoraSettings).
        `experts`: the model may have routed experts, which xtuner adapts when no target_modules are given (a
        vision tower has none)."""
        out: dict[str, Any] = {}
        for key, name in (("r", "r"), ("lora_alpha", "alpha"), ("lora_dropout", "dropout")):
            if (value := self.take(call, key)) is not None:
                out[name] = value
        config = "LoraConfig" if source == "lora" else source
        if (targets := self.take(call, "target_modules")) is not None:
            out["targets"] = targets if targets != "all-linear" else "all-linear"
        elif experts:
            # xtuner then adapts every linear layer but the output head, the routed experts of MoE models included.
            out["targets"], out["experts"] = "all-linear", True
            self.result.notes.append(
                f"{config} without target_modules -> {target}.targets: all-linear, experts: true (as xtuner)"
            )
        else:
            out["targets"] = "all-linear"
            self.result.notes.append(f"{config} without target_modules -> {target}.targets: all-linear (as xtuner)")
        bias = self.take(call, "bias")
        if bias not in (None, "none"):
            self.unmapped(self.line(call, "bias"), f"{source}.bias = {bias!r}", "tuneforge trains no biases with LoRA")
        if (use_dora := self.take(call, "use_dora")) is not None:
            out["use_dora"] = bool(use_dora)
        if (use_rslora := self.take(call, "use_rslora")) is not None:
            out["use_rslora"] = bool(use_rslora)
        if (modules := self.take(call, "modules_to_save")) is not None:
            fix = f"set {target}.modules_to_save"
            if names := self.strings(modules, self.line(call, "modules_to_save"), f"{source}.modules_to_save", fix):
                out["modules_to_save"] = names
        self.leftovers(call, source)
        return out
