"""Sequence parallelism: each row split across 2 ranks equals one rank with the whole rows (gloo, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tuneforge.config.schema import ParallelConfig
from tuneforge.data.batching import collate, sequence_width_multiple, shard_rows
from tuneforge.distributed import DistInfo, Layout
from tuneforge.engines import choose_engine
from tuneforge.errors import UserError
from tuneforge.model.sequence_parallel import unsupported
from tuneforge.train.state import ResumePoint, check_compatible

from conftest import ENGINES, TINY_MODELS, chat, launch, metrics, tokenized, train_here, write_jsonl

CONFIG = """\
model: {model}
data: {{train_files: [train.jsonl], cache_dir: null, group_by_length: false, packing: {packing}, max_length: 160}}
train: {{lr: 1.0e-3, warmup_steps: 1, precision: fp32, gradient_accumulation: 2, max_steps: 4, max_grad_norm: 1.0,
        micro_batch_size: 2}}
checkpoint: {{every_steps: 0}}
log: {{progress: lines}}
"""
SEQUENCE_PARALLEL = "parallel.sequence_parallel=2"


def write_job(directory: Path, model: str, packing: bool) -> Path:
    samples = [chat(f"question {i} " + "x" * (i * 5 % 23), f"answer {i * 7} " + "y" * (i % 5)) for i in range(24)]
    write_jsonl(directory / "train.jsonl", samples)
    config = directory / "cfg.yaml"
    config.write_text(CONFIG.format(model=TINY_MODELS[model], packing=str(packing).lower()))
    return config


def losses(work_dir: Path) -> list[float]:
    return [record["loss"] for record in metrics(work_dir)]


def assert_same_weights(one: Path, two: Path, name: str) -> None:
    one_weights = load_file(one / "checkpoints" / "final" / name)
    two_weights = load_file(two / "checkpoints" / "final" / name)
    assert one_weights.keys() == two_weights.keys()
    for key, tensor in one_weights.items():
        torch.testing.assert_close(two_weights[key], tensor, atol=1e-5, rtol=1e-4, msg=key)


def recorded_ops(work_dir: Path, rank: int) -> list[str]:
    live = json.loads((work_dir / "diagnostics" / "live" / f"rank-{rank}.json").read_text())
    return [record["op"] for record in live["collectives"]]


# Each model packed and unpacked, each engine at least once; the MoE model with its router balance loss on.
# The CI's 30 minutes do not hold the full product of models, packing and engines.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "packing", "engine"),
    [
        ("llama", False, "ddp"),
        ("llama", True, "fsdp"),
        ("deepseek_v2", True, "ddp"),
        ("deepseek_v2", False, "zero3_offload"),
    ],
)
def test_two_ranks_splitting_each_row_equal_one_rank_with_whole_rows(tmp_path, model, packing, engine):
    config = write_job(tmp_path, model, packing)
    # The FSDP2 case also validates (split like training) and samples chats (whole prompts, no split).
    extra = ["data.validation_fraction=0.25", "eval.every_steps=2", "eval.sample_prompts=[hello]"]
    extra = extra if engine == "fsdp" else []
    if model == "deepseek_v2" and packing:  # activations recomputed in backward: the exchanges run again there
        extra = ["train.gradient_checkpointing=true"]
    one = train_here(config, tmp_path / "one", *extra)
    assert one.returncode == 0, one.stderr[-3000:]
    two = launch(config, tmp_path / "two", SEQUENCE_PARALLEL, *ENGINES[engine], *extra, ranks=2, timeout=600)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert "sequence parallel: each row split across 2 ranks" in two.stdout
    assert "x 1 data-parallel group(s) of 2 ranks, each row split across a group = 4 per step" in two.stdout
    # Every token once: the two shards' counts add up to the whole rows'.
    for key in ("tokens", "trained_tokens"):
        assert [r[key] for r in metrics(tmp_path / "two")] == [r[key] for r in metrics(tmp_path / "one")]
    # Attention across the shards is what makes the losses equal: without the exchange, the second half of
    # every row would not see the first.
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), abs=1e-5)
    if engine == "fsdp":
        validation = [[r["val_loss"] for r in metrics(tmp_path / run) if "val_loss" in r] for run in ("one", "two")]
        assert len(validation[1]) == 2 and validation[1] == pytest.approx(validation[0], abs=1e-5)
        assert "[sample @ step 4] 'hello' -> " in two.stdout
    if model == "deepseek_v2":  # the router balance loss covers the whole rows
        aux = [[r["router_aux_loss"] for r in metrics(tmp_path / run)] for run in ("one", "two")]
        assert aux[1] == pytest.approx(aux[0], abs=1e-5)
    assert_same_weights(tmp_path / "one", tmp_path / "two", "model.safetensors")
    if engine == "ddp":  # the exchanges are recorded by the hang watchdog like every other collective (the live
        # file keeps the last few; a sharded engine's final save fills it with its gathers)
        assert "all_to_all_single" in recorded_ops(tmp_path / "two", 1)


REPORT_SETUP = """\
model:
  architecture: deepseek_v2
  tokenizer: bytes
  size: {hidden_size: 64, intermediate_size: 128, moe_intermediate_size: 32, num_hidden_layers: 2,
    num_attention_heads: 4, num_key_value_heads: 4, n_routed_experts: 4, num_experts_per_tok: 2, n_shared_experts: 1,
    first_k_dense_replace: 1, kv_lora_rank: 24, q_lora_rank: null, qk_rope_head_dim: 8, qk_nope_head_dim: 8,
    v_head_dim: 8}
  lora: {r: 8, alpha: 16, dropout: 0.0, experts: true}
  quantization: {bits: 4, quant_type: nf4, double_quant: true, compute_dtype: float32}
data: {train_files: [train.jsonl], cache_dir: null, packing: true, max_length: 160}
train: {lr: 1.0e-2, micro_batch_size: 2, max_steps: 5, precision: fp32}
checkpoint: {every_steps: 2, keep_last: 2}
log: {progress: lines}
"""


@pytest.mark.slow
def test_the_reports_setup_split_across_ranks_stopped_and_resumed_equals_one_rank(tmp_path):
    """QLoRA (4-bit NF4, double quant) on DeepseekV2 with adapters on the routed experts, packed rows, ZeRO-3 with
    offload on 2 ranks that split each row; a scheduler's SIGTERM at step 3, then --resume auto: the same losses
    and adapter as one process with the whole rows."""
    write_job(tmp_path, "llama", True)
    config = tmp_path / "cfg.yaml"
    config.write_text(REPORT_SETUP)
    one = train_here(config, tmp_path / "one")
    assert one.returncode == 0, one.stderr[-3000:]
    extra = [SEQUENCE_PARALLEL, *ENGINES["zero3_offload"]]
    stopped = launch(config, tmp_path / "two", *extra, ranks=2, fault="sigterm:1:3", timeout=600)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    resumed = launch(config, tmp_path / "two", *extra, "--resume", "auto", ranks=2, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "step 3 of 5" in resumed.stdout
    assert [r["step"] for r in metrics(tmp_path / "two")] == [1, 2, 3, 4, 5]
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), abs=1e-5)
    assert_same_weights(tmp_path / "one", tmp_path / "two", "adapter_model.safetensors")


def test_shards_of_a_row_are_its_contiguous_parts_with_the_whole_positions(tokenizer):
    data = tokenized(tokenizer, [chat(f"q{i}" * (1 + i), f"answer {i}") for i in range(3)])
    size = 2
    whole = collate(data, [[0, 1], [2]], tokenizer.pad_token_id, True, sequence_width_multiple(size))
    assert whole.input_ids.size(1) % (2 * size) == 0
    shards = [shard_rows(whole, shard, size) for shard in range(size)]
    for name in ("input_ids", "targets", "position_ids", "attention_mask"):
        assert torch.equal(torch.cat([getattr(s, name) for s in shards], dim=1), getattr(whole, name))
    assert all(torch.equal(s.whole_position_ids, whole.position_ids) for s in shards)
    assert sum(s.num_targets for s in shards) == whole.num_targets
    assert shard_rows(whole, 0, 1) is whole


def test_layouts_group_consecutive_ranks():
    assert [Layout.of(rank, 4, 2) for rank in range(4)] == [
        Layout(2, 0, 0, 2),
        Layout(2, 1, 0, 2),
        Layout(2, 0, 1, 2),
        Layout(2, 1, 1, 2),
    ]


def test_what_cannot_be_split_is_named():
    assert unsupported(4, 4, 2, 2) == []
    problems = unsupported(6, 3, 3, 2)
    assert any("3 rank(s) do not split into groups of 2" in p for p in problems)
    assert any("3 key/value heads do not divide among 2 ranks" in p for p in problems)
    assert not any("6 attention heads" in p for p in problems)
    with pytest.raises(UserError, match="sequence_parallel needs several ranks"):
        choose_engine("auto", DistInfo(0, 1, 0, torch.device("cpu")), ParallelConfig(sequence_parallel=2))


def test_resume_with_another_split_is_refused(tmp_path):
    point = ResumePoint(
        step=4, epoch=0, samples_consumed=16, world_size=2, micro_batch_size=2, gradient_accumulation=2, engine="ddp",
        sequence_parallel=2,
    )  # fmt: skip
    shape = {"world_size": 2, "micro_batch_size": 2, "gradient_accumulation": 2, "engine": "ddp", "expert_parallel": 1}
    check_compatible(point, tmp_path, **shape, sequence_parallel=2)
    with pytest.raises(UserError, match=r"written with parallel\.sequence_parallel=2, this run has 1"):
        check_compatible(point, tmp_path, **shape, sequence_parallel=1)
    with pytest.raises(
        UserError, match=r"written by 2 process\(es\) with engine ddp, micro-batch 2 .* this run has 1,"
    ):
        check_compatible(point, tmp_path, **{**shape, "world_size": 1}, sequence_parallel=2)


@pytest.mark.slow
def test_one_process_cannot_split_rows_and_says_so_before_the_model_loads(tmp_path):
    config = write_job(tmp_path, "llama", False)
    result = train_here(config, tmp_path / "run", SEQUENCE_PARALLEL)
    assert result.returncode != 0
    assert "parallel.sequence_parallel needs several ranks: launch several (--nproc-per-node N)" in result.stderr
    assert "model: LlamaForCausalLM" not in result.stdout


@pytest.mark.slow
def test_indivisible_heads_and_eager_attention_are_refused_on_two_ranks(tmp_path):
    config = write_job(tmp_path, "llama", False)
    result = launch(
        config,
        tmp_path / "run",
        SEQUENCE_PARALLEL,
        "parallel.engine=ddp",
        "model.size.num_key_value_heads=1",
        "model.attn_implementation=eager",
        ranks=2,
    )
    assert result.returncode != 0
    assert "the model's 1 key/value heads do not divide among 2 ranks" in result.stderr
    assert "model.attn_implementation=eager: it needs sdpa" in result.stderr
    assert "model: LlamaForCausalLM" not in result.stdout
