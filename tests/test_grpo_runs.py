"""GRPO through the command users run: rollouts, rewards and updates in the one loop, their figures in
metrics.jsonl and samples.jsonl, python rewards only on the command line's word, and 2 ranks under ZeRO-3 with
offload and FSDP2 whose completions end at different lengths finishing together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ENGINES, launch, metrics, train_here

CONFIG = """\
model: {{architecture: llama, tokenizer: bytes, size: {{hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
  num_attention_heads: 4}}}}
data: {{train_files: [prompts.jsonl], template: {{instruction: "{{input}}\\n", sep: "\\n", stop_words: {stops}}},
  max_length: 48, cache_dir: null}}
train: {{objective: grpo, lr: 1.0e-3, micro_batch_size: 2, max_steps: 3, warmup_steps: 0, precision: fp32}}
rl: {{generations: 4, max_completion_tokens: {completion}, rewards: [{{kind: exact_match}}, {{kind: length,
  target_length: 6, weight: 0.5}}]}}
checkpoint: {{every_steps: 0}}
log: {{every_steps: 1, progress: lines}}
"""


def write_job(directory: Path, completion: int = 12) -> Path:
    records = [{"prompt": f"#{i:02x}{i:02x}00", "answer": f"({i}, {i}, 0)"} for i in range(16)]
    (directory / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    # Many one-byte stop words: the random model's completions end at scattered lengths.
    stops = json.dumps(list("0123456789abcdefghijklmnopqrstuvwxyz"))
    (directory / "cfg.yaml").write_text(CONFIG.format(completion=completion, stops=stops))
    return directory / "cfg.yaml"


@pytest.mark.slow
def test_a_grpo_run_reports_its_rollouts(tmp_path):
    result = train_here(write_job(tmp_path), tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert {"reward", "reward_std", "reward/exact_match", "reward/length", "frac_reward_zero_std"} <= record.keys()
        assert {
            "completion_length",
            "completion_length_max",
            "truncated",
            "clip_ratio",
            "kl",
            "entropy",
            "rollout_s",
        } <= record.keys()
        assert 0 < record["completion_length"] <= 12 and record["clip_ratio"] == 0  # one update per rollout
        assert 0 < record["entropy"] < 6  # nats, at most log(260) for the byte vocabulary
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").open()]
    assert {s["step"] for s in samples} == {1, 2, 3} and all("reward" in s and "reply" in s for s in samples)
    assert "reward" in result.stdout  # on the progress lines


@pytest.mark.slow
def test_a_python_reward_needs_the_command_lines_permission(tmp_path):
    config = write_job(tmp_path)
    config.write_text(config.read_text().replace("{kind: exact_match}", "{kind: python, function: 'json:dumps'}"))
    refused = train_here(config, tmp_path / "run")
    assert refused.returncode != 0 and "runs code; pass --allow-reward-code" in refused.stderr


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero3_offload", "fsdp"])
def test_two_ranks_whose_completions_end_apart_finish_together(tmp_path, engine):
    """Sampled completions end at different lengths on each rank; under sharded weights every generation step is
    a collective, so a rank that stopped early would leave the other waiting forever."""
    config = write_job(tmp_path, completion=16)
    result = launch(config, tmp_path / "two", "train.micro_batch_size=1", *ENGINES[engine], ranks=2, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert not (tmp_path / "two" / "diagnostics" / "report.txt").exists()
    records = metrics(tmp_path / "two")
    assert len(records) == 3 and all(r["completion_length_max"] > r["completion_length"] for r in records)


REPORT_SET_UP = (
    "model={architecture: deepseek_v2, tokenizer: bytes, size: {hidden_size: 32, intermediate_size: 64, "
    "moe_intermediate_size: 32, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 4, "
    "n_routed_experts: 4, num_experts_per_tok: 2, n_shared_experts: 1, first_k_dense_replace: 1, kv_lora_rank: 16, "
    "q_lora_rank: null, qk_rope_head_dim: 8, qk_nope_head_dim: 8, v_head_dim: 8}, "
    "lora: {r: 4, alpha: 8, dropout: 0.0, experts: true}, "
    # bitsandbytes' CPU kernels take output sizes in multiples of 32: MLA's 24-wide projection stays unquantized.
    "quantization: {bits: 4, compute_dtype: float32, skip_modules: [kv_a_proj_with_mqa]}}"
)
"""The seed report's set-up in small: DeepSeek-V2 (MLA, shared and routed experts), its linear layers and stacked
experts in 4 bits, LoRA on the experts too."""


@pytest.mark.slow
def test_two_ranks_equal_one_process_in_the_reports_set_up(tmp_path):
    """QLoRA with adapters on the experts under ZeRO-3 with offload on 2 ranks, each sampling its own prompt,
    against one process sampling both: the same completions (keyed draws), so the same rewards; the same loss
    over the global step's completion tokens, the same KL to the adapters-off reference and the same adapters
    after two updates per rollout."""
    config = write_job(tmp_path, completion=16)
    common = (REPORT_SET_UP, "data.group_by_length=false", "rl.updates_per_rollout=2", "rl.kl_coef=0.1")
    common += ("train.lr=1.0e-2", "checkpoint.save_final=true")
    one = train_here(config, tmp_path / "one", *common)
    assert one.returncode == 0, one.stderr[-3000:]
    two = launch(config, tmp_path / "two", *common, "train.micro_batch_size=1", *ENGINES["zero3_offload"], ranks=2)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    one_records, two_records = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    for key in ("reward", "reward/exact_match", "reward/length", "completion_length", "completion_length_max"):
        assert [r[key] for r in two_records] == pytest.approx([r[key] for r in one_records], abs=1e-9), key
    for key in ("loss", "kl"):
        assert [r[key] for r in two_records] == pytest.approx([r[key] for r in one_records], abs=1e-5), key
    assert one_records[-1]["kl"] > 0  # the adapters moved away from the reference
    one_weights = load_file(tmp_path / "one" / "checkpoints" / "final" / "adapter_model.safetensors")
    two_weights = load_file(tmp_path / "two" / "checkpoints" / "final" / "adapter_model.safetensors")
    assert one_weights.keys() == two_weights.keys() and any("experts" in name for name in one_weights)
    for name, tensor in one_weights.items():
        torch.testing.assert_close(two_weights[name], tensor, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("updates", [1, 2])
def test_killed_then_resumed_equals_uninterrupted_rollouts_included(tmp_path, updates):
    """Each completion's draws are keyed by the seed, the step and the prompt: a resumed run samples the
    completions the uninterrupted one did, so its rewards and losses are the same (a step holds all the updates
    of its rollout, so a checkpoint never falls between them)."""
    whole, resumed = killed_and_resumed(tmp_path, f"rl.updates_per_rollout={updates}")
    keys = ("loss", "reward", "completion_length")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in whole]


def killed_and_resumed(tmp_path: Path, *extra: str) -> tuple[list[dict], list[dict]]:
    """`write_job` for 4 steps uninterrupted, and again killed in step 3 and resumed from step 2's checkpoint:
    the metrics of each."""
    config = write_job(tmp_path)
    extra = ("train.max_steps=4", "checkpoint.every_steps=2", *extra)
    whole = launch(config, tmp_path / "whole", *extra)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = launch(config, tmp_path / "run", *extra, fault="kill:0:3")
    assert killed.returncode != 0
    resumed = launch(config, tmp_path / "run", *extra, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return metrics(tmp_path / "whole"), metrics(tmp_path / "run")


@pytest.mark.slow
def test_the_kl_to_the_adapters_off_reference_starts_at_zero(tmp_path):
    config = write_job(tmp_path)
    lora = "model.lora={r: 4, alpha: 8, dropout: 0.0}"
    result = train_here(config, tmp_path / "run", lora, "rl.kl_coef=0.1", "train.lr=1.0e-2")
    assert result.returncode == 0, result.stderr[-3000:]
    kl = [record["kl"] for record in metrics(tmp_path / "run")]
    assert kl[0] == 0 and kl[-1] > 0  # the adapters start at zero (policy = reference), then move away


@pytest.mark.slow
def test_later_updates_of_a_rollout_are_clipped_against_the_sampling_policy(tmp_path):
    """Three updates per rollout at a large learning rate: the first of each step is at ratio one, the later ones
    move the policy away from the one that sampled, so some tokens' ratios leave the clip range; the updates are
    real optimizer steps (the weights end elsewhere than after one update per rollout)."""
    config = write_job(tmp_path)
    runs = {}
    for updates in (1, 3):
        work = tmp_path / f"updates{updates}"
        result = train_here(config, work, "train.lr=0.05", f"rl.updates_per_rollout={updates}", "rl.epsilon_high=0.2")
        assert result.returncode == 0, result.stderr[-3000:]
        runs[updates] = metrics(work)
    assert all(r["clip_ratio"] == 0 for r in runs[1])
    assert any(r["clip_ratio"] > 0 for r in runs[3]), [r["clip_ratio"] for r in runs[3]]
    # Step 1's rollout is the same in both (same weights, same generators); from step 2 the policies differ.
    assert runs[1][0]["reward"] == runs[3][0]["reward"] and runs[1][0]["loss"] != runs[3][0]["loss"]


REWARD_MODEL_JOB = """\
model: {architecture: llama, tokenizer: bytes, size: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
  num_attention_heads: 4}}
data: {train_files: [pairs.jsonl], template: {instruction: "{input}\\n", sep: "\\n"}, max_length: 48, cache_dir: null}
train: {objective: reward, lr: 1.0e-2, micro_batch_size: 4, max_steps: 6, precision: fp32}
checkpoint: {every_steps: 0}
log: {progress: lines, plot: false}
"""


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_a_reward_model_scores_each_completion_as_transformers_scores_its_conversation(tmp_path, lora):
    """A reward model trained by tuneforge (a full checkpoint, or LoRA adapters on its base) as GRPO's reward:
    each completion's reward is the score transformers' own sequence classifier (PEFT's for the adapters) gives
    the prompt's conversation with the completion as its reply, rendered with the reward model's template."""
    from peft import AutoPeftModelForSequenceClassification
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tuneforge.checkpoint_records import CHAT_META, read_chat_meta
    from tuneforge.data.conversation import Conversation, Turn
    from tuneforge.data.templates import recorded_template

    pairs = [{"prompt": f"#{i:02x}{i:02x}00", "chosen": f"({i}, {i}, 0)", "rejected": "no idea"} for i in range(16)]
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in pairs) + "\n")
    (tmp_path / "reward.yaml").write_text(REWARD_MODEL_JOB)
    lora_setting = ["model.lora={r: 4, alpha: 8, dropout: 0.0}"] if lora else []
    trained = train_here(tmp_path / "reward.yaml", tmp_path / "reward", *lora_setting)
    assert trained.returncode == 0, trained.stderr[-3000:]
    reward_model = tmp_path / "reward" / "checkpoints" / "final"

    config = write_job(tmp_path)
    config.write_text(
        config.read_text().replace(
            "rewards: [{kind: exact_match}, {kind: length,\n  target_length: 6, weight: 0.5}]",
            "rewards: [{kind: model, path: reward/checkpoints/final, batch_size: 3}]",
        )
    )
    result = train_here(config, tmp_path / "run", "train.max_steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").open()]
    assert len(samples) == 8 and {"reward", "reward/model"} <= metrics(tmp_path / "run")[0].keys()

    loader = AutoPeftModelForSequenceClassification if lora else AutoModelForSequenceClassification
    scorer = loader.from_pretrained(reward_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(reward_model)
    template = recorded_template(read_chat_meta(reward_model)["template"], reward_model / CHAT_META)
    for sample in samples:
        prompt = next(p["prompt"] for p in pairs if p["prompt"] in sample["prompt"])
        conversation = Conversation((Turn(prompt, sample["reply"]),), "sample")
        ids = template.encode([conversation], tokenizer, None)[0].input_ids
        with torch.no_grad():
            expected = float(scorer(input_ids=torch.tensor([ids])).logits[0, 0])
        assert sample["reward"] == pytest.approx(expected, abs=1e-5)
    assert len({round(s["reward"], 6) for s in samples}) > 2  # completions scored apart, not one constant
