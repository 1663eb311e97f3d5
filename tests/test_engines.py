"""Engine choice, the generated DeepSpeed JSON, offload rules, and MoE blocks found by structure."""

from __future__ import annotations

import json

import pytest
import torch

from tuneforge.config.schema import ParallelConfig, TrainConfig
from tuneforge.distributed import DistInfo
from tuneforge.engines import choose_engine, engine_traits
from tuneforge.engines.deepspeed import deepspeed_config
from tuneforge.errors import UserError
from tuneforge.model.moe import find_moe
from tuneforge.model.structure import decoder_layers

from conftest import tiny_deepseek_v2, tiny_llama


def info(world: int) -> DistInfo:
    return DistInfo(0, world, 0, torch.device("cpu"))


def test_auto_picks_single_or_ddp_and_impossible_choices_are_refused():
    assert choose_engine("auto", info(1)) == "single"
    assert choose_engine("auto", info(4)) == "ddp"
    assert choose_engine("fsdp", info(4)) == "fsdp"
    with pytest.raises(UserError, match="cannot run in 4 processes"):
        choose_engine("single", info(4))
    with pytest.raises(UserError, match="needs several processes"):
        choose_engine("deepspeed", info(1))


def test_generated_deepspeed_json_follows_our_config_and_user_json_wins(tmp_path):
    train = TrainConfig(micro_batch_size=2, gradient_accumulation=8, max_grad_norm=0.5)
    parallel = ParallelConfig(engine="deepspeed", zero_stage=3, cpu_offload="all")
    config = deepspeed_config(parallel, train, world_size=4, bf16=False)
    assert config["train_batch_size"] == 64 and config["gradient_clipping"] == 0.5
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    extra = tmp_path / "ds.json"
    extra.write_text(json.dumps({"zero_optimization": {"stage3_prefetch_bucket_size": 1000}, "steps_per_print": 10}))
    merged = deepspeed_config(parallel.model_copy(update={"deepspeed_config": str(extra)}), train, 4, False)
    assert merged["zero_optimization"]["stage3_prefetch_bucket_size"] == 1000
    assert merged["zero_optimization"]["stage"] == 3  # kept from ours
    assert merged["steps_per_print"] == 10


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"engine": "fsdp", "cpu_offload": "optimizer"}, "FSDP2 offloads all state or none"),
        ({"engine": "deepspeed", "zero_stage": 2, "cpu_offload": "all"}, "parameter offload needs ZeRO-3"),
        ({"engine": "ddp", "cpu_offload": "all"}, "needs engine fsdp or deepspeed"),
    ],
)
def test_offload_combinations_that_cannot_work_are_refused_by_their_engine(fields, message):
    with pytest.raises(UserError, match=message):
        choose_engine(fields["engine"], info(2), ParallelConfig(**fields))


def test_moe_blocks_and_decoder_layers_are_found_by_structure(tokenizer):
    deepseek = tiny_deepseek_v2(tokenizer)
    blocks = find_moe(deepseek)
    assert [(b.name, b.num_experts, b.layout) for b in blocks] == [("model.layers.1.mlp", 4, "stacked")]
    assert not find_moe(tiny_llama(tokenizer))
    assert decoder_layers(deepseek) is deepseek.model.layers


def test_each_engine_states_its_traits_before_it_is_built():
    bf16, fp16 = TrainConfig(precision="bf16"), TrainConfig(precision="fp16")
    zero = {stage: ParallelConfig(engine="deepspeed", zero_stage=stage) for stage in (2, 3)}
    facts = {
        name: engine_traits(name, parallel, train)
        for name, parallel, train in [
            ("single", ParallelConfig(), bf16),
            ("ddp", ParallelConfig(), bf16),
            ("fsdp", ParallelConfig(engine="fsdp"), bf16),
            ("deepspeed", zero[3], bf16),
        ]
    }
    assert [name for name, t in facts.items() if t.sharded] == ["fsdp", "deepspeed"]
    assert [name for name, t in facts.items() if not t.fuses_output_layer] == ["deepspeed"]  # ZeRO-3 only
    assert engine_traits("deepspeed", zero[2], bf16).fuses_output_layer
    assert [name for name, t in facts.items() if t.casts_parameters] == ["deepspeed"]
    assert not engine_traits("deepspeed", zero[3], bf16, device="cpu").casts_parameters  # autocast on CPU
    assert [name for name, t in facts.items() if t.compiles] == ["single", "ddp"]
    assert engine_traits("deepspeed", zero[3], fp16).skips_nonfinite and not facts["deepspeed"].skips_nonfinite
    # parallel.moe_safety reaches both sharded engines; without sharding nothing needs it.
    unsafe = {"moe_safety": False}
    assert not engine_traits("fsdp", ParallelConfig(engine="fsdp", **unsafe), bf16).moe_safety
    assert not engine_traits("deepspeed", ParallelConfig(engine="deepspeed", **unsafe), bf16).moe_safety
    assert facts["fsdp"].moe_safety and facts["deepspeed"].moe_safety
    assert facts["deepspeed"].label == "deepspeed ZeRO-3" and facts["fsdp"].label == "fsdp (FSDP2)"


def test_a_non_finite_step_is_skipped_on_the_device_with_weights_moments_and_count_kept(tokenizer):
    """The fused AdamW takes the skip decision as a tensor (`found_inf`): no host read of the norm is needed,
    and a skipped step leaves everything as it was, while the next finite one applies as usual."""
    from tuneforge.config.schema import TrainConfig
    from tuneforge.engines.single import SingleEngine
    from tuneforge.train.optim import build_optimizer

    model = tiny_llama(tokenizer)
    engine = SingleEngine(model, lambda m: build_optimizer(m, TrainConfig(precision="fp32")))
    assert engine.optimizer.defaults["fused"]

    def step_with(value: float) -> torch.Tensor:
        for param in model.parameters():
            param.grad = torch.full_like(param, value)
        return engine.step(1e-2, 1.0)

    assert torch.isfinite(step_with(0.5))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {k: {s: t.clone() for s, t in v.items()} for k, v in engine.optimizer.state.items()}
    norm = step_with(float("nan"))
    assert isinstance(norm, torch.Tensor) and not torch.isfinite(norm)
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
    for key, state in engine.optimizer.state.items():
        for slot, tensor in state.items():
            assert torch.equal(tensor, moments[key][slot]), slot
    step_with(0.5)
    assert not torch.equal(next(model.parameters()), next(iter(before.values())))
    assert float(next(iter(engine.optimizer.state.values()))["step"]) == 2.0


def test_the_engine_choice_is_made_once_with_its_traits_on_the_runs_device_and_asks_the_engine_about_the_model():
    import torch

    from tuneforge.config.schema import Config
    from tuneforge.distributed import DistInfo
    from tuneforge.engines import EngineChoice

    parallel, train = ParallelConfig(engine="deepspeed", zero_stage=3), TrainConfig(precision="bf16")
    two = DistInfo(0, 2, 0, torch.device("cpu"))
    on_cpu = EngineChoice.choose(two, parallel, train)
    assert on_cpu.name == "deepspeed" and not on_cpu.traits.casts_parameters  # bf16 autocast on CPU
    assert EngineChoice.choose(two, parallel, train, device="cuda").traits.casts_parameters
    read = []
    cfg = Config.model_validate(
        {"model": {"architecture": "llama", "tokenizer": "bytes"}, "data": {"train_files": ["x.jsonl"]}}
    )
    assert on_cpu.model_problems(cfg, lambda: read.append(1), 2) == ([], "")
    assert not read  # no expert parallelism: the model's config is not read
    assert EngineChoice.choose(DistInfo(0, 1, 0, torch.device("cpu")), ParallelConfig(), train).name == "single"
