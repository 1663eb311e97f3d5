"""2 ranks equal 1: the same global batch through the launcher users call (gloo, CPU)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ENGINES, TINY_MODELS, TUNEFORGE, chat, free_port, launch, metrics, train_here, write_jsonl

MODELS = TINY_MODELS
CONFIG = """\
model: {model}
data: {{train_files: [train.jsonl], cache_dir: null, group_by_length: false}}
train: {{lr: 1.0e-3, warmup_steps: 1, precision: fp32, gradient_accumulation: 2, max_steps: 4, max_grad_norm: 1.0}}
checkpoint: {{every_steps: 0}}
log: {{progress: lines}}
"""


def train(config: Path, work_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    result = launch(config, work_dir, *extra, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # A healthy run on several ranks: the watchdog's limits never fired.
    assert not (work_dir / "diagnostics" / "report.txt").exists() and "slow, not hung" not in result.stderr
    return result


def losses(work_dir: Path) -> list[float]:
    return [record["loss"] for record in metrics(work_dir)]


def write_job(directory: Path, model: str) -> Path:
    write_jsonl(
        directory / "train.jsonl", [chat(f"question {i} " + "x" * (i % 9), f"answer {i * 7}") for i in range(40)]
    )
    config = directory / "cfg.yaml"
    config.write_text(CONFIG.format(model=MODELS[model]))
    return config


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """`one_process(model)` -> (config, work dir of its run in one process with the whole global batch): each
    model's reference is trained once for all the engines compared with it."""
    runs: dict[str, tuple[Path, Path]] = {}

    def run(model: str) -> tuple[Path, Path]:
        if model not in runs:
            directory = tmp_path_factory.mktemp(f"one-{model}")
            config = write_job(directory, model)
            result = train_here(config, directory / "one", "train.micro_batch_size=4")
            assert result.returncode == 0, result.stderr[-3000:]
            runs[model] = config, directory / "one"
        return runs[model]

    return run


# The sharded engines with the MoE model (its experts make ranks' work differ) and the dense one; DDP with an
# MoE model is the expert-adapter case below. The CI's 30 minutes do not hold the full product.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "engine"),
    [("deepseek_v2", engine) for engine in ("fsdp", "zero2", "zero3_offload")]
    + [("llama", "fsdp"), ("llama", "zero3_offload")],
)
def test_two_ranks_equal_one_process_with_the_same_global_batch(tmp_path, one_process, model, engine):
    config, one = one_process(model)
    two = train(
        config,
        tmp_path / "two",
        "train.micro_batch_size=2",
        *ENGINES[engine],
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
    )
    assert f"engine: {ENGINES[engine][0].split('=')[1]}, 2 process(es)" in two.stdout
    # Tolerance: the runs differ only in summation order (per-rank matmuls, then the gradient all-reduce),
    # about 1e-7 relative in fp32; four AdamW steps keep the drift well under 1e-5.
    assert losses(tmp_path / "two") == pytest.approx(losses(one), abs=1e-5)
    one_weights = load_file(one / "checkpoints" / "final" / "model.safetensors")
    two_weights = load_file(tmp_path / "two" / "checkpoints" / "final" / "model.safetensors")
    assert one_weights.keys() == two_weights.keys()
    for name, tensor in one_weights.items():
        torch.testing.assert_close(two_weights[name], tensor, atol=1e-5, rtol=1e-4, msg=name)


EXPERT_ADAPTERS = "model.lora={r: 4, alpha: 8, dropout: 0.0, experts: true}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "engine"),
    [("deepseek_v2", "zero3_offload"), ("mixtral", "fsdp"), ("qwen3_moe", "ddp")],
)
def test_expert_adapters_on_two_ranks_equal_one_with_the_router_loss_on(tmp_path, model, engine):
    """The report's set-up in small: LoRA on the routed experts (stacked, adapted through PEFT's
    target_parameters), whose MoE map must still drive the router loss and each engine's MoE handling. One MoE
    model per engine: DeepseekV2's MLA and shared experts where the report ran them, under ZeRO-3 with offload."""
    config = write_job(tmp_path, model)
    one = train_here(config, tmp_path / "one", "train.micro_batch_size=4", EXPERT_ADAPTERS)
    assert one.returncode == 0, one.stderr[-3000:]
    two = train(
        config,
        tmp_path / "two",
        "train.micro_batch_size=2",
        EXPERT_ADAPTERS,
        *ENGINES[engine],
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
    )
    maps = [next(line for line in run.stdout.splitlines() if line.startswith("moe: ")) for run in (one, two)]
    assert maps[0] == maps[1] and "routed experts each (stacked)" in maps[0]
    assert "experts.gate_up_proj" in two.stdout and "router balance loss: coefficient" in two.stdout
    records = {run: [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").open()] for run in ("one", "two")}
    assert all("router_aux_loss" in r for r in records["two"])
    assert [r["router_aux_loss"] for r in records["two"]] == pytest.approx(
        [r["router_aux_loss"] for r in records["one"]], abs=1e-5
    )
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), abs=1e-5)
    adapter = Path("checkpoints") / "final" / "adapter_model.safetensors"
    one_weights, two_weights = load_file(tmp_path / "one" / adapter), load_file(tmp_path / "two" / adapter)
    assert one_weights.keys() == two_weights.keys() and any("experts" in name for name in one_weights)
    for name, tensor in one_weights.items():
        torch.testing.assert_close(two_weights[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
    assert_peft_loads_it_as_trained(tmp_path / "two")


def assert_peft_loads_it_as_trained(work_dir: Path) -> None:
    """The adapter a sharded run saved, loaded by PEFT itself onto the plain base, computes what tuneforge's
    own loader does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tuneforge.trained import load_trained

    final = work_dir / "checkpoints" / "final"
    ids = torch.arange(3, 43).reshape(2, 20)
    with torch.no_grad():
        ours = load_trained(final).model(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(work_dir / "base", dtype=torch.float32)
        theirs = PeftModel.from_pretrained(plain, final).eval()(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_two_nodes_simulated_on_this_machine_equal_one_node(tmp_path, one_process):
    """Each node has its own data cache (`data.cache_dir` on a disk of its own, as the default under the home
    directory often is): each node's first rank builds it, where the second node used to wait for rank 0's."""
    config, one = one_process("llama")
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            [
                TUNEFORGE,
                "train",
                str(config),
                "--work-dir",
                str(tmp_path / "two"),
                "train.micro_batch_size=2",
                f"data.cache_dir={tmp_path / f'cache-node-{node}'}",
                "data.preprocess_timeout_s=60",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "2 process(es)" in outputs[0]
    assert losses(tmp_path / "two") == pytest.approx(losses(one), abs=1e-5)


@pytest.mark.slow
def test_fsdp_samples_evaluates_and_saves_loadable_checkpoints_without_hanging(tmp_path):
    from transformers import AutoModelForCausalLM

    write_job(tmp_path, "llama")
    # Replies of a barely trained model end at different lengths on each prompt: generation must run in lockstep.
    write_jsonl(tmp_path / "heldout.jsonl", [chat("q" * n, "a") for n in (1, 7, 19)])
    run = train(
        tmp_path / "cfg.yaml",
        tmp_path / "wd",
        "parallel.engine=fsdp",
        "train.micro_batch_size=2",
        "checkpoint.every_steps=2",
        "eval.sample_prompts=[hi, a longer prompt]",
        "eval.sample_every_steps=2",
        "eval.sample_max_new_tokens=8",
        f"eval.exact_match={{file: {tmp_path / 'heldout.jsonl'}, label: tiny, max_new_tokens: 6, batch_size: 1}}",
        "watchdog.stall_timeout_s=120",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
    )
    assert "tiny accuracy: " in run.stdout
    samples = [json.loads(line) for line in (tmp_path / "wd" / "samples.jsonl").open()]
    assert sorted({s["step"] for s in samples}) == [2, 4]
    for name in ("step-2", "step-4", "final"):
        directory = tmp_path / "wd" / "checkpoints" / name
        assert json.loads((directory / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    # The sharded weights were gathered whole: each checkpoint loads, and training moved them between the two.
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "wd" / "checkpoints" / "final").state_dict()
    early = AutoModelForCausalLM.from_pretrained(tmp_path / "wd" / "checkpoints" / "step-2").state_dict()
    assert final.keys() == early.keys()
    assert not torch.equal(
        final["model.layers.0.self_attn.q_proj.weight"], early["model.layers.0.self_attn.q_proj.weight"]
    )
