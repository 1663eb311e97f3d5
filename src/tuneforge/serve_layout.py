"""`tuneforge export CKPT --for vllm|sglang`: a LoRA adapter in the layout the server's model class reads.

tuneforge trains adapters on stacked routed experts as PEFT does (`target_parameters`: one `lora_A` of
(experts x r, in) and one `lora_B` of (out, r x experts) per stacked weight). What a server reads is decided by its
model class, not by the file:

- classes whose checkpoints store one tensor per expert (DeepSeek-V2/V3, Qwen2/Qwen3-MoE, Mixtral) read one
  `lora_A`/`lora_B` pair per expert and projection, `mlp.experts.E.{gate,up,down}_proj`, and need every expert;
- classes whose checkpoints store fused 3-D experts (Qwen3.5-MoE, GPT-OSS) read PEFT's own stacked layout.

Fused gate-and-up weights become a gate and an up adapter with the same `lora_A` and each half of `lora_B`:
exactly the same update (B·A split by rows). Attention and dense layers keep PEFT's module names; the servers
pack q/k/v and gate/up themselves. What a server cannot load (a rank above its limit, adapters on a vision tower
or projector, layers saved whole, DoRA) is refused with the merged export offered instead.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tuneforge.errors import UserError

PER_EXPERT = {"deepseek_v2", "deepseek_v3", "qwen2_moe", "qwen3_moe", "mixtral", "qwen3_vl_moe", "glm4_moe"}
STACKED = {"qwen3_5_moe", "qwen3_next", "gpt_oss", "nemotron_h", "llama4"}
MAX_RANK = {"vllm": 512, "sglang": 512}
SERVER_RANKS = {"vllm": (1, 8, 16, 32, 64, 128, 256, 320, 512)}
"""The `--max-lora-rank` values a server accepts, where it accepts only some (vLLM refuses any other)."""
SERVE_HINT = {
    "vllm": "vllm serve {base} --enable-lora --max-lora-rank {rank} --lora-modules NAME={out}",
    "sglang": "python -m sglang.launch_server --model-path {base} --enable-lora --max-lora-rank {rank} "
    "--lora-paths NAME={out}",
}
MERGED = "export --merge (a full model every server loads)"
CHAT_TEMPLATE = "chat_template.jinja"


def _refusals(config: dict, server: str, beyond_language: str) -> list[str]:
    problems = []
    if config.get("r", 0) > MAX_RANK[server]:
        problems.append(f"rank {config['r']} is above {server}'s limit of {MAX_RANK[server]}")
    if any(config.get("rank_pattern") or {}) and max(config["rank_pattern"].values()) > MAX_RANK[server]:
        problems.append(f"a layer's rank is above {server}'s limit of {MAX_RANK[server]}")
    if config.get("use_dora"):
        problems.append(f"{server} serves no DoRA adapters")
    if config.get("modules_to_save"):
        problems.append(f"layers trained in full ({', '.join(config['modules_to_save'])}) are not adapters")
    if beyond_language:
        problems.append(f"{server} loads adapters on the language model only, not on the {beyond_language}")
    return problems


@dataclass(frozen=True)
class StackedAdapter:
    """Where PEFT saved the factors of one adapted stacked expert weight."""

    key: str
    """The saved keys' prefix (`KEY.lora_A.weight`, `KEY.lora_B.weight`)."""
    experts_path: str
    parameter: str
    experts: int


def stacked_adapters(base_path: str, config: dict) -> list[StackedAdapter]:
    """PEFT's own placement of the adapter's stacked-weight factors, read off the adapter built on a skeleton of
    the base (the meta device: no weights read). Nested wrappers make the keys depend on the order PEFT wraps
    them in, so the keys are not guessed from their shapes."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import ParamWrapper
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from tuneforge.model.vision import is_vision_config

    base_config = AutoConfig.from_pretrained(base_path, trust_remote_code=False)
    auto = AutoModelForImageTextToText if is_vision_config(base_config) else AutoModelForCausalLM
    with torch.device("meta"):
        skeleton = auto.from_config(base_config)
    fields = {k: v for k, v in config.items() if k in LoraConfig.__dataclass_fields__}
    fields.pop("base_model_name_or_path", None)
    model = get_peft_model(skeleton, LoraConfig(**fields))
    found = []
    for path, module in model.named_modules():
        if isinstance(module, ParamWrapper) and module.get_param().dim() == 3:
            experts_path = re.sub(r"(\.base_layer)+$", "", path)
            found.append(StackedAdapter(path, experts_path, module.parameter_name, module.get_param().shape[0]))
    return found


def per_expert_tensors(
    weights: dict[str, torch.Tensor], stacked: list[StackedAdapter]
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(the per-expert factors, the saved keys they replace) of every adapted stacked weight."""
    from tuneforge.model.expert_lora import expert_factors

    tensors: dict[str, torch.Tensor] = {}
    replaced: set[str] = set()
    for entry in stacked:
        keys = (f"{entry.key}.lora_A.weight", f"{entry.key}.lora_B.weight")
        if not all(key in weights for key in keys):
            raise UserError(f"the adapter has no {keys[0]}, which its config implies: the files do not match")
        replaced |= set(keys)
        down, up = expert_factors(weights[keys[0]], weights[keys[1]], entry.experts)  # (E, in, r), (E, r, out)
        for expert in range(entry.experts):
            lora_a, lora_b = down[expert].T, up[expert].T  # (r, in), (out, r)
            if entry.parameter == "gate_up_proj":  # the gate's rows first, as transformers splits them
                gate, upper = lora_b.chunk(2, dim=0)
                parts = {"gate_proj": gate, "up_proj": upper}
            else:
                parts = {entry.parameter: lora_b}
            for projection, factor in parts.items():
                prefix = f"{entry.experts_path}.{expert}.{projection}"
                tensors[f"{prefix}.lora_A.weight"] = lora_a.clone()  # gate and up each own a copy on disk
                tensors[f"{prefix}.lora_B.weight"] = factor.contiguous()
    return tensors, replaced


def server_adapter_config(config: dict, expert_projections: set[str]) -> dict:
    """The adapter config with linear layers named by their weight under `target_parameters` moved back to
    `target_modules`, and the per-expert projections added there; stacked experts left stacked (no
    `expert_projections`) stay under `target_parameters`, as trained."""
    out = dict(config)
    parameters = list(out.pop("target_parameters", None) or [])
    modules = set(out.get("target_modules") or [])
    modules |= {name.removesuffix(".weight").rsplit(".", 1)[-1] for name in parameters if name.endswith(".weight")}
    modules |= expert_projections
    out["target_modules"] = sorted(modules)
    if stacked := [name for name in parameters if not name.endswith(".weight")] if not expert_projections else []:
        out["target_parameters"] = stacked
    return out


def export_for_server(checkpoint: Path, out: Path, server: str, base: Path | None = None) -> list[str]:
    """No model code runs and no weights but the adapter's are read: the layout comes from the config and a
    meta-device skeleton of the base."""
    from transformers import AutoConfig, AutoTokenizer

    from tuneforge.checkpoint_records import CHAT_META, read_chat_meta
    from tuneforge.export import adapters_beyond_language, check_out, finish_out, prepare_out
    from tuneforge.export_stops import GENERATION_CONFIG, write_generation_config
    from tuneforge.trained import (
        ADAPTER_CONFIG,
        ADAPTER_WEIGHTS,
        adapter_base,
        is_adapter,
        is_vision_checkpoint,
        loading,
    )

    if not is_adapter(checkpoint):
        raise UserError(
            f"export --for {server}: {checkpoint} is a full model, which {server} serves as it is (or export --merge "
            "for a copy with the training chat template); --for writes adapters"
        )
    check_out(out)
    config = json.loads((checkpoint / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    base_path = adapter_base(checkpoint, base)
    try:
        model_type = AutoConfig.from_pretrained(base_path, trust_remote_code=False).model_type
    except ValueError:  # an architecture that exists only as the model's own code
        raise UserError(f"export --for {server}: the base at {base_path} needs its own code; use {MERGED}") from None
    beyond = (
        adapters_beyond_language(checkpoint / ADAPTER_WEIGHTS, base_path) if is_vision_checkpoint(base_path) else ""
    )
    if problems := _refusals(config, server, beyond):
        raise UserError(f"export --for {server}: {'; '.join(problems)}; use {MERGED}")
    weights = load_file(checkpoint / ADAPTER_WEIGHTS)
    stacked = bool(config.get("target_parameters")) and any(".experts." in key for key in weights)
    layout = "PEFT's stacked layout" if stacked else "none"
    projections: set[str] = set()
    if stacked and model_type not in STACKED:
        if model_type not in PER_EXPERT:
            raise UserError(
                f"export --for {server}: which expert layout {server}'s {model_type} class reads is not known to "
                f"tuneforge; use {MERGED}"
            )
        per_expert, replaced = per_expert_tensors(weights, stacked_adapters(base_path, config))
        weights = {k: v for k, v in weights.items() if k not in replaced}
        weights.update(per_expert)
        projections = {key.rsplit(".", 3)[-3] for key in per_expert}
        layout = "one lora_A/lora_B pair per expert and projection"
    written = server_adapter_config(config, projections)
    written["base_model_name_or_path"] = str(Path(base_path).resolve())
    tmp = prepare_out(out)
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(written, indent=2))
    meta = read_chat_meta(checkpoint) or {}
    (tmp / CHAT_META).write_text(json.dumps(meta, indent=2))
    with loading("tokenizer", checkpoint):
        tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=False)
    stops = write_generation_config(tmp, base_path, tokenizer, meta)
    template = _training_template(tokenizer, meta)
    if template:
        (tmp / CHAT_TEMPLATE).write_text(template, encoding="utf-8")
    finish_out(tmp, out)
    rank = max([written.get("r", 0), *(written.get("rank_pattern") or {}).values()])
    serve = SERVE_HINT[server].format(
        base=shlex.quote(str(Path(base_path).resolve())), rank=served_rank(server, rank), out=shlex.quote(str(out))
    )
    if template:
        serve += f" --chat-template {shlex.quote(str(out / CHAT_TEMPLATE))}"
    if server == "vllm":  # its default stops are otherwise the base's generation config's
        serve += f" --generation-config {shlex.quote(str(out))}"
    return [
        f"exported adapter for {server}: {out} ({model_type}, experts in {layout}; rank {rank})",
        f"serve: {serve}",
        f"{CHAT_TEMPLATE}: the template training used (the server otherwise prompts with the base model's own)"
        if template
        else "no chat template recorded: the server prompts with the base model's own",
        f"{GENERATION_CONFIG}: stops at token ids {stops}, the training template's"
        + (" (--generation-config)" if server == "vllm" else "; pass them as the request's stop_token_ids"),
    ]


def served_rank(server: str, rank: int) -> int:
    """The `--max-lora-rank` to start `server` with for an adapter of `rank`: the rank, or the least value the
    server accepts above it."""
    accepted = SERVER_RANKS.get(server)
    return min(value for value in accepted if value >= rank) if accepted else rank


def _training_template(tokenizer, meta: dict) -> str | None:
    """The run's chat template as Jinja (a server formats prompts with the base's own unless given this)."""
    from tuneforge.export import attach_chat_template

    attach_chat_template(tokenizer, meta)
    return tokenizer.chat_template
