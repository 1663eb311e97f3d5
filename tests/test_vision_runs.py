"""Vision-language runs through the commands users run: 2 ranks fed different data (one with text alone in a
micro-batch while the other has images) train to the losses of one process under ZeRO-3 with offload and FSDP2,
never hanging; xtuner's two stages (a LLaVA built from a language model and a CLIP tower, then LoRA on it) end in
an export that `transformers` loads with its own classes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from PIL import Image
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

from tuneforge.config.load import load_config
from tuneforge.data.batching import BatchPlanner
from tuneforge.data.byte_tokenizer import build_byte_tokenizer
from tuneforge.data.image_tokens import ImageTokens
from tuneforge.data.pipeline import prepare_data
from tuneforge.data.vision_templates import ProcessorTemplate
from vlm_models import tiny_llava

from conftest import ENGINES, TUNEFORGE, launch, metrics, train_here, tuneforge_here

COLOURS = {"red": (230, 20, 20), "green": (20, 200, 40), "blue": (30, 40, 230), "yellow": (240, 220, 10)}
CONFIG = """\
model: {{path: {model}}}
data: {{train_files: [train.jsonl], cache_dir: null, group_by_length: false, max_length: 96, validation_fraction: 0.2}}
train: {{lr: 1.0e-3, warmup_steps: 1, precision: fp32, max_steps: 4, max_grad_norm: 1.0}}
eval: {{every_steps: 2, sample_prompts: ["say 3"], sample_every_steps: 2, sample_max_new_tokens: 4}}
checkpoint: {{every_steps: 0}}
log: {{progress: lines}}
"""
"""Validation (whose rows differ per rank too) and sample chats run at steps 2 and 4."""


def write_data(directory: Path) -> Path:
    """Image questions and text-only chats, shuffled together."""
    records = []
    for index in range(16):
        name, colour = list(COLOURS.items())[index % len(COLOURS)]
        Image.new("RGB", (24 + index, 30), colour).save(directory / f"{index}.png")
        question = [{"type": "image", "image": f"{index}.png"}, {"type": "text", "text": "Colour?"}]
        records.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": name}]})
        records.append(
            {"messages": [{"role": "user", "content": f"say {index}"}, {"role": "assistant", "content": f"{index}"}]}
        )
    (directory / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return directory / "train.jsonl"


QLORA = (
    "model.lora={r: 4, alpha: 8, dropout: 0.0}",
    "model.quantization={bits: 4, compute_dtype: float32, skip_modules: [k_proj, v_proj]}",
)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """`job(*overrides)` -> (config, work dir of its run in one process with the global batch of 2 ranks'
    micro-batches of 1); each set of overrides is trained once."""
    directory = tmp_path_factory.mktemp("vlm-job")
    model = tiny_llava(directory / "model")
    write_data(directory)
    config = directory / "cfg.yaml"
    config.write_text(CONFIG.format(model=model))
    runs: dict[tuple[str, ...], Path] = {}

    def run(*overrides: str) -> tuple[Path, Path]:
        if overrides not in runs:
            work_dir = directory / f"one-{len(runs)}"
            result = train_here(config, work_dir, "train.micro_batch_size=2", *overrides)
            assert result.returncode == 0, result.stderr[-3000:]
            runs[overrides] = work_dir
        return config, runs[overrides]

    return run


def rank_shares_differ_in_kind(config: Path) -> bool:
    """Whether some step gives one rank only text while the other has an image: the case that hangs a sharded
    engine whose text-only rank skips the tower."""
    cfg = load_config(config)
    processor = AutoProcessor.from_pretrained(cfg.model.path)
    data = prepare_data(
        cfg.data, processor.tokenizer, ProcessorTemplate(processor), images=ImageTokens(processor, {}, 10**8)
    ).train.data
    ranks = [BatchPlanner(data, 1, 0, cfg.train.seed, "random", 96, rank, 2).plan(0) for rank in (0, 1)]
    for step in range(cfg.train.max_steps):
        kinds = [bool(data.images_of(plan[step][0][0])) for plan in ranks]
        if kinds[0] != kinds[1]:
            return True
    return False


@pytest.mark.slow
@pytest.mark.parametrize(
    ("engine", "overrides"),
    [("zero3_offload", ()), ("fsdp", ()), ("ddp", ()), ("zero3_offload", QLORA)],
    ids=["zero3", "fsdp", "ddp", "zero3-qlora"],
)
def test_two_ranks_with_text_alone_on_one_equal_one_process(tmp_path, job, engine, overrides):
    """Without the filler image, ZeRO-3's ranks part at the first such step: one gathers the projector, the other
    the language model's first layer (the diagnosis names both)."""
    config, one = job(*overrides)
    assert rank_shares_differ_in_kind(config)
    extra = ["train.micro_batch_size=1", *overrides, *ENGINES[engine]]
    result = launch(config, tmp_path / "two", *extra, ranks=2, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert not (tmp_path / "two" / "diagnostics" / "report.txt").exists()
    two, whole = metrics(tmp_path / "two"), metrics(one)
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in whole], abs=1e-5)
    validated = [r["val_loss"] for r in two if "val_loss" in r]
    assert len(validated) == 2 and validated == pytest.approx(
        [r["val_loss"] for r in whole if "val_loss" in r], abs=1e-5
    )


STAGE_ONE = """\
model:
  path: {language}
  vision: {{tower_path: {tower}, language: frozen}}
data: {{train_files: [train.jsonl], template: deepseek_coder, cache_dir: null, max_length: 96, packing: true}}
train: {{lr: 1.0e-2, warmup_steps: 0, precision: fp32, max_steps: 3}}
checkpoint: {{every_steps: 0}}
log: {{progress: lines}}
"""

STAGE_TWO = """\
model:
  path: {stage_one}
  lora: {{r: 4, alpha: 8, dropout: 0.0}}
  vision: {{tower: lora, tower_lora: {{r: 2, alpha: 4, dropout: 0.0}}, projector_lr: 2.0e-3}}
data: {{train_files: [train.jsonl], template: deepseek_coder, cache_dir: null, max_length: 96}}
train: {{lr: 1.0e-2, warmup_steps: 0, precision: fp32, max_steps: 3}}
checkpoint: {{every_steps: 0}}
log: {{progress: lines}}
"""


def language_and_tower(directory: Path) -> tuple[Path, Path]:
    """A tiny Llama with the byte tokenizer, and a tiny CLIP vision model with its image processor."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, LlamaConfig, LlamaForCausalLM

    tokenizer = build_byte_tokenizer()
    torch.manual_seed(0)
    text = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=len(tokenizer)
    )
    LlamaForCausalLM(text).save_pretrained(directory / "llama")
    tokenizer.save_pretrained(directory / "llama")
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28, patch_size=14
    )
    CLIPVisionModel(vision).save_pretrained(directory / "clip")
    CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(
        directory / "clip"
    )
    return directory / "llama", directory / "clip"


@pytest.mark.slow
def test_two_stages_end_in_a_model_transformers_loads(tmp_path):
    """Stage 1 trains a new projector between a language model and a CLIP tower (all else frozen); stage 2 starts
    from its checkpoint with LoRA on both; the merged export loads with `AutoModelForImageTextToText` and
    `AutoProcessor` and gives the trained model's logits on an image prompt."""
    language, tower = language_and_tower(tmp_path)
    write_data(tmp_path)
    (tmp_path / "one.yaml").write_text(STAGE_ONE.format(language=language, tower=tower))
    first = train_here(tmp_path / "one.yaml", tmp_path / "s1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "vision: tower frozen, projector full, language model frozen" in first.stdout
    stage_one = tmp_path / "s1" / "checkpoints" / "final"
    composed = AutoModelForImageTextToText.from_pretrained(stage_one)
    assert type(composed).__name__ == "LlavaForConditionalGeneration"
    # Only the projector trained: the language model's weights are the Llama's own.
    llama = AutoModelForCausalLM.from_pretrained(language)
    for name, param in llama.model.named_parameters():
        if name != "embed_tokens.weight":  # grown by the image token's row
            torch.testing.assert_close(composed.model.language_model.get_parameter(name), param, msg=name)

    (tmp_path / "two.yaml").write_text(STAGE_TWO.format(stage_one=stage_one))
    second = train_here(tmp_path / "two.yaml", tmp_path / "s2")
    assert second.returncode == 0, second.stderr[-3000:]
    export = subprocess.run(
        [
            TUNEFORGE,
            "export",
            str(tmp_path / "s2" / "checkpoints" / "final"),
            "--out",
            str(tmp_path / "out"),
            "--merge",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert export.returncode == 0, export.stderr[-3000:]
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "out")
    processor = AutoProcessor.from_pretrained(tmp_path / "out")
    prompt = "<s>### Instruction:\n<image>Colour?\n### Response:\n"
    inputs = processor(text=[prompt], images=[Image.open(tmp_path / "0.png")], return_tensors="pt")
    trained = PeftModel.from_pretrained(
        AutoModelForImageTextToText.from_pretrained(stage_one), tmp_path / "s2" / "checkpoints" / "final"
    )
    with torch.no_grad():
        expected = trained(**inputs).logits
        torch.testing.assert_close(merged(**inputs).logits, expected, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(composed(**inputs).logits, expected, atol=1e-3)  # stage 2 changed the model
    # The adapter form loads in PEFT; it trains the tower too, which vLLM would not load: export says so.
    adapter = subprocess.run(
        [TUNEFORGE, "export", str(tmp_path / "s2" / "checkpoints" / "final"), "--out", str(tmp_path / "adapter")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert adapter.returncode == 0, adapter.stderr[-3000:]
    assert "also changes the model's tower and projector; vLLM loads LoRA adapters on the language model" in (
        adapter.stdout
    )
    reloaded = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(stage_one), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, expected)
    # Written for a server, it is refused with the merged form offered: no server loads it whole.
    final = tmp_path / "s2" / "checkpoints" / "final"
    served = tuneforge_here("export", str(final), "--out", str(tmp_path / "vllm"), "--for", "vllm")
    assert served.returncode == 2 and not (tmp_path / "vllm").exists()
    assert "vllm loads adapters on the language model only, not on the tower and projector; use export --merge" in (
        served.stderr
    )
    # Chat reads the image and answers what greedy generation on the same prompt gives.
    chat = tuneforge_here(
        "chat", str(final), "--image", str(tmp_path / "0.png"), "--prompt", "Colour?", "--max-new-tokens", "5"
    )
    assert chat.returncode == 0, chat.stderr
    with torch.no_grad():
        greedy = merged.generate(**inputs, max_new_tokens=5, do_sample=False, eos_token_id=2, pad_token_id=0)
    expected_reply = processor.tokenizer.decode(greedy[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert chat.stdout.strip() == expected_reply.strip()
    missing = tuneforge_here("chat", str(final), "--image", str(tmp_path / "none.png"))
    assert missing.returncode != 0 and "--image: missing image" in missing.stderr


@pytest.mark.slow
def test_killed_then_resumed_equals_uninterrupted(tmp_path, job):
    """The data position of a vision-language run (images included) resumes exactly: the same losses as a run
    never stopped."""
    config, whole = job("checkpoint.every_steps=2")
    extra = ("train.micro_batch_size=2", "checkpoint.every_steps=2")
    killed = launch(config, tmp_path / "run", *extra, fault="kill:0:4")
    assert killed.returncode != 0
    resumed = launch(config, tmp_path / "run", *extra, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert [r["loss"] for r in metrics(tmp_path / "run")] == [r["loss"] for r in metrics(whole)]
