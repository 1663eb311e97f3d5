"""Fresh vision-language models (`tuneforge.model.fresh_vision`) and the tiny ones the tests use
(`tests/vlm_models.py`): built locally, saved, loaded back through the Auto classes, run on a chat with an image."""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from tuneforge.data.byte_tokenizer import build_byte_tokenizer
from tuneforge.errors import UserError
from tuneforge.model.fresh_vision import (
    FAMILIES,
    VISION_TOKENS,
    fresh_image_processor,
    fresh_processor,
    fresh_vision_config,
    processor_problem,
    token_ids,
    vision_chat_template,
    vision_tokenizer,
)
from vlm_models import TINY_SIZES, TINY_VLMS

ALL = sorted(FAMILIES)


def _needs_processor(model_type: str) -> None:
    if problem := processor_problem(model_type):
        pytest.skip(problem)


def _chat() -> list[dict]:
    return [
        {"role": "system", "content": "Name colours."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": [{"type": "text", "text": "Sure?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "yes"}]},
    ]


@pytest.mark.parametrize("model_type", ALL)
def test_tiny_vlm_loads_back_and_trains_on_an_image(model_type, tmp_path):
    _needs_processor(model_type)
    directory = TINY_VLMS[model_type](tmp_path / model_type)
    # local_files_only: the hub is never asked (HF_HUB_OFFLINE is read once, when huggingface_hub is imported)
    model = AutoModelForImageTextToText.from_pretrained(directory, local_files_only=True)
    processor = AutoProcessor.from_pretrained(directory, local_files_only=True)

    height, width = 30, 40
    text = processor.apply_chat_template(_chat()[:3], tokenize=False)
    image = Image.new("RGB", (width, height), (200, 30, 30))
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    image_tokens = int((inputs["input_ids"] == model.config.image_token_id).sum())
    expected = processor._get_num_multimodal_tokens(image_sizes=[(height, width)]).num_image_tokens
    assert image_tokens == expected[0] > 0

    labels = inputs["input_ids"].masked_fill(inputs["input_ids"] == model.config.image_token_id, -100)
    loss = model(**inputs, labels=labels, use_cache=False).loss
    assert torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.model.language_model.parameters() if p.requires_grad)


@pytest.mark.parametrize("model_type", ALL)
def test_chat_template_extends_its_prefix(model_type):
    tokenizer = vision_tokenizer(build_byte_tokenizer(), model_type)
    tokenizer.chat_template = vision_chat_template(model_type)
    messages = _chat()
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: index + 1], tokenize=False)
        assert through.startswith(before) and full.startswith(through)
        assert through.endswith(tokenizer.eos_token + "\n")  # a reply ends where generation stops
    assert full.count(FAMILIES[model_type].placeholder) == 1
    assert "<|im_start|>system\nName colours." in full


def test_chat_template_refuses_unknown_content_parts():
    tokenizer = vision_tokenizer(build_byte_tokenizer(), "llava")
    tokenizer.chat_template = vision_chat_template("llava")
    with pytest.raises(Exception, match="audio is not supported"):
        tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "audio"}]}], tokenize=False)


@pytest.mark.parametrize("model_type", ALL)
def test_config_token_ids_are_the_tokenizers(model_type, tmp_path):
    tokenizer = vision_tokenizer(build_byte_tokenizer(), model_type)
    config = fresh_vision_config(model_type, TINY_SIZES[model_type], tokenizer)
    assert config.text_config.vocab_size == len(tokenizer)
    assert config.text_config.eos_token_id == tokenizer.eos_token_id
    for field, value in token_ids(tokenizer, model_type).items():
        assert getattr(config, field) == value
    # The named tokens are special (never split) and survive a save: the processor reads them after loading.
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for name, token in VISION_TOKENS[model_type].items():
        assert getattr(loaded, name) == token
        assert loaded(f"a{token}b", add_special_tokens=False)["input_ids"][1] == tokenizer.convert_tokens_to_ids(token)


def test_vision_tokenizer_keeps_a_tokenizer_that_has_the_tokens():
    tokenizer = vision_tokenizer(build_byte_tokenizer(), "qwen2_5_vl")
    assert vision_tokenizer(tokenizer, "qwen3_vl") is tokenizer
    assert len(tokenizer) == len(build_byte_tokenizer()) + 4


def test_vision_tokenizer_keeps_the_tokenizers_own_tokens():
    """A directory's tokenizer may hold some of the tokens already (a real checkpoint's `<|image_pad|>`) and other
    special tokens: their ids, its settings and its list of special tokens stay."""
    tokenizer = build_byte_tokenizer()
    tokenizer.add_special_tokens({"extra_special_tokens": ["<|im_end|>", "<|image_pad|>"]})
    tokenizer.chat_template = "{{ messages[0]['content'] }}"
    pad_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    named = vision_tokenizer(tokenizer, "qwen2_5_vl")
    assert named.image_token_id == pad_id
    assert len(named) == len(tokenizer) + 3
    assert "<|im_end|>" in named.all_special_tokens
    assert named.chat_template == tokenizer.chat_template
    assert named.is_fast  # the loss mask needs token offsets


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "internvl"])
def test_model_runs_on_its_image_processor_alone(model_type):
    """The families whose processor needs torchvision: their model, config and image processor without it, the
    image placeholder expanded as their processor would."""
    tokenizer = vision_tokenizer(build_byte_tokenizer(), model_type)
    config = fresh_vision_config(model_type, TINY_SIZES[model_type], tokenizer)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    images = fresh_image_processor(model_type, config)([Image.new("RGB", (90, 60), (0, 0, 200))], return_tensors="pt")
    extra = {}
    if model_type == "internvl":
        tiles = int(images.pop("num_patches")[0])
        placeholder = f"<img>{'<IMG_CONTEXT>' * config.image_seq_length * tiles}</img>"
    else:
        merge = config.vision_config.spatial_merge_size
        count = int(images["image_grid_thw"][0].prod()) // merge**2
        placeholder = f"<|vision_start|>{'<|image_pad|>' * count}<|vision_end|>"
    ids = tokenizer(f"look: {placeholder} blue", return_tensors="pt")["input_ids"]
    if model_type != "internvl":  # mrope places the image's tokens on its grid
        extra["mm_token_type_ids"] = (ids == config.image_token_id).long()
    loss = model(input_ids=ids, labels=ids, use_cache=False, **images, **extra).loss
    assert torch.isfinite(loss)


def test_qwen_mrope_split_derives_from_head_dim_unless_given():
    tokenizer = vision_tokenizer(build_byte_tokenizer(), "qwen2_5_vl")
    config = fresh_vision_config("qwen2_5_vl", TINY_SIZES["qwen2_5_vl"], tokenizer)
    head_dim = config.text_config.hidden_size // config.text_config.num_attention_heads
    assert sum(config.text_config.rope_parameters["mrope_section"]) == head_dim // 2
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size
    rope = {"rope_type": "default", "mrope_section": [2, 1, 1]}
    size = {**TINY_SIZES["qwen2_5_vl"]}
    size["text_config"] = {**size["text_config"], "rope_parameters": rope}
    assert fresh_vision_config("qwen2_5_vl", size, tokenizer).text_config.rope_parameters["mrope_section"] == [2, 1, 1]


def test_tokens_per_image_agree_with_the_tower():
    tokenizer = vision_tokenizer(build_byte_tokenizer(), "internvl")
    config = fresh_vision_config("internvl", TINY_SIZES["internvl"], tokenizer)
    vision = config.vision_config
    patches = math.prod(s // p for s, p in zip(vision.image_size, vision.patch_size, strict=True))
    assert config.image_seq_length == patches // 4  # pixel shuffle at 0.5
    tokenizer = vision_tokenizer(build_byte_tokenizer(), "gemma3")
    with pytest.raises(UserError, match="mm_tokens_per_image: 3 must be a square"):
        fresh_vision_config("gemma3", {**TINY_SIZES["gemma3"], "mm_tokens_per_image": 3}, tokenizer)


def test_unsupported_model_type_names_the_supported_ones():
    with pytest.raises(UserError, match=r"'llava_nxt' is not .* \(did you mean llava_next\?\); supported: gemma3, "):
        vision_tokenizer(build_byte_tokenizer(), "llava_nxt")
    with pytest.raises(UserError, match=r"supported: .*qwen2_5_vl"):
        fresh_vision_config("llama", {}, build_byte_tokenizer())


def test_unknown_or_bad_size_fields_are_refused():
    tokenizer = vision_tokenizer(build_byte_tokenizer(), "llava")
    with pytest.raises(UserError, match=r"model.size.text_config.hiden_size: .*did you mean `hidden_size`"):
        fresh_vision_config("llava", {"text_config": {"hiden_size": 32}}, tokenizer)
    with pytest.raises(UserError, match=r"model.size.vision_config: expected a mapping"):
        fresh_vision_config("llava", {"vision_config": 3}, tokenizer)
    with pytest.raises(UserError, match=r"model.size: .*hidden_size"):
        fresh_vision_config("llava", {"text_config": {"hidden_size": "wide"}}, tokenizer)


def test_config_needs_the_vision_tokens():
    with pytest.raises(UserError, match="no image_token for llava"):
        fresh_vision_config("llava", TINY_SIZES["llava"], build_byte_tokenizer())


@pytest.mark.parametrize("model_type", [name for name, family in FAMILIES.items() if family.video_processor])
def test_processor_without_torchvision_is_refused_in_one_line(model_type):
    if processor_problem(model_type) is None:
        pytest.skip("torchvision is installed here")
    tokenizer = vision_tokenizer(build_byte_tokenizer(), model_type)
    config = fresh_vision_config(model_type, TINY_SIZES[model_type], tokenizer)
    with pytest.raises(UserError, match="torchvision"):
        fresh_processor(model_type, config, tokenizer)
