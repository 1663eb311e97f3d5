"""Coming from xtuner's vision-language configs: LLaVAModel (stage 1 projector pretraining, stage 2 fine-tuning in
full, with LoRA or QLoRA) and InternVL_V1_5 map onto `model.vision`, their datasets onto the image data settings,
and every YAML validates; what cannot be carried over is named with its line.

The configs are written here in the layout of xtuner 0.1.23's gallery (configs/llava, configs/internvl), with the
fields those use; nothing of xtuner is needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuneforge.config.load import load_config
from tuneforge.errors import UserError
from tuneforge.xtuner.evaluate import read_config
from tuneforge.xtuner.mapper_base import Imported
from tuneforge.xtuner.mapping import import_config, to_yaml

LLAVA_HEAD = """\
import torch
from mmengine.hooks import CheckpointHook, LoggerHook
from mmengine.optim import AmpOptimWrapper, CosineAnnealingLR, LinearLR
from peft import LoraConfig
from torch.optim import AdamW
from transformers import (AutoModel, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig,
                          CLIPImageProcessor, CLIPVisionModel)
from xtuner.dataset import ConcatDataset, LLaVADataset
from xtuner.dataset.collate_fns import default_collate_fn
from xtuner.dataset.map_fns import llava_map_fn, template_map_fn_factory
from xtuner.dataset.samplers import LengthGroupedSampler
from xtuner.engine.hooks import DatasetInfoHook, EvaluateChatHook
from xtuner.engine.runner import TrainLoop
from xtuner.model import LLaVAModel
from xtuner.utils import PROMPT_TEMPLATE

llm_name_or_path = 'meta-llama/Meta-Llama-3-8B-Instruct'
visual_encoder_name_or_path = 'openai/clip-vit-large-patch14-336'
pretrained_pth = './work_dirs/stage1/iter_2181.pth'

data_root = './data/llava_data/'
data_path = data_root + 'LLaVA-Instruct-150K/llava_v1_5_mix665k.json'
image_folder = data_root + 'llava_images'
prompt_template = PROMPT_TEMPLATE.llama3_chat
max_length = int(2048 - (336 / 14)**2)

batch_size = 16
accumulative_counts = 2
max_epochs = 1
warmup_ratio = 0.03

tokenizer = dict(
    type=AutoTokenizer.from_pretrained,
    pretrained_model_name_or_path=llm_name_or_path,
    trust_remote_code=True,
    padding_side='right')

image_processor = dict(
    type=CLIPImageProcessor.from_pretrained,
    pretrained_model_name_or_path=visual_encoder_name_or_path,
    trust_remote_code=True)

"""
"""Settings, tokenizer and image processor of a LLaVA config; the model follows."""

LLAVA_TAIL = """
llava_dataset = dict(
    type=LLaVADataset,
    data_path=data_path,
    image_folder=image_folder,
    tokenizer=tokenizer,
    image_processor=image_processor,
    dataset_map_fn=llava_map_fn,
    template_map_fn=dict(type=template_map_fn_factory, template=prompt_template),
    max_length=max_length,
    pad_image_to_square=PAD)

train_dataloader = dict(
    batch_size=batch_size,
    num_workers=4,
    pin_memory=True,
    dataset=llava_dataset,
    sampler=dict(
        type=LengthGroupedSampler,
        length_property='modality_length',
        per_device_batch_size=batch_size * accumulative_counts),
    collate_fn=dict(type=default_collate_fn))

optim_wrapper = dict(
    type=AmpOptimWrapper,
    optimizer=dict(type=AdamW, lr=2e-5, betas=(0.9, 0.999), weight_decay=0),
    clip_grad=dict(max_norm=1, error_if_nonfinite=False),
    accumulative_counts=accumulative_counts,
    loss_scale='dynamic',
    dtype='float16')

param_scheduler = [
    dict(type=LinearLR, start_factor=1e-5, by_epoch=True, begin=0, end=warmup_ratio * max_epochs,
         convert_to_iter_based=True),
    dict(type=CosineAnnealingLR, eta_min=0.0, by_epoch=True, begin=warmup_ratio * max_epochs, end=max_epochs,
         convert_to_iter_based=True)
]
train_cfg = dict(type=TrainLoop, max_epochs=max_epochs)

custom_hooks = [
    dict(type=DatasetInfoHook, tokenizer=tokenizer),
    dict(
        type=EvaluateChatHook,
        tokenizer=tokenizer,
        image_processor=image_processor,
        every_n_iters=500,
        evaluation_inputs=['Please describe this picture'],
        evaluation_images='https://example.com/view.jpg',
        system='',
        prompt_template=prompt_template)
]
default_hooks = dict(
    logger=dict(type=LoggerHook, log_metric_by_epoch=False, interval=10),
    checkpoint=dict(type=CheckpointHook, by_epoch=False, interval=500, max_keep_ckpts=2))
randomness = dict(seed=None, deterministic=False)
"""
"""The dataset, optimizer, schedule and hooks of a LLaVA config (PAD: its pad_image_to_square)."""

LLM = """\
    llm=dict(
        type=AutoModelForCausalLM.from_pretrained,
        pretrained_model_name_or_path=llm_name_or_path,
        trust_remote_code=True),
"""
QUANTIZED_LLM = """\
    llm=dict(
        type=AutoModelForCausalLM.from_pretrained,
        pretrained_model_name_or_path=llm_name_or_path,
        trust_remote_code=True,
        torch_dtype=torch.float16,
        quantization_config=dict(
            type=BitsAndBytesConfig,
            load_in_4bit=True,
            load_in_8bit=False,
            llm_int8_threshold=6.0,
            llm_int8_has_fp16_weight=False,
            bnb_4bit_compute_dtype=torch.float16,
            bnb_4bit_use_double_quant=True,
            bnb_4bit_quant_type='nf4')),
"""
TOWER = """\
    visual_encoder=dict(
        type=CLIPVisionModel.from_pretrained,
        pretrained_model_name_or_path=visual_encoder_name_or_path))
"""
STAGE_1 = "model = dict(\n    type=LLaVAModel,\n    freeze_llm=True,\n    freeze_visual_encoder=True,\n" + QUANTIZED_LLM
"""Projector pretraining as the gallery writes it: both parts frozen, the frozen language model in 4 bits."""
FULL_STAGE_2 = (
    "model = dict(\n    type=LLaVAModel,\n    freeze_llm=False,\n    freeze_visual_encoder=True,\n"
    "    pretrained_pth=pretrained_pth,\n" + LLM
)
"""Stage 2 in full: the language model trains, the tower is frozen, the projector starts from stage 1."""
QLORA_STAGE_2 = (
    "model = dict(\n    type=LLaVAModel,\n    freeze_llm=True,\n    freeze_visual_encoder=True,\n"
    "    pretrained_pth=pretrained_pth,\n" + QUANTIZED_LLM + "    llm_lora=dict(type=LoraConfig, r=512, "
    "lora_alpha=256, lora_dropout=0.05, bias='none', task_type='CAUSAL_LM'),\n"
    "    visual_encoder_lora=dict(type=LoraConfig, r=64, lora_alpha=16, lora_dropout=0.05, bias='none'),\n"
)
"""Stage 2 with QLoRA on the language model and LoRA on the tower, both `freeze_*` True as in the gallery."""


def llava(tmp_path: Path, model: str, pad: bool = False, tower: str = TOWER, tail: str = LLAVA_TAIL) -> Path:
    path = tmp_path / "cfg.py"
    path.write_text(LLAVA_HEAD + model + tower + tail.replace("PAD", str(pad)), encoding="utf-8")
    return path


def line_of(path: Path, text: str) -> int:
    """The 1-based line of the first line of `path` that holds `text`."""
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def validated(result: Imported, tmp_path: Path):
    """The YAML the import writes, loaded as tuneforge loads a config."""
    out = tmp_path / "out.yaml"
    out.write_text(to_yaml(result, tmp_path / "cfg.py"), encoding="utf-8")
    return load_config(out)


def unmapped(result: Imported) -> dict[str, tuple[int, str]]:
    return {what: (line, why) for line, what, why in result.unmapped}


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # xtuner's relative paths resolve from where it was started


def test_gallery_arithmetic_is_read_without_running_it(tmp_path):
    """`int(2048 - (336 / 14)**2)`, the gallery's LLaVA max_length, is read; a huge power is refused unbuilt."""
    path = tmp_path / "values.py"
    path.write_text("a = int(2048 - (336 / 14)**2)\nb = float(3)\nc = 7 ** 100000\nint = 5\nd = int(2)\n")
    module = read_config(path)
    assert (module.values["a"], module.values["b"]) == (1472, 3.0)
    assert "c" not in module.values and "d" not in module.values  # `int` redefined by the config: not the built-in
    assert any("a number of more than 4096 bits" in why for _, why in module.skipped)


def test_llava_stage_1_trains_the_projector_of_a_llava_assembled_from_its_parts(tmp_path):
    path = llava(tmp_path, STAGE_1)
    result = import_config(path)
    model, data = result.config["model"], result.config["data"]
    assert model["path"] == "meta-llama/Meta-Llama-3-8B-Instruct" and model["dtype"] == "bfloat16"
    assert model["vision"] == {
        "tower_path": "openai/clip-vit-large-patch14-336",
        "tower": "frozen",
        "projector": "full",
        "language": "frozen",
    }
    # xtuner loads the frozen language model in 4 bits; tuneforge quantizes only one trained through adapters.
    assert "quantization" not in model and "lora" not in model
    line, why = unmapped(result)["model.llm.quantization_config"]
    assert line == line_of(path, "quantization_config=dict(") and "16-bit" in why
    assert not any("bnb_4bit_compute_dtype" in note for note in result.notes)  # nothing said of what is not kept
    # LLaVA's json records; images under the folder, resolved from where xtuner starts.
    assert data["format"] == "sharegpt" and data["template"] == "llama3_chat"
    assert data["train_files"] == [str(tmp_path / "data/llava_data/LLaVA-Instruct-150K/llava_v1_5_mix665k.json")]
    assert data["image_root"] == str(tmp_path / "data/llava_data/llava_images")
    # xtuner counts an image as one token of max_length; tuneforge counts its 576.
    assert data["max_length"] == 1472 + 575
    assert any("max_length 1472 (line" in note and "576 tokens" in note for note in result.notes)
    assert any(note.startswith("LLaVAModel (stage 1, projector pretraining)") for note in result.notes)
    # The sample chats are about a downloaded image: not carried over, said at their line.
    images = "EvaluateChatHook.evaluation_images = 'https://example.com/view.jpg'"
    line, why = unmapped(result)[images]
    assert line == line_of(path, "evaluation_images=") and "sample_prompts" not in result.config.get("eval", {})
    assert set(unmapped(result)) == {"model.llm.quantization_config", images}  # pad_image_to_square=False: as is
    config = validated(result, tmp_path)
    assert config.model.vision.language == "frozen" and config.model.vision.tower_path == model["vision"]["tower_path"]
    assert (config.train.micro_batch_size, config.train.gradient_accumulation) == (16, 2)


def test_llava_stage_2_in_full_starts_from_the_stage_1_projector(tmp_path):
    path = llava(tmp_path, FULL_STAGE_2, pad=True)
    result = import_config(path)
    vision = result.config["model"]["vision"]
    assert {key: vision[key] for key in ("tower", "projector", "language")} == {
        "tower": "frozen",
        "projector": "full",
        "language": "train",
    }
    assert "lora" not in result.config["model"] and "quantization" not in result.config["model"]
    # The path as xtuner reads it, said to be the projector's weights file (xtuner may have written a directory).
    assert vision["projector_weights"] == str(tmp_path / "work_dirs/stage1/iter_2181.pth")
    (note,) = [note for note in result.notes if note.startswith("model.pretrained_pth")]
    assert "must be the stage-1 projector's weights file" in note and "DeepSpeed checkpoint directory" in note
    # pad_image_to_square has no tuneforge setting: listed at its line, not refused.
    line, why = unmapped(result)["pad_image_to_square = True"]
    assert line == line_of(path, "pad_image_to_square=") and "pad the images to squares" in why
    assert validated(result, tmp_path).model.vision.projector_weights == vision["projector_weights"]


def test_llava_qlora_with_a_lora_tower(tmp_path):
    result = import_config(llava(tmp_path, QLORA_STAGE_2, pad=True))
    model = result.config["model"]
    assert model["quantization"] == {"bits": 4, "quant_type": "nf4", "double_quant": True, "compute_dtype": "bfloat16"}
    # freeze_llm=True with llm_lora: the adapters train (xtuner freezes the base only).
    assert model["lora"] == {"r": 512, "alpha": 256, "dropout": 0.05, "targets": "all-linear", "experts": True}
    assert model["vision"]["tower"] == "lora" and model["vision"]["language"] == "train"
    assert model["vision"]["tower_lora"] == {"r": 64, "alpha": 16, "dropout": 0.05, "targets": "all-linear"}
    assert any("through LoRA (model.vision.tower_lora)" in note for note in result.notes)
    assert "model.llm.quantization_config" not in unmapped(result)
    config = validated(result, tmp_path)
    assert config.model.vision.tower_lora.r == 64 and config.model.quantization.bits == 4


def test_llava_lora_llm_and_a_tower_trained_in_full(tmp_path):
    model = FULL_STAGE_2.replace("freeze_visual_encoder=True", "freeze_visual_encoder=False") + (
        "    llm_lora=dict(type=LoraConfig, r=128, lora_alpha=256, lora_dropout=0.05, bias='none',\n"
        "                  target_modules=['q_proj', 'v_proj']),\n"
    )
    result = import_config(llava(tmp_path, model))
    vision = result.config["model"]["vision"]
    assert (vision["tower"], vision["language"]) == ("full", "train") and "tower_lora" not in vision
    assert result.config["model"]["lora"]["targets"] == ["q_proj", "v_proj"]
    assert validated(result, tmp_path).model.lora.r == 128


def test_llava_datasets_with_their_own_image_folders_are_named(tmp_path):
    """tuneforge has one data.image_root: a second dataset's own folder is listed at its line."""
    tail = LLAVA_TAIL.replace(
        "train_dataloader = dict(",
        "caption_dataset = dict(\n    type=LLaVADataset,\n    data_path=data_root + 'captions.jsonl',\n"
        "    image_folder=data_root + 'caption_images',\n    tokenizer=tokenizer,\n"
        "    image_processor=image_processor,\n    dataset_map_fn=llava_map_fn,\n"
        "    template_map_fn=dict(type=template_map_fn_factory, template=prompt_template),\n"
        "    max_length=max_length,\n    pad_image_to_square=PAD)\n\n"
        "train_dataset = dict(type=ConcatDataset, datasets=[llava_dataset, caption_dataset])\n\n"
        "train_dataloader = dict(",
    ).replace("    dataset=llava_dataset,", "    dataset=train_dataset,")
    path = llava(tmp_path, FULL_STAGE_2, pad=True, tail=tail)
    result = import_config(path)
    data = result.config["data"]
    assert len(data["train_files"]) == 2 and data["image_root"] == str(tmp_path / "data/llava_data/llava_images")
    line, why = unmapped(result)["image_folder = './data/llava_data/caption_images'"]
    assert line == line_of(path, "'caption_images'") and "one data.image_root" in why
    assert sum(what == "pad_image_to_square = True" for _, what, _ in result.unmapped) == 1  # said once
    validated(result, tmp_path)


@pytest.mark.parametrize(
    ("old", "new", "says"),
    [
        ("    pretrained_pth=pretrained_pth,", "    projector_depth=3,", "two linear layers with a GELU"),
        ("type=CLIPVisionModel.from_pretrained", "type=AutoModel.from_pretrained", "CLIPVisionModel or Siglip"),
        ("name_or_path=visual_encoder_name_or_path))", "name_or_path=1))", "set model.vision.tower_path"),
    ],
)
def test_llava_models_tuneforge_cannot_build_are_refused_at_their_line(tmp_path, old, new, says):
    path = llava(tmp_path, FULL_STAGE_2)
    path.write_text(path.read_text().replace(old, new, 1))
    with pytest.raises(UserError) as info:
        import_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line_of(path, new.strip())}: ") and "cannot be carried over" in message
    assert says in message


INTERNVL_CONFIG = """\
from mmengine.hooks import CheckpointHook, LoggerHook
from mmengine.optim import AmpOptimWrapper, CosineAnnealingLR, LinearLR
from peft import LoraConfig
from torch.optim import AdamW
from transformers import AutoTokenizer
from xtuner.dataset import InternVL_V1_5_Dataset
from xtuner.dataset.collate_fns import default_collate_fn
from xtuner.dataset.samplers import LengthGroupedSampler
from xtuner.engine.hooks import DatasetInfoHook
from xtuner.engine.runner import TrainLoop
from xtuner.model import InternVL_V1_5
from xtuner.utils import PROMPT_TEMPLATE

path = 'OpenGVLab/InternVL2-2B'
data_root = './data/llava_data/'
data_path = data_root + 'LLaVA-Instruct-150K/llava_v1_5_mix665k.json'
image_folder = data_root + 'llava_images'
prompt_template = PROMPT_TEMPLATE.internlm2_chat
max_length = 8192
batch_size = 4
accumulative_counts = 4
max_epochs = 1

model = dict(
    type=InternVL_V1_5,
    model_path=path,
    freeze_llm=False,
    freeze_visual_encoder=True)

llava_dataset = dict(
    type=InternVL_V1_5_Dataset,
    model_path=path,
    data_paths=data_path,
    image_folders=image_folder,
    template=prompt_template,
    max_length=max_length)

train_dataloader = dict(
    batch_size=batch_size,
    num_workers=4,
    dataset=llava_dataset,
    sampler=dict(type=LengthGroupedSampler, length_property='modality_length',
                 per_device_batch_size=batch_size * accumulative_counts),
    collate_fn=dict(type=default_collate_fn))

optim_wrapper = dict(
    type=AmpOptimWrapper,
    optimizer=dict(type=AdamW, lr=4e-5, betas=(0.9, 0.999), weight_decay=0.05),
    clip_grad=dict(max_norm=1, error_if_nonfinite=False),
    accumulative_counts=accumulative_counts,
    loss_scale='dynamic',
    dtype='float16')
param_scheduler = [
    dict(type=LinearLR, start_factor=1e-5, by_epoch=True, begin=0, end=0.03, convert_to_iter_based=True),
    dict(type=CosineAnnealingLR, eta_min=0.0, by_epoch=True, begin=0.03, end=max_epochs, convert_to_iter_based=True)
]
train_cfg = dict(type=TrainLoop, max_epochs=max_epochs)
tokenizer = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path=path, trust_remote_code=True)
custom_hooks = [dict(type=DatasetInfoHook, tokenizer=tokenizer)]
default_hooks = dict(
    logger=dict(type=LoggerHook, log_metric_by_epoch=False, interval=10),
    checkpoint=dict(type=CheckpointHook, by_epoch=False, interval=1000, max_keep_ckpts=1))
randomness = dict(seed=None, deterministic=False)
"""
"""InternVL2-2B fine-tuned in full, its tower frozen, on LLaVA's data (the gallery's internvl/v2 layout)."""

INTERNVL_QLORA = """\
    freeze_llm=True,
    freeze_visual_encoder=True,
    quantization_llm=True,
    quantization_vit=False,
    llm_lora=dict(type=LoraConfig, r=128, lora_alpha=256, lora_dropout=0.05, target_modules=None,
                  task_type='CAUSAL_LM'),
    visual_encoder_lora=dict(type=LoraConfig, r=64, lora_alpha=16, lora_dropout=0.05,
                             target_modules=['attn.qkv', 'attn.proj', 'mlp.fc1', 'mlp.fc2']))
"""


def config_file(tmp_path: Path, text: str = INTERNVL_CONFIG) -> Path:
    path = tmp_path / "cfg.py"
    path.write_text(text, encoding="utf-8")
    return path


def test_internvl_in_full_loads_the_checkpoint_whole_and_says_it_must_be_transformers_format(tmp_path):
    path = config_file(tmp_path)
    result = import_config(path)
    model, data = result.config["model"], result.config["data"]
    assert (model["path"], model["dtype"], model["trust_remote_code"]) == ("OpenGVLab/InternVL2-2B", "bfloat16", False)
    assert model["vision"] == {"tower": "frozen", "projector": "full", "language": "train"}
    assert "tower_path" not in model["vision"] and result.config["train"]["gradient_checkpointing"] is True
    # InternVL2 has no `-hf` checkpoint: kept as model.path, and listed at its line with what to do.
    line, why = unmapped(result)["model.model_path = 'OpenGVLab/InternVL2-2B' (kept as model.path)"]
    assert line == line_of(path, "model_path=path") and "-hf" in why and "InternVLForConditionalGeneration" in why
    # The processor's chat template renders InternVL's format; xtuner's fixed system prompt is kept.
    assert "template" not in data and data["system"] == "You are an AI assistant whose name is InternLM (书生·浦语)."
    assert data["format"] == "sharegpt" and data["max_length"] == 8192
    assert data["image_root"] == str(tmp_path / "data/llava_data/llava_images") and len(data["train_files"]) == 1
    assert set(unmapped(result)) == {"model.model_path = 'OpenGVLab/InternVL2-2B' (kept as model.path)"}
    config = validated(result, tmp_path)
    assert config.data.system == data["system"] and config.model.vision.language == "train"


def test_internvl_qlora_with_a_lora_tower_and_a_transformers_checkpoint(tmp_path):
    checkpoint = tmp_path / "InternVL3-2B-hf"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "internvl"}))
    text = INTERNVL_CONFIG.replace("'OpenGVLab/InternVL2-2B'", "'./InternVL3-2B-hf'")
    text = text.replace("    freeze_llm=False,\n    freeze_visual_encoder=True)\n", INTERNVL_QLORA)
    result = import_config(config_file(tmp_path, text))
    model = result.config["model"]
    assert model["path"] == str(checkpoint) and not result.unmapped  # transformers' format: nothing to say
    assert model["quantization"] == {"bits": 4, "quant_type": "nf4", "double_quant": True, "compute_dtype": "bfloat16"}
    assert model["lora"] == {"r": 128, "alpha": 256, "dropout": 0.05, "targets": "all-linear", "experts": True}
    assert model["vision"]["tower"] == "lora" and model["vision"]["language"] == "train"
    assert model["vision"]["tower_lora"]["targets"] == ["attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"]
    # Module names of InternVL's remote code: said to be checked against the -hf checkpoint.
    assert any(note.startswith("model.vision.tower_lora.targets") for note in result.notes)
    config = validated(result, tmp_path)
    assert config.model.vision.tower_lora.r == 64 and config.model.quantization is not None


def test_internvl_lora_on_the_language_model_only(tmp_path):
    text = INTERNVL_CONFIG.replace(
        "    freeze_llm=False,",
        "    freeze_llm=True,\n    llm_lora=dict(type=LoraConfig, r=128, lora_alpha=256, lora_dropout=0.05, "
        "target_modules=None, task_type='CAUSAL_LM'),",
    ).replace("PROMPT_TEMPLATE.internlm2_chat", "PROMPT_TEMPLATE.phi3_chat")
    result = import_config(config_file(tmp_path, text))
    model = result.config["model"]
    assert model["lora"]["r"] == 128 and "quantization" not in model
    assert model["vision"] == {"tower": "frozen", "projector": "full", "language": "train"}
    assert result.config["data"]["system"] == "You are an AI assistant whose name is Phi-3."
    validated(result, tmp_path)


def test_internvl_data_tuneforge_cannot_read_is_named_at_its_line(tmp_path):
    """A meta file of InternVL's own (a JSON object) and an image folder per file are listed, with the fix."""
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"llava": {"root": "images/", "annotation": "llava.jsonl", "repeat_time": 1}}))
    text = INTERNVL_CONFIG.replace(
        "    data_paths=data_path,\n    image_folders=image_folder,",
        "    data_paths=['./meta.json', './more.jsonl'],\n    image_folders=['./images', './other'],\n"
        "    repeat_times=[1, 2],",
    )
    path = config_file(tmp_path, text)
    result = import_config(path)
    reasons = unmapped(result)
    line, why = reasons["InternVL_V1_5_Dataset.data_paths: './meta.json'"]
    assert line == line_of(path, "data_paths=") and "meta file" in why
    line, why = reasons["InternVL_V1_5_Dataset.image_folders = ['./images', './other']"]
    assert line == line_of(path, "image_folders=") and "one data.image_root" in why
    assert reasons["repeat_times = [1, 2]"][0] == line_of(path, "repeat_times=")
    assert result.config["data"]["train_files"] == [str(tmp_path / "more.jsonl")]  # what could be read is kept
    assert "image_root" not in result.config["data"]
    validated(result, tmp_path)


def test_an_internvl_model_without_a_path_is_refused_at_its_line(tmp_path):
    path = config_file(
        tmp_path,
        INTERNVL_CONFIG.replace("    model_path=path,\n    freeze_llm", "    model_path=None,\n    freeze_llm"),
    )
    with pytest.raises(UserError, match=rf"cfg.py:{line_of(path, 'model_path=None')}: model.model_path = None cannot"):
        import_config(path)


def test_the_cli_writes_a_vision_config_that_loads(tmp_path, capsys):
    from tuneforge.cli import main

    source = llava(tmp_path, QLORA_STAGE_2, pad=True)
    out = tmp_path / "imported.yaml"
    assert main(["import-xtuner", str(source), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "# NOT MAPPED (line" in printed and "pad_image_to_square = True" in printed
    assert load_config(out).model.vision.tower == "lora"


WHOLE_LLAVA = """\
from datasets import load_dataset
from peft import LoraConfig
from transformers import LlavaForConditionalGeneration
from xtuner.dataset import process_hf_dataset
from xtuner.dataset.map_fns import openai_map_fn
from xtuner.model import SupervisedFinetune

model = dict(
    type=SupervisedFinetune,
    llm=dict(type=LlavaForConditionalGeneration.from_pretrained,
             pretrained_model_name_or_path='llava-hf/llava-1.5-7b-hf'))
train_dataloader = dict(
    batch_size=1,
    dataset=dict(type=process_hf_dataset,
                 dataset=dict(type=load_dataset, path='json', data_files=['chats.jsonl']),
                 dataset_map_fn=openai_map_fn,
                 max_length=2048))
"""
"""A whole llava-hf checkpoint fine-tuned by xtuner's SupervisedFinetune."""


def test_a_whole_hugging_face_llava_loads_from_model_path(tmp_path):
    result = import_config(config_file(tmp_path, WHOLE_LLAVA))
    model = result.config["model"]
    assert model["path"] == "llava-hf/llava-1.5-7b-hf" and "tower_path" not in model["vision"]
    assert model["vision"] == {"tower": "full", "projector": "full", "language": "train"}  # xtuner trains it all
    assert not result.unmapped
    validated(result, tmp_path)
    lora = WHOLE_LLAVA.replace("-hf'))", "-hf'),\n    lora=dict(type=LoraConfig, r=8, lora_alpha=16))")
    result = import_config(config_file(tmp_path, lora))
    assert "vision" not in result.config["model"] and result.config["model"]["lora"]["r"] == 8
    assert any("set model.vision.tower: lora to match" in note for note in result.notes)
