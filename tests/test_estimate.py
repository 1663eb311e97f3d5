"""The memory and time estimate: how it responds to sharding, offload, quantization, checkpointing and ranks.
Skeletons are built on the meta device from the real model configs in src/tuneforge/recipes/models/ (no weights)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from tuneforge.cli import main
from tuneforge.config import load_config
from tuneforge.config.schema import Config
from tuneforge.data.byte_tokenizer import build_byte_tokenizer
from tuneforge.doctor import PASS, WARN, check_estimate, model_skeleton, read_model_config
from tuneforge.engines import engine_traits
from tuneforge.estimate import ACCELERATORS, format_estimate, kbit_bytes
from tuneforge.estimate import estimate as estimate_for_traits
from tuneforge.estimate.shapes import count_label, model_shapes
from tuneforge.estimate.timing import NVLINK_BYTES_PER_S
from tuneforge.model.fresh_vision import fresh_vision_config, vision_tokenizer
from tuneforge.model.moe import find_moe
from tuneforge.model.quantize import quantized_linears
from tuneforge.model.vision import VisionParts
from tuneforge.model.vision_training import make_vision_trainable
from tuneforge.recipes import MODEL_SHAPES, RECIPES
from vlm_models import TINY_SIZES

from conftest import REPO

MODELS = MODEL_SHAPES
H100 = ACCELERATORS["h100"]
USER_JOB = REPO / "configs" / "deepseek_v2_lite_qlora_zero3_offload_8gpu.yaml"
RECOMMENDED = RECIPES / "deepseek-v2-lite-lora-fsdp-8gpu.yaml"


def skeleton(name: str):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(read_model_config(MODELS / f"{name}.config.json"))


@pytest.fixture(scope="module")
def llama():
    return skeleton("llama-3-8b")


@pytest.fixture(scope="module")
def deepseek():
    return skeleton("deepseek-v2-lite-chat")


@pytest.fixture(scope="module")
def mixtral():
    return skeleton("mixtral-8x7b")


def config(**sections) -> Config:
    """A job for a GPU: `train.precision: auto` is bf16 there, as the doctor resolves it before sizing."""
    model = {"path": "some/model", "dtype": "bfloat16", **sections.pop("model", {})}
    train = {"precision": "bf16", **sections.pop("train", {})}
    data = {"train_files": ["x.jsonl"], **sections.pop("data", {})}
    return Config.model_validate({"model": model, "data": data, "train": train, **sections})


def estimate(cfg: Config, model, engine: str, world_size: int, accelerator, **kwargs):
    """The estimate for the named engine's traits under `cfg`, with the model's MoE map, as the doctor asks."""
    traits = engine_traits(engine, cfg.parallel, cfg.train)
    return estimate_for_traits(cfg, model, traits, world_size, accelerator, find_moe(model), **kwargs)


def check_single(cfg: Config, model, accelerator):
    return check_estimate(cfg, engine_traits("single", cfg.parallel, cfg.train), 1, model, find_moe(model), accelerator)


def row(est, prefix: str):
    return next(r for r in est.rows if r.label.startswith(prefix))


LORA = {"lora": {"r": 16}}


def test_zero3_divides_the_sharded_weights_by_the_ranks(llama):
    cfg = config(model=LORA, parallel={"engine": "deepspeed", "zero_stage": 3})
    one = estimate(cfg, llama, "deepspeed", 1, H100)
    eight = estimate(cfg, llama, "deepspeed", 8, H100)
    assert row(eight, "base weights").gpu == pytest.approx(row(one, "base weights").gpu / 8)
    assert row(eight, "optimizer").gpu == pytest.approx(row(one, "optimizer").gpu / 8)
    # ZeRO-2 keeps whole weights on every rank, sharding only gradients and optimizer state.
    zero2 = estimate(config(model=LORA, parallel={"engine": "deepspeed", "zero_stage": 2}), llama, "deepspeed", 8, H100)
    assert row(zero2, "base weights").gpu == pytest.approx(row(one, "base weights").gpu)
    assert row(zero2, "gradients").gpu == pytest.approx(row(one, "gradients").gpu / 8)


def test_parameter_offload_moves_weights_from_gpu_to_host(llama):
    kept = estimate(config(model=LORA, parallel={"engine": "deepspeed"}), llama, "deepspeed", 8, H100)
    offloaded = estimate(
        config(model=LORA, parallel={"engine": "deepspeed", "cpu_offload": "all"}), llama, "deepspeed", 8, H100
    )
    on_gpu, on_host = row(kept, "base weights"), row(offloaded, "base weights")
    assert on_gpu.host == 0 and on_host.gpu == 0
    assert on_host.host == pytest.approx(on_gpu.gpu * 8)  # 8 ranks' shards in one node's RAM
    assert offloaded.gpu_bytes < kept.gpu_bytes and offloaded.host_bytes > kept.host_bytes
    # Offload trades memory for PCIe traffic and CPU work in every step.
    assert offloaded.step_s > kept.step_s
    assert {"PCIe host transfers", "CPU AdamW"} <= {what for what, _, _ in offloaded.times}


def test_4bit_linears_take_about_a_quarter_of_bf16(llama):
    """Under DeepSpeed every unquantized parameter is 16-bit, so the difference is the quantized layers."""
    quantization = {"bits": 4, "double_quant": True}
    plain = estimate(config(model=LORA, parallel={"engine": "deepspeed"}), llama, "deepspeed", 1, H100)
    qlora = estimate(
        config(model={**LORA, "quantization": quantization}, parallel={"engine": "deepspeed"}),
        llama,
        "deepspeed",
        1,
        H100,
    )
    settings = config(model={**LORA, "quantization": quantization}).model.quantization
    linears = sum(module.weight.numel() for _, module in quantized_linears(llama, settings))
    saved = row(plain, "base weights").gpu - row(qlora, "base weights").gpu
    four_bit = 2 * linears - saved
    assert 0.25 < four_bit / (2 * linears) < 0.27  # 4 bits + 8-bit constants per 64 weights
    assert kbit_bytes(4, double_quant=False) > kbit_bytes(4, double_quant=True) > 0.5


def test_4bit_stacked_experts_count_as_4bit_weights_and_cost_a_dequantization_per_pass(deepseek):
    """DeepSeek-V2-Lite's routed experts (stacked parameters, 94% of it) are stored in 4 bits by tuneforge: the
    base weights shrink by their share, and every pass pays a memory-bound rebuild of the whole stack."""
    settings = {"bits": 4, "double_quant": True}
    cfg = config(model={**LORA, "quantization": settings}, parallel={"engine": "deepspeed"})
    four = estimate(cfg, deepseek, "deepspeed", 1, H100)
    eight = estimate(
        config(model={**LORA, "quantization": {"bits": 8}}, parallel={"engine": "deepspeed"}),
        deepseek,
        "deepspeed",
        1,
        H100,
    )
    stacked = sum(
        p.numel() for block in find_moe(deepseek) for p in deepseek.get_submodule(block.experts_path).parameters()
    )
    # 8 bits leaves the experts in bf16 (2 bytes); 4 bits stores them in about 0.52 bytes.
    saved = row(eight, "base weights").gpu - row(four, "base weights").gpu
    assert saved > 1.3 * stacked
    dequantize = next(seconds for what, seconds, _ in four.times if what == "expert dequantization")
    assert dequantize > 0
    assert "expert dequantization" not in {what for what, _, _ in eight.times}
    # The largest stack is held dequantized (bf16) for a moment: DeepSeek-V2-Lite's gate_up_proj, 64 x 2816 x 2048.
    largest = max(
        p.numel() for block in find_moe(deepseek) for p in deepseek.get_submodule(block.experts_path).parameters()
    )
    assert row(four, "4-bit experts: one stack").gpu == 2 * largest
    # Loaded in fp32 and run under bf16 autocast: the fp32 stack and its bf16 cast.
    fp32 = config(model={**LORA, "quantization": settings, "dtype": "float32"}, parallel={"engine": "deepspeed"})
    assert row(estimate(fp32, deepseek, "deepspeed", 1, H100), "4-bit experts: one stack").gpu == 6 * largest
    assert not any(r.label.startswith("4-bit experts") for r in eight.rows)


def test_gradient_checkpointing_trades_activation_memory_for_compute(llama):
    cfg = config(model=LORA, train={"micro_batch_size": 4})
    stored = estimate(cfg, llama, "single", 1, H100)
    recomputed = estimate(
        config(model=LORA, train={"micro_batch_size": 4, "gradient_checkpointing": True}), llama, "single", 1, H100
    )
    assert row(recomputed, "activations").gpu < row(stored, "activations").gpu / 5
    assert recomputed.step_s > stored.step_s


def test_run_time_scales_inversely_with_ranks_without_offload(llama):
    cfg = config(model=LORA)
    one = estimate(cfg, llama, "single", 1, H100, num_samples=8000)
    eight = estimate(cfg, llama, "ddp", 8, H100, num_samples=8000)
    assert one.steps == 8 * eight.steps
    assert one.steps * one.step_s / (eight.steps * eight.step_s) == pytest.approx(8, rel=0.05)
    # Same work per rank and step: the step time stays, the step holds 8 times the tokens.
    assert eight.tokens_per_step == 8 * one.tokens_per_step


def test_sequence_parallel_divides_activations_and_tokens_per_step_by_its_size(deepseek):
    """Long rows on 8 GPUs: 4 ranks per row hold a quarter of each row's activations; the step holds a quarter
    of the rows (2 data-parallel groups), and the exchange around attention shows as its own time."""
    data = {"train_files": ["x.jsonl"], "max_length": 32768}
    whole = config(model=LORA, data=data, parallel={"engine": "fsdp"})
    split = config(model=LORA, data=data, parallel={"engine": "fsdp", "sequence_parallel": 4})
    one, four = estimate(whole, deepseek, "fsdp", 8, H100), estimate(split, deepseek, "fsdp", 8, H100)
    assert row(four, "activations").gpu == pytest.approx(row(one, "activations").gpu / 4, rel=1e-3)
    assert "32768/4 (sequence parallel)" in row(four, "activations").label
    assert four.tokens_per_step == one.tokens_per_step / 4
    assert "2 groups of 4 ranks" in four.tokens_note
    assert any(name == "sequence all-to-all" and seconds > 0 for name, seconds, _ in four.times)


def test_routed_experts_count_by_their_top_k_share(deepseek):
    est = estimate(config(model=LORA), deepseek, "single", 1, H100)
    flops = next(how for what, _, how in est.times if what == "compute")
    active = float(flops.split(" GFLOP")[0]) * 1e9 / 4  # LoRA without checkpointing: 4 FLOPs per active weight
    total = sum(p.numel() for p in deepseek.parameters())
    assert 0.1 < active / total < 0.2  # DeepSeek-V2-Lite: about 2.4B of 15.7B parameters per token


def test_adapters_on_stacked_experts_cost_their_full_weights_only_in_peft_form(deepseek):
    def with_experts(**lora):
        cfg = config(model={"lora": {"r": 16, "dropout": 0.0, "experts": True, **lora}}, parallel={"engine": "fsdp"})
        return estimate(cfg, deepseek, "fsdp", 8, H100)

    lean = estimate(config(model=LORA, parallel={"engine": "fsdp"}), deepseek, "fsdp", 8, H100)
    grouped, peft_form = with_experts(), with_experts(grouped_experts=False)
    assert not any(r.label.startswith("expert adapters") for r in lean.rows + grouped.rows)
    assert row(peft_form, "expert adapters").gpu > 26 * 0.5e9  # W + B@A of every MoE layer kept for backward
    assert "expert adapter deltas" in {what for what, _, _ in peft_form.times}
    assert "expert adapter deltas" not in {what for what, _, _ in grouped.times}

    def gpu_work(e) -> float:
        return sum(t for what, t, _ in e.times if what in ("compute", "expert adapter deltas"))

    # Grouped low-rank products cost like linear adapters: a little over the run without them.
    assert gpu_work(lean) < gpu_work(grouped) < gpu_work(lean) + 0.1 * (gpu_work(peft_form) - gpu_work(lean))


def test_a_job_that_does_not_fit_warns_with_a_fix(llama):
    full = config(train={"micro_batch_size": 1})
    memory = check_single(full, llama, ACCELERATORS["a100-40gb"])[0]
    assert memory.status == WARN and "does not fit" in memory.detail
    assert "parallel.engine=fsdp" in memory.fix
    lora = check_single(config(model=LORA), llama, H100)
    assert [c.status for c in lora] == [PASS, PASS] and "a sizing estimate" in lora[0].report
    skipped = check_single(config(model=LORA), llama, None)
    assert skipped[0].status == PASS and "skipped" in skipped[0].detail


@pytest.mark.parametrize("path", [USER_JOB, RECOMMENDED], ids=["as-wanted", "recommended"])
def test_the_8_gpu_configs_validate_and_the_doctor_estimates_them(path, capsys):
    cfg = load_config(path, [])
    assert (
        cfg.model.path == "deepseek-ai/DeepSeek-V2-Lite-Chat"
        and cfg.train.gradient_accumulation * (cfg.train.micro_batch_size) == 16
    )
    model_config = str(MODELS / "deepseek-v2-lite-chat.config.json")
    code = main(["doctor", str(path), "--nproc-per-node", "8", "--gpu", "h100", "--model-config", model_config])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "estimate for 8 x H100 80GB" in out and "assumptions:" in out
    assert "PASS  memory estimate" in out  # both fit on 80 GB GPUs
    # The job as launched: its 4-bit base fits every GPU whole, so DDP is named with both estimates.
    assert ("fix: parallel.engine=ddp: the 4-bit base fits every GPU whole" in out) == (path == USER_JOB)


def test_the_recommended_config_is_faster_than_the_original(deepseek):
    user, ours = load_config(USER_JOB, []), load_config(RECOMMENDED, [])
    slow = estimate(user, deepseek, "deepspeed", 8, H100)
    fast = estimate(ours, deepseek, "fsdp", 8, H100)
    assert fast.fits and slow.fits
    assert fast.tokens_per_step / fast.step_s > 3 * slow.tokens_per_step / slow.step_s


def test_the_doctor_offers_every_accelerator_the_table_knows():
    from tuneforge.cli import GPU_CHOICES

    assert list(ACCELERATORS) == GPU_CHOICES


@pytest.mark.parametrize(
    ("reported", "memory", "key"),
    [("NVIDIA H200", 139.8, "h200"), ("NVIDIA A100-SXM4-40GB", 39.4, "a100-40gb"), ("NVIDIA L40S", 44.5, "l40s")],
)
def test_a_device_name_finds_its_row_in_the_one_table(reported, memory, key):
    from tuneforge.estimate.hardware import accelerator_for

    found = accelerator_for(reported, memory)
    assert (found.bf16_flops, found.memory_bytes_per_s) == (
        ACCELERATORS[key].bf16_flops,
        ACCELERATORS[key].memory_bytes_per_s,
    )
    assert accelerator_for("Some Future GPU", 200.0).bf16_flops is None


def test_a_4bit_moe_too_big_to_load_onto_one_gpu_is_staged_in_host_ram(mixtral, deepseek):
    """QLoRA on Mixtral-8x7B on one H100: its stacked experts arrive in bf16 (90 GB) before they are quantized.
    Loaded onto the GPU that does not fit; staged in host RAM the GPU holds one expert stack unquantized."""
    capacity = H100.memory_gib * 2**30
    results = {}
    for staging in ("device", "auto", "host"):
        cfg = config(model={**LORA, "quantization": {"bits": 4, "stage_experts": staging}})
        results[staging] = (estimate(cfg, mixtral, "single", 1, H100), check_single(cfg, mixtral, H100)[0])
    (on_device, device_check), (auto, auto_check) = results["device"], results["auto"]
    assert on_device.load_gpu > capacity and on_device.load_host == 0
    assert device_check.status == WARN and "stage_experts=auto (or host)" in device_check.fix
    assert auto.load_gpu < 0.35 * capacity and auto.load_host == pytest.approx(on_device.load_gpu)
    assert auto_check.status == PASS and "host RAM 85 GiB per node while loading" in auto_check.detail
    assert results["host"][0].load_gpu == auto.load_gpu
    # The report's job fits its GPUs as loaded: auto keeps the fast load onto them.
    job = config(model={**LORA, "quantization": {"bits": 4}}, parallel={"engine": "deepspeed"})
    assert estimate(job, deepseek, "deepspeed", 8, H100).load_host == 0


def test_the_staging_rule_and_its_host_ram_check():
    """The run and the estimate share the rule: onto the GPU within 90% of its free memory, else host RAM,
    which must hold a copy per rank of the node."""
    from tuneforge.errors import UserError
    from tuneforge.model.staging import check_host_room, choose_staging

    gib = 2**30
    assert choose_staging("auto", 69 * gib, 77 * gib) == "device"
    assert choose_staging("auto", 70 * gib, 77 * gib) == "host"
    assert choose_staging("device", 100 * gib, 1 * gib) == "device" and choose_staging("host", 1, 100) == "host"
    check_host_room("auto", 85 * gib, 77 * gib, 200 * gib, 2)
    with pytest.raises(UserError, match=r"needs 8 x 85\.0 GiB \(a copy per rank on this node\), 200\.0 GiB are"):
        check_host_room("auto", 85 * gib, 77 * gib, 200 * gib, 8)


def test_expert_parallelism_holds_a_share_of_the_experts_and_pays_their_all_to_all(deepseek):
    """Full fine-tuning of DeepSeek-V2-Lite on 8 ranks, ZeRO-2: with the experts over 8 ranks each holds 1/8 of
    their weights (gradients and optimizer state are sharded the same either way) and sends every token's top-6
    copies to their ranks and back, forward, backward and in the recompute."""
    full = {"train": {"gradient_checkpointing": True}, "data": {"train_files": ["x.jsonl"], "max_length": 4096}}
    plain = estimate(config(parallel={"engine": "deepspeed", "zero_stage": 2}, **full), deepseek, "deepspeed", 8, H100)
    split = config(parallel={"engine": "deepspeed", "zero_stage": 2, "expert_parallel": 8}, **full)
    ep = estimate(split, deepseek, "deepspeed", 8, H100)
    moe = find_moe(deepseek)
    routed = sum(deepseek.get_parameter(f"{b.experts_path}.{name}").numel() for b in moe for name, _ in b.expert_shapes)
    saved = row(plain, "trainable").gpu - row(ep, "trainable").gpu
    assert saved == pytest.approx(routed * 7 / 8 * 2, rel=1e-6)  # bf16 weights under DeepSpeed's cast
    assert row(ep, "gradients").gpu == row(plain, "gradients").gpu
    assert row(ep, "optimizer").gpu == row(plain, "optimizer").gpu
    exchange = dict((what, seconds) for what, seconds, _ in ep.times)["expert all-to-all"]
    tokens = 4096  # one micro-batch of one row of 4,096 per step (the defaults)
    assert exchange == pytest.approx(tokens * 26 * 6 * 2048 * 2 * 6 * 7 / 8 / NVLINK_BYTES_PER_S, rel=1e-6)
    assert "expert all-to-all" not in dict((what, s) for what, s, _ in plain.times)


def test_the_doctor_names_expert_parallelism_for_full_fine_tuning_of_an_moe_under_zero3(tmp_path, capsys):
    job = tmp_path / "full.yaml"
    job.write_text(
        "model: {path: deepseek-ai/DeepSeek-V2-Lite-Chat, dtype: bfloat16}\n"
        "data: {train_files: [chat.jsonl], max_length: 4096, packing: true}\n"
        "train: {micro_batch_size: 1, gradient_accumulation: 8, gradient_checkpointing: true, precision: bf16}\n"
        "parallel: {engine: deepspeed, zero_stage: 3}\n"
    )
    shapes = str(MODELS / "deepseek-v2-lite-chat.config.json")
    main(["doctor", str(job), "--nproc-per-node", "8", "--gpu", "h100", "--model-config", shapes])
    out = capsys.readouterr().out
    assert "fix: parallel.engine=deepspeed zero_stage=2 expert_parallel=8: 8 of the 64 experts per rank" in out
    main(["doctor", str(job), "--nproc-per-node", "8", "--gpu", "h100", "--model-config", shapes, "model.lora.r=8"])
    assert "expert_parallel=" not in capsys.readouterr().out  # LoRA: AutoEP cannot keep adapters on experts


def test_preference_pairs_hold_two_answers_a_row_and_dpo_pays_its_reference_forward(llama):
    """A DPO micro-batch of N pairs holds 2N answers: twice the activations and tokens of N SFT rows, plus one
    forward of the base with the adapters off (about half a LoRA training pass's matmuls: forward and input
    gradients, the frozen base has no weight gradients); a reward model computes no vocabulary logits."""
    sft = estimate(config(model=LORA), llama, "single", 1, H100)
    dpo = estimate(config(model=LORA, train={"objective": "dpo"}), llama, "single", 1, H100)
    reward = estimate(config(model=LORA, train={"objective": "reward"}), llama, "single", 1, H100)
    assert row(dpo, "activations").gpu == pytest.approx(2 * row(sft, "activations").gpu)
    assert "(a pair's two answers)" in row(dpo, "activations").label
    assert dpo.tokens_per_step == 2 * sft.tokens_per_step
    times = {name: seconds for name, seconds, _ in dpo.times}
    assert times["compute"] == pytest.approx(2 * dict((n, s) for n, s, _ in sft.times)["compute"])
    assert 0.45 * times["compute"] < times["reference forward"] < 0.5 * times["compute"]
    assert dpo.step_s == pytest.approx(times["compute"] + times["reference forward"])
    assert not any(r.label.startswith(("fused loss", "logits")) for r in reward.rows)
    assert "reference forward" not in {name for name, _, _ in reward.times}


def test_a_frozen_reference_model_is_counted_where_the_engine_holds_it(llama):
    """`preference.reference: model` holds a second copy of the model before training: sharded over the ranks
    with FSDP2 (and in host RAM under offload), in 4 bits plus the rest with QLoRA; each micro-batch runs one more
    forward and, sharded, gathers the copy once more. A precomputed reference adds none of it."""
    full = {"train": {"objective": "dpo"}, "parallel": {"engine": "fsdp"}}
    table = estimate(config(**full), llama, "fsdp", 8, H100)
    copy = estimate(config(**full, preference={"reference": "model"}), llama, "fsdp", 8, H100)
    total = sum(p.numel() for p in llama.parameters())
    assert not any(r.label.startswith("reference model") for r in table.rows)
    assert row(copy, "reference model").gpu == pytest.approx(total * 2 / 8)  # bf16 weights, an eighth each
    times = {name: seconds for name, seconds, _ in copy.times}
    assert "reference forward" in times and "reference forward" not in {n for n, _, _ in table.times}
    assert times["collectives"] > dict((n, s) for n, s, _ in table.times)["collectives"]

    offload = {**full, "parallel": {"engine": "fsdp", "cpu_offload": "all"}, "preference": {"reference": "model"}}
    offloaded = row(estimate(config(**offload), llama, "fsdp", 8, H100), "reference model")
    assert offloaded.gpu == 0 and offloaded.host == pytest.approx(total * 2)  # 8 ranks' eighths on one node

    quantization = {"bits": 4, "double_quant": True}
    qlora = config(
        model={**LORA, "quantization": quantization}, train={"objective": "dpo"}, preference={"reference": "model"}
    )
    quantized = sum(m.weight.numel() for _, m in quantized_linears(llama, qlora.model.quantization))
    held = row(estimate(qlora, llama, "single", 1, H100), "reference model").gpu
    # The copy's k-bit preparation, like the policy's base's, casts what stays in 16 bits to fp32.
    assert held == pytest.approx(quantized * kbit_bytes(4, True) + (total - quantized) * 4)


def test_a_precomputed_reference_costs_one_forward_over_the_pairs_before_the_first_step(llama):
    """The precompute pass is the frozen copy's per-step reference forward, done once per pair instead of once
    per step: over 10 steps' worth of pairs, 10 times that row; and it is printed with the run's duration."""
    full = {"train": {"objective": "dpo", "gradient_accumulation": 4}, "parallel": {"engine": "fsdp"}}
    pairs = 8 * 4 * config(**full).train.micro_batch_size * 10  # 8 ranks x 4 micro-batches: 10 steps' worth
    table = estimate(config(**full), llama, "fsdp", 8, H100, num_samples=pairs)
    copy = estimate(config(**full, preference={"reference": "model"}), llama, "fsdp", 8, H100, num_samples=pairs)
    what, seconds = table.before_training
    assert what == f"the reference's log-probabilities of {pairs:,} pairs (one forward pass, rows counted full)"
    assert seconds == pytest.approx(10 * dict((n, s) for n, s, _ in copy.times)["reference forward"])
    assert copy.before_training is None and "before the first step: the reference's" in format_estimate(table)


# Vision-language models: the published configs of the VLM recipes, built as training builds them.
VLM_SHAPES = {  # name: (published parameter count, the tower and projector's module paths)
    "qwen2.5-vl-7b": (8.29e9, ("model.visual.",)),
    "qwen3-vl-30b-a3b": (31.07e9, ("model.visual.",)),
    "internvl3-8b": (7.94e9, ("model.vision_tower.", "model.multi_modal_projector.")),
    "gemma-3-12b": (12.19e9, ("model.vision_tower.", "model.multi_modal_projector.")),
    "llava-1.5-7b": (7.06e9, ("model.vision_tower.", "model.multi_modal_projector.")),
}


def vlm_skeleton(name: str):
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(read_model_config(MODELS / f"{name}.config.json"))


@pytest.fixture(scope="module")
def qwen_vl():
    return vlm_skeleton("qwen2.5-vl-7b")


@pytest.mark.parametrize("name", list(VLM_SHAPES))
def test_a_vlm_estimate_counts_the_tower_and_projector_of_the_model_its_published_config_builds(name):
    """The estimate's parameters add up to the real model's, built from the published config on the meta device
    as training builds it: the language model's shapes from `text_config`, the tower and projector beside it (the
    doctor builds the same class from the shapes file)."""
    model = vlm_skeleton(name)
    published, vision_paths = VLM_SHAPES[name]
    real = sum(p.numel() for p in model.parameters())  # a tied head counted once, as it is stored
    real_vision = sum(p.numel() for n, p in model.named_parameters() if n.startswith(vision_paths))
    assert real == pytest.approx(published, rel=0.005)

    cfg = config(model=LORA)  # adapters on the language model; the tower frozen, the projector trained whole
    est = estimate(cfg, model, "single", 1, H100)
    s = model_shapes(cfg, model, find_moe(model), 2)
    assert s.vision is not None and s.vision.tower + s.vision.projector == real_vision
    assert s.frozen == real  # the whole base, the tower and projector included, stays in memory
    assert row(est, "base weights").gpu == pytest.approx(real * 2)
    text = model.config.get_text_config()
    assert (s.hidden, s.layers) == (text.hidden_size, text.num_hidden_layers)
    # The projector trains whole beside the adapters (PEFT's modules_to_save: a trained copy).
    assert s.vision.projector_trainable == s.vision.projector and s.trainable > s.vision.projector
    assert f"vision: tower {count_label(s.vision.tower)} (frozen)" in format_estimate(est)

    skeleton = model_skeleton(load_config(RECIPES / "llama-3-8b-lora-1gpu.yaml"), None, MODELS / f"{name}.config.json")
    assert type(skeleton) is type(model)  # the doctor's skeleton: the vision-language class, not a text model


def test_a_vlms_language_model_takes_the_adapters_its_text_model_would(qwen_vl):
    """Qwen2.5-VL-7B's language model is Qwen2.5-7B: the same LoRA targets, so the same trainable count, whatever
    the tower holds; a frozen tower and projector add nothing to train, so no gradients or optimizer state; and
    the same weights in 4 bits under QLoRA."""
    cfg = config(model={**LORA, "vision": {"tower": "frozen", "projector": "frozen"}})
    qwen = skeleton("qwen2.5-7b")
    text = estimate(config(model=LORA), qwen, "single", 1, H100)
    vlm = estimate(cfg, qwen_vl, "single", 1, H100)
    for part in ("trainable", "gradients", "optimizer"):
        assert row(vlm, part).gpu == pytest.approx(row(text, part).gpu)
    # QLoRA quantizes the language model's linear layers alone: the tower and projector stay in 16 bits.
    qlora = config(model={**LORA, "quantization": {"bits": 4}})
    quantized = model_shapes(qlora, qwen_vl, find_moe(qwen_vl), 2).quantized
    assert quantized == model_shapes(qlora, qwen, find_moe(qwen), 2).quantized
    # Adapters on the tower too (tower: lora) train more; a tower trained in full trains all of it.
    tower_lora = model_shapes(config(model={**LORA, "vision": {"tower": "lora"}}), qwen_vl, find_moe(qwen_vl), 2)
    tower_full = model_shapes(config(model={"vision": {"tower": "full"}}), qwen_vl, find_moe(qwen_vl), 2)
    assert 0 < tower_lora.vision.tower_trainable < tower_lora.vision.tower == tower_full.vision.tower_trainable


def test_projector_pretraining_trains_the_projector_alone():
    """LLaVA's stage 1 (`language: frozen`, no adapters): the projector is all that trains, so gradients and
    optimizer state are the projector's; the frozen language model still passes gradients back, so its
    activations stay."""
    llava = vlm_skeleton("llava-1.5-7b")
    cfg = config(model={"vision": {"tower": "frozen", "projector": "full", "language": "frozen"}})
    s = model_shapes(cfg, llava, find_moe(llava), 2)
    projector = sum(p.numel() for p in llava.model.multi_modal_projector.parameters())
    assert s.trainable == projector and s.frozen == sum(p.numel() for p in llava.parameters()) - projector
    assert s.vision.language == "frozen" and s.active_trainable == 0
    est = estimate(cfg, llava, "single", 1, H100)
    assert row(est, "gradients").gpu == pytest.approx(projector * 2)  # 16-bit, as full fine-tuning keeps them
    assert row(est, "activations").gpu > 0


def test_image_tokens_raise_the_activation_and_time_estimate(qwen_vl):
    """Qwen2.5-VL's tokens per image follow `data.image_max_pixels` (one per 28 x 28 pixels, 4 patches each):
    bigger images keep more activations in a trained tower and projector, and cost the tower more time. A frozen
    tower keeps none; LLaVA's count is fixed by its CLIP grid."""

    def run(pixels: int, tower: str):
        cfg = config(model={"vision": {"tower": tower}}, data={"image_max_pixels": pixels, "packing": False})
        return estimate(cfg, qwen_vl, "single", 1, H100)

    small, large = run(256 * 784, "full"), run(1024 * 784, "full")
    assert "1 x 1,024 tokens, 4,096 patches" in row(large, "images").label
    assert row(large, "images").gpu > 3.5 * row(small, "images").gpu > 0
    vision_s = {
        name: dict((n, s) for n, s, _ in est.times)["vision tower"] for name, est in (("s", small), ("l", large))
    }
    assert vision_s["l"] > 3.5 * vision_s["s"] and large.step_s > small.step_s
    frozen = run(1024 * 784, "frozen")  # the projector still trains: only its activations stay
    assert row(frozen, "images").gpu < row(large, "images").gpu / 10
    # No budget: a quarter of max_length per image, so 4 images to a packed row of 2048 tokens.
    packed = format_estimate(estimate(config(data={"packing": True}), qwen_vl, "single", 1, H100))
    assert "512 tokens per image" in packed and "4 images per packed row" in packed

    llava = vlm_skeleton("llava-1.5-7b")
    s = model_shapes(config(), llava, find_moe(llava), 2)
    assert (s.vision.image.tokens, s.vision.image.patches) == (576, 577)  # 24 x 24 patches, CLIP's class token


VISION_SETUPS = [
    {},  # the defaults: tower frozen, projector and language model trained in full
    {"vision": {"language": "frozen"}},  # projector pretraining
    {"lora": {"r": 4}},  # adapters on the language model, the projector trained whole beside them
    {"lora": {"r": 4}, "vision": {"tower": "lora", "projector": "frozen"}},
    {"lora": {"r": 4}, "vision": {"tower": "full", "projector": "frozen"}},  # Qwen's merger trains with its tower
]


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl", "qwen3_vl_moe", "gemma3", "internvl"])
def test_the_estimate_trains_what_vision_language_training_trains(family):
    """For each family's tiny model and each way of training its parts, the trainable count that sizes the
    gradients and optimizer state is what `make_vision_trainable` leaves requiring gradients."""
    tokenizer = vision_tokenizer(build_byte_tokenizer(), family)
    fresh = fresh_vision_config(family, TINY_SIZES[family], tokenizer)
    for setup in VISION_SETUPS:
        cfg = config(model={"path": None, "architecture": family, "tokenizer": "bytes", **setup})
        model = AutoModelForImageTextToText.from_config(fresh)
        moe = find_moe(model)
        s = model_shapes(cfg, model, moe, 2)
        trained, _ = make_vision_trainable(model, cfg.model, moe, VisionParts.of(model))
        assert s.trainable == sum(p.numel() for p in trained.parameters() if p.requires_grad), setup


def test_a_grpo_reward_model_counts_whole_on_each_rank_in_the_compute_dtype(llama, tmp_path, tokenizer):
    """Its values read from the safetensors headers (an adapter's from its base), nothing loaded."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from conftest import TINY_DENSE

    scorer = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(tokenizer), **TINY_DENSE, num_labels=1))
    scorer.save_pretrained(tmp_path / "full")
    values = sum(p.numel() for p in scorer.parameters())
    scorer.name_or_path = str(tmp_path / "full")
    get_peft_model(scorer, LoraConfig(r=2, target_modules=["q_proj"], task_type="SEQ_CLS")).save_pretrained(
        tmp_path / "adapter"
    )
    grpo = {"train": {"objective": "grpo"}, "model": LORA, "parallel": {"engine": "fsdp"}}
    without = estimate(config(**grpo), llama, "fsdp", 8, H100)
    assert not any(r.label.startswith("reward model") for r in without.rows)
    for path in ("full", "adapter"):
        rl = {"rewards": [{"kind": "model", "path": str(tmp_path / path)}]}
        eight = estimate(config(**grpo, rl=rl), llama, "fsdp", 8, H100)
        # bf16, not divided by the ranks; an adapter's own weights (LoRA factors, its score head) on top of its base
        expected = values * 2 if path == "full" else pytest.approx(values * 2, rel=0.1)
        assert row(eight, "reward model").gpu == expected


def test_a_grpo_vllm_engine_takes_its_share_of_the_gpu(llama):
    """`rl.generator: vllm`: the engine's share of each GPU (its merged weights and KV cache), no row otherwise."""
    grpo = {"train": {"objective": "grpo"}, "model": LORA}
    without = estimate(config(**grpo), llama, "single", 1, H100)
    assert not any(r.label.startswith("vLLM engine") for r in without.rows)
    rl = {"generator": "vllm", "vllm": {"gpu_memory_utilization": 0.4}}
    with_vllm = estimate(config(**grpo, rl=rl), llama, "single", 1, H100)
    assert row(with_vllm, "vLLM engine").gpu == pytest.approx(0.4 * H100.memory_gib * 2**30)
    assert with_vllm.peak_gpu - without.peak_gpu == pytest.approx(0.4 * H100.memory_gib * 2**30, rel=0.01)
