"""Coming from xtuner: the seed's config read without running it, every setting mapped or listed, and the
original job's exact shape run to the end at CPU scale."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tuneforge.errors import UserError
from tuneforge.xtuner.mapping import import_config

from conftest import REPO, TUNEFORGE, free_port

REPORT = REPO.parent / "shared" / "seed" / "xtuner_deepseek_v2_lite_qlora_zero3.py"
# The report's own config when ../shared is next to the checkout; else a config of the same job shape.
SEED = REPORT if REPORT.exists() else REPO / "tests" / "assets" / "xtuner_qlora_zero3.py"


def test_the_seed_config_maps_completely():
    result = import_config(SEED, "deepspeed_zero3_offload", 8)
    config = result.config
    assert config["model"]["path"] == "deepseek-ai/DeepSeek-V2-Lite-Chat" and config["model"]["trust_remote_code"]
    assert config["model"]["quantization"] == {
        "bits": 4,
        "quant_type": "nf4",
        "double_quant": True,
        "compute_dtype": "bfloat16",
    }
    # No target_modules: xtuner adapts every linear layer, routed experts included; PEFT takes no dropout there.
    assert config["model"]["lora"] == {"r": 64, "alpha": 16, "dropout": 0.0, "targets": "all-linear", "experts": True}
    assert any("lora_dropout 0.1 -> 0" in note for note in result.notes)
    assert config["train"]["gradient_checkpointing"] is True  # xtuner's default
    assert config["data"]["format"] == "openai" and config["data"]["template"] == "deepseek_coder"
    assert config["data"]["max_length"] == 2048 and config["data"]["packing"] is False
    train = config["train"]
    assert (train["micro_batch_size"], train["gradient_accumulation"], train["epochs"]) == (1, 16, 10)
    assert (train["lr"], train["betas"], train["weight_decay"], train["max_grad_norm"]) == (2e-4, [0.9, 0.999], 0, 1)
    assert train["warmup_ratio"] == pytest.approx(0.03) and train["schedule"] == "cosine"
    assert config["parallel"] == {"engine": "deepspeed", "zero_stage": 3, "cpu_offload": "all"}
    # Iterations become optimizer steps: 500 / 16 and 100 / 16.
    assert config["checkpoint"] == {"every_steps": 31, "keep_last": 2}
    assert config["eval"]["sample_every_steps"] == 6 and len(config["eval"]["sample_prompts"]) == 2
    assert config["log"] == {"every_steps": 1}
    assert any("500 iterations / accumulative_counts 16 = 31.25 optimizer steps -> 31" in n for n in result.notes)
    assert result.unmapped == []
    assert result.launch == "tuneforge train OUT.yaml --nproc-per-node 8"


def test_unmappable_settings_are_listed_with_their_lines(tmp_path):
    text = SEED.read_text().replace("dataset_map_fn=openai_map_fn", "dataset_map_fn=my_custom_map_fn")
    text = text.replace("import torch\n", "import torch\nfrom my_project.maps import my_custom_map_fn\n", 1)
    text = text.replace("use_varlen_attn = False\n", "use_varlen_attn = False\nsequence_parallel_size = 2\n", 1)
    text += "\ndef helper():\n    return 1\n"
    path = tmp_path / "cfg.py"
    path.write_text(text)
    result = import_config(path)
    reasons = {what: (line, why) for line, what, why in result.unmapped}
    line, why = reasons["dataset_map_fn = my_custom_map_fn"]
    assert "dataset_map_fn=my_custom_map_fn" in text.splitlines()[line - 1] and "convert the data" in why
    assert reasons["sequence_parallel_size = 2"][1] == "not supported"
    assert any("FunctionDef statements are not read" in why for _, why in reasons.values())


def test_the_original_report_text_gets_a_located_error(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("max_length = 2048\ndata_files = [数据地址\n")
    with pytest.raises(UserError, match=r"broken.py:2: not valid Python .*quoted path"):
        import_config(path)


# The original job's shape at CPU scale: the same architecture with tiny sizes (every quantized layer's output a
# multiple of 32 for bitsandbytes' CPU kernels), a larger init range so adapters move the loss within a few steps.
TINY_DEEPSEEK_V2 = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    kv_lora_rank=24,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    initializer_range=0.2,
)


@pytest.fixture(scope="module")
def original_job(tmp_path_factory) -> Path:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from tuneforge.data.byte_tokenizer import build_byte_tokenizer

    root = tmp_path_factory.mktemp("original")
    tokenizer = build_byte_tokenizer()
    config = DeepseekV2Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **TINY_DEEPSEEK_V2,
    )
    DeepseekV2ForCausalLM(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    records = []
    for i in range(48):
        colour = f"#{(i * 5) % 256:02x}{(i * 11) % 256:02x}{(i * 17) % 256:02x}"
        rgb = f"({(i * 5) % 256}, {(i * 11) % 256}, {(i * 17) % 256})"
        records.append(
            {
                "messages": [
                    {"role": "system", "content": "You convert colours."},
                    {"role": "user", "content": "Say hi."},
                    # Context only: as a JSON boolean in half the records and as a string in the others.
                    {"role": "assistant", "content": "hi", "loss": False if i % 2 else "false"},
                    {"role": "user", "content": f"Convert {colour} to RGB."},
                    {"role": "assistant", "content": rgb, "loss": True if i % 2 else "true"},
                ]
            }
        )
    (root / "train.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return root


@pytest.mark.parametrize(
    "variant,extra",
    [
        ("zero3_offload", []),
        ("zero3_offload_packed", ["data.packing=true"]),
        ("fsdp", ["parallel.engine=fsdp"]),
    ],
)
def test_the_original_job_runs_to_the_end_at_cpu_scale(original_job, variant, extra):
    work = original_job / variant
    command = [
        TUNEFORGE, "train", str(SEED), "--deepspeed", "deepspeed_zero3_offload",
        "--work-dir", str(work), "--nproc-per-node", "2", "--master-port", str(free_port()),
        f"model.path={original_job / 'model'}", f"data.train_files=[{original_job / 'train.jsonl'}]",
        "data.max_length=512", "train.max_steps=5", "train.lr=5e-3", "checkpoint.every_steps=1",
        "eval.sample_every_steps=2", "eval.sample_max_new_tokens=8", *extra,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "quantization: base weights 4-bit nf4, double quant" in out and "lora: r=64 alpha=16 dropout=0," in out
    assert "routed-expert weights left out" not in out  # adapters on the experts too, as xtuner put them
    assert "transformers implements deepseek_v2 natively" in out  # trust_remote_code asked, native used
    assert "deepseek_coder renders a conversation differently" not in out  # the byte tokenizer has no template
    assert "engine: " + ("fsdp" if variant == "fsdp" else "deepspeed") in out
    checkpoints = sorted(p.name for p in (work / "checkpoints").iterdir())
    assert checkpoints == ["final", "step-4", "step-5"]  # save_total_limit 2
    samples = [json.loads(line) for line in (work / "samples.jsonl").open()]
    assert {s["step"] for s in samples} == {2, 4, 5} and len(samples) == 6
    losses = [json.loads(line)["loss"] for line in (work / "metrics.jsonl").open()]
    assert len(losses) == 5 and losses[-1] < losses[0], losses
