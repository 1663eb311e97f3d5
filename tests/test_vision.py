"""Vision-language training's contract on tiny real models (no training loop, no process): images become their
tokens in the data, packed rows equal unpacked ones, a text-only micro-batch runs the tower through a filler that
changes nothing, what trains of each part, the projector read as tensors only, adapters that PEFT loads back."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from tuneforge.config.schema import DataConfig, ModelConfig, TrainConfig, VisionSettings
from tuneforge.data.batching import BatchPlanner, collate
from tuneforge.data.image_batches import ImageBatches
from tuneforge.data.image_tokens import ImageTokens
from tuneforge.data.pipeline import prepare_data
from tuneforge.data.templates import IGNORE_INDEX, get_template
from tuneforge.data.vision_templates import MarkedTemplate, ProcessorTemplate
from tuneforge.errors import UserError
from tuneforge.model.compose import load_projector
from tuneforge.model.moe import find_moe
from tuneforge.model.trainable import make_trainable
from tuneforge.model.vision import PROJECTOR, TOWER, VisionParts
from tuneforge.model.vision_inputs import rotary_positions
from tuneforge.model.vision_training import part_learning_rates
from tuneforge.objective.forward import TokenForward
from tuneforge.train.optim import build_optimizer
from vlm_models import TINY_SIZES, tiny_gemma3, tiny_llava, tiny_llava_next

LIMIT = 10**8
COLOURS = [(255, 0, 0), (0, 160, 0), (0, 0, 255), (250, 200, 0), (120, 0, 120)]


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> Path:
    return tiny_llava(tmp_path_factory.mktemp("llava"))


def image_chat(image: str, answer: str, question: str = "Which colour?") -> dict:
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": answer},
        ]
    }


def text_chat(user: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def write_records(directory: Path, records: list[dict], sizes=((40, 30), (28, 60), (50, 50))) -> Path:
    """Images `0.png`, `1.png`... in COLOURS (sizes cycling through `sizes`), and the records as a JSONL file."""
    for index, colour in enumerate(COLOURS):
        Image.new("RGB", sizes[index % len(sizes)], colour).save(directory / f"{index}.png")
    path = directory / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def mixed_records() -> list[dict]:
    images = [image_chat(f"{i}.png", f"#{i}{i}{i}") for i in range(len(COLOURS))]
    two = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "0.png"},
                    {"type": "text", "text": "and"},
                    {"type": "image", "image": "2.png"},
                ],
            },
            {"role": "assistant", "content": "red, blue"},
        ]
    }
    return [*images, text_chat("hello there", "hi"), two, text_chat("count to 3", "1 2 3")]


def loaded(directory: Path):
    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32)
    return model, AutoProcessor.from_pretrained(directory)


def prepared(tmp_path: Path, processor, records: list[dict], template=None, **data):
    tokens = ImageTokens(processor, {}, LIMIT)
    config = DataConfig(train_files=[str(write_records(tmp_path, records))], cache_dir=None, **data)
    chat_template = template or ProcessorTemplate(processor)
    return prepare_data(config, processor.tokenizer, chat_template, images=tokens), tokens


def test_each_image_becomes_its_tokens_labelled_as_context(tmp_path, llava_dir):
    model, processor = loaded(llava_dir)
    data, tokens = prepared(tmp_path, processor, mixed_records())
    split = data.train.data
    assert data.train.report.kept == 8 and not data.train.report.drops.counts
    image_token = model.config.image_token_id
    per_image = len(tokens.expansion(Image.new("RGB", (40, 30))))
    for index in range(len(split)):
        ids, labels = split.sample(index)
        images = split.images_of(index)
        assert int((ids == image_token).sum()) == per_image * len(images)
        assert (labels[ids == image_token] == IGNORE_INDEX).all()
    # Image sources are absolute and in their tokens' order; text samples have none.
    two = split.origins.index(f"{tmp_path / 'train.jsonl'}:7")
    assert split.images_of(two) == [str(tmp_path / "0.png"), str(tmp_path / "2.png")]
    assert split.images_of(split.origins.index(f"{tmp_path / 'train.jsonl'}:6")) == []


def test_a_built_in_template_puts_the_placeholder_where_each_image_is(tmp_path, llava_dir):
    _, processor = loaded(llava_dir)
    data, _ = prepared(tmp_path, processor, mixed_records()[:2], MarkedTemplate(get_template(None), "<image>"))
    ids, _ = data.train.data.sample(0)
    text = processor.tokenizer.decode(ids)
    assert text.startswith("<s>") and "### Instruction:\n<image><image>" in text and "Which colour?" in text


def test_bad_images_are_dropped_and_counted_before_training(tmp_path, llava_dir):
    _, processor = loaded(llava_dir)
    Image.effect_noise((64, 64), 50).convert("RGB").save(tmp_path / "whole.png")
    (tmp_path / "broken.png").write_bytes((tmp_path / "whole.png").read_bytes()[:600])  # cut short
    records = [
        image_chat("0.png", "fine"),
        image_chat("missing.png", "gone"),
        image_chat("broken.png", "broken"),
        image_chat("https://example.com/a.png", "remote"),
        text_chat("a literal <image> in text", "dropped for a vision model"),
    ]
    data, _ = prepared(tmp_path, processor, records)
    report = data.train.report
    assert report.kept == 1
    assert report.drops.counts == {
        "missing image": 1,
        "corrupt image": 1,
        "image url": 1,
        "image count mismatch": 1,
    }
    assert any("train.jsonl:2" in example for example in report.drops.examples["missing image"])


def test_images_for_a_text_model_are_dropped_and_counted(tmp_path, tokenizer):
    path = write_records(tmp_path, [image_chat("0.png", "x"), text_chat("a <image> tag", "kept as text")])
    data = prepare_data(DataConfig(train_files=[str(path)], cache_dir=None), tokenizer, get_template(None))
    assert data.train.report.kept == 1 and data.train.report.drops.counts == {"image for a text-only model": 1}


def test_the_cache_keeps_each_samples_images(tmp_path, llava_dir):
    _, processor = loaded(llava_dir)
    tokens = ImageTokens(processor, {}, LIMIT)
    config = DataConfig(train_files=[str(write_records(tmp_path, mixed_records()))], cache_dir=str(tmp_path / "c"))
    first = prepare_data(config, processor.tokenizer, ProcessorTemplate(processor), images=tokens).train.data
    second = prepare_data(config, processor.tokenizer, ProcessorTemplate(processor), images=tokens).train.data
    assert second.images == first.images and (second.image_offsets == first.image_offsets).all()
    assert (second.input_ids == first.input_ids).all()
    # A text model's view of the same files is another cache entry: the images are part of the key.
    assert len(list((tmp_path / "c").iterdir())) == 1


def epoch_loss(model, data, tokens, pad_id: int, strategy: str, rows: int) -> tuple[float, int]:
    attach = ImageBatches(tokens, pad_id, LIMIT).attach
    planner = BatchPlanner(data, rows, pad_id, 0, strategy, 256, attach_images=attach)
    forward = TokenForward(model, model, "fp32")
    total, targets = 0.0, 0
    with torch.no_grad():
        for batch in planner.epoch(0):
            total += float(forward.cross_entropy_sum(batch))
            targets += batch.num_targets
    return total, targets


@pytest.mark.parametrize("family", [tiny_llava, tiny_llava_next])
def test_packed_rows_train_to_the_same_loss_as_unpacked(tmp_path, family):
    """Several image samples and text samples packed into rows give the loss of one sample per row (LLaVA-NeXT:
    images of several sizes, each with its own tile count and `image_sizes`)."""
    model, processor = loaded(family(tmp_path / "model"))
    data, tokens = prepared(tmp_path, processor, mixed_records() * 2)
    pad = processor.tokenizer.pad_token_id
    one_per_row = epoch_loss(model, data.train.data, tokens, pad, "random", 1)
    packed = epoch_loss(model, data.train.data, tokens, pad, "packed", 2)
    assert packed[1] == one_per_row[1]
    assert packed[0] == pytest.approx(one_per_row[0], rel=1e-5)


def test_a_text_only_micro_batch_runs_the_tower_on_a_filler_that_changes_nothing(tmp_path, llava_dir):
    """Every rank runs the tower in every forward and backward (else ZeRO-3 and FSDP ranks wait on each other
    forever); the filler image sits where nothing attends to it: the loss and every gradient are those of the
    text alone, and the tower's gradients are exactly zero."""
    model, processor = loaded(llava_dir)
    data, tokens = prepared(tmp_path, processor, [text_chat("hello there", "hi")])
    tower = VisionParts.of(model).tower
    calls = []
    model.get_submodule(tower).register_forward_hook(lambda *_: calls.append(1))
    forward = TokenForward(model, model, "fp32")

    plain = collate(data.train.data, [[0]], processor.tokenizer.pad_token_id, False)
    plain_loss = forward.cross_entropy_sum(plain)
    plain_loss.backward()
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    assert calls == []

    filled = ImageBatches(tokens, processor.tokenizer.pad_token_id, LIMIT).attach(
        collate(data.train.data, [[0]], processor.tokenizer.pad_token_id, False)
    )
    assert filled.input_ids.size(1) > plain.input_ids.size(1) and filled.vision is not None
    loss = forward.cross_entropy_sum(filled)
    loss.backward()
    assert calls == [1]
    assert float(loss) == pytest.approx(float(plain_loss), rel=1e-6)
    for name, param in model.named_parameters():
        if name.startswith(tower):
            assert param.grad is None or not param.grad.any(), name
        elif name in plain_grads:
            torch.testing.assert_close(param.grad, plain_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_qwen_rotary_positions_restart_at_every_packed_sample():
    """Qwen-VL's rotary positions for a packed row are each sample's own, as the model computes them for the
    sample alone (its processor needs torchvision, so the tokens are laid out here from the grid)."""
    from tuneforge.data.batching import MicroBatch
    from tuneforge.data.byte_tokenizer import build_byte_tokenizer
    from tuneforge.model.fresh_vision import fresh_vision_config, vision_tokenizer

    tokenizer = vision_tokenizer(build_byte_tokenizer(), "qwen2_5_vl")
    config = fresh_vision_config("qwen2_5_vl", TINY_SIZES["qwen2_5_vl"], tokenizer)
    model = AutoModelForImageTextToText.from_config(config)
    image, start = config.image_token_id, config.vision_start_token_id
    grids = torch.tensor([[1, 4, 4], [1, 2, 6]])  # 4 and 3 tokens after the 2x2 merge
    first = [5, 6, start, *[image] * 4, 7, 8]
    second = [9, start, *[image] * 3, 10, 11, 12]
    row = torch.tensor([first + second])
    positions = torch.tensor([list(range(len(first))) + list(range(len(second)))])
    batch = MicroBatch(row, torch.ones_like(row), row, positions, torch.zeros_like(row), True, ["a", "b"])
    batch.vision = {"image_grid_thw": grids}
    packed = rotary_positions(model.model, batch)
    assert packed.shape == (4, 1, len(first) + len(second))
    assert (packed[0] == positions).all()
    for ids, grid, span in ((first, grids[:1], slice(0, len(first))), (second, grids[1:], slice(len(first), None))):
        alone, _ = model.model.get_rope_index(
            torch.tensor([ids]), mm_token_type_ids=(torch.tensor([ids]) == image).int(), image_grid_thw=grid
        )
        assert (packed[1:, :, span] == alone).all()


def test_gemma3_is_refused_packing(tmp_path):
    from tuneforge.config.schema import Config
    from tuneforge.train.vision import check_packing

    model, _ = loaded(tiny_gemma3(tmp_path / "gemma"))
    config = Config.model_validate(
        {"model": {"path": str(tmp_path / "gemma")}, "data": {"train_files": ["x"], "packing": True}}
    )
    with pytest.raises(UserError, match=r"data\.packing: Gemma3ForConditionalGeneration lets image tokens attend"):
        check_packing(config, model)


def trainable_names(model) -> set[str]:
    return {name for name, param in model.named_parameters() if param.requires_grad}


def test_stage_one_trains_the_projector_alone_at_its_own_rate(llava_dir):
    model, _ = loaded(llava_dir)
    cfg = ModelConfig(path=str(llava_dir), vision=VisionSettings(language="frozen", projector_lr=1e-3))
    model, notes = make_trainable(model, cfg, False, find_moe(model))
    parts = VisionParts.of(model)
    assert {parts.part_of(name) for name in trainable_names(model)} == {PROJECTOR}
    assert notes == ["vision: tower frozen, projector full, language model frozen"]
    optimizer = build_optimizer(model, TrainConfig(lr=2e-4), part_learning_rates(model, cfg.vision, 2e-4))
    assert {group["lr"] for group in optimizer.param_groups} == {1e-3}
    assert all(group["lr_scale"] == pytest.approx(5.0) for group in optimizer.param_groups)


def test_adapters_on_the_language_model_and_tower_load_back_in_peft(tmp_path, llava_dir):
    from peft import PeftModel

    model, _ = loaded(llava_dir)
    cfg = ModelConfig(
        path=str(llava_dir),
        lora={"r": 4, "alpha": 8, "dropout": 0.0},
        vision=VisionSettings(tower="lora", tower_lora={"r": 2, "alpha": 2, "dropout": 0.0}),
    )
    model, _ = make_trainable(model, cfg, False, find_moe(model))
    parts = VisionParts.of(model)
    kinds = {(parts.part_of(name), "lora_" in name) for name in trainable_names(model)}
    assert kinds == {("language", True), ("tower", True), (PROJECTOR, False)}  # the projector trains whole
    tower_ranks = {p.shape[0] for n, p in model.named_parameters() if "lora_A" in n and parts.part_of(n) == TOWER}
    assert tower_ranks == {2}
    torch.manual_seed(1)
    for param in model.parameters():
        if param.requires_grad:
            param.data.normal_(0, 0.1)  # trained-looking adapters, so the comparison can fail
    model.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([[5, 6, *[model.config.image_token_id] * 4, 7]])
    pixels = torch.rand(1, 3, 28, 28)
    with torch.no_grad():
        expected = model(input_ids=ids, pixel_values=pixels).logits
        base, _ = loaded(llava_dir)
        again = PeftModel.from_pretrained(base, tmp_path / "adapter")
        torch.testing.assert_close(again(input_ids=ids, pixel_values=pixels).logits, expected)


def test_a_projector_is_read_as_tensors_only(tmp_path, llava_dir):
    model, _ = loaded(llava_dir)
    projector = model.get_submodule(VisionParts.of(model).projector)
    # xtuner's names for LLaVA's two linear layers, in a PyTorch file.
    xtuner = {
        f"projector.model.{i}.{kind}": torch.full_like(param, float(i + 1))
        for (name, param), i in zip(projector.named_parameters(), (0, 0, 2, 2), strict=True)
        for kind in [name.rsplit(".", 1)[1]]
    }
    torch.save(xtuner, tmp_path / "projector.pth")
    assert "4 tensors" in load_projector(projector, str(tmp_path / "projector.pth"))
    assert (projector.linear_1.weight == 1).all() and (projector.linear_2.bias == 3).all()

    class Payload:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "ran",))

    (tmp_path / "evil.pth").write_bytes(pickle.dumps({"projector.model.0.weight": Payload()}))
    with pytest.raises(UserError, match="cannot be read as tensors only"):
        load_projector(projector, str(tmp_path / "evil.pth"))
    assert not (tmp_path / "ran").exists()


def test_a_wrong_projector_is_refused_by_shape(tmp_path, llava_dir):
    model, _ = loaded(llava_dir)
    projector = model.get_submodule(VisionParts.of(model).projector)
    torch.save({"projector.model.0.weight": torch.zeros(3, 3)}, tmp_path / "short.pth")
    with pytest.raises(UserError, match="the model's projector needs"):
        load_projector(projector, str(tmp_path / "short.pth"))


def test_data_check_and_preview_show_images_and_their_tokens(tmp_path, llava_dir):
    from conftest import tuneforge_here

    write_records(tmp_path, mixed_records())
    (tmp_path / "cfg.yaml").write_text(
        f"model: {{path: {llava_dir}}}\ndata: {{train_files: [train.jsonl], cache_dir: null}}\n"
    )
    check = tuneforge_here("data", "check", str(tmp_path / "cfg.yaml"))
    assert check.returncode == 0, check.stderr
    assert "8 kept, 0 dropped" in check.stdout
    assert "images: 7 in 6 samples (2 text-only); image tokens per image p50 4, max 4" in check.stdout
    preview = tuneforge_here("data", "preview", str(tmp_path / "cfg.yaml"), "-n", "8")
    assert preview.returncode == 0, preview.stderr
    assert f"2 image(s): {tmp_path / '0.png'}, {tmp_path / '2.png'}" in preview.stdout
    assert "<image: 4 tokens>\nand<image: 4 tokens>" in preview.stdout


def test_qlora_quantizes_the_language_model_alone(llava_dir):
    from tuneforge.config.schema import QuantizationConfig
    from tuneforge.model.quantize import bitsandbytes_config

    settings = QuantizationConfig(bits=4, compute_dtype="float32")
    model = AutoModelForImageTextToText.from_pretrained(
        llava_dir, quantization_config=bitsandbytes_config(settings, False), device_map={"": "cpu"}
    )
    parts = VisionParts.of(model)
    quantized = {parts.part_of(name) for name, module in model.named_modules() if "4bit" in type(module).__name__}
    assert quantized == {"language"}
    assert all(
        module.weight.dtype == torch.float32
        for module in model.get_submodule(parts.tower).modules()
        if isinstance(module, torch.nn.Linear)
    )


def test_a_moe_language_model_gets_its_experts_adapters_and_balance_loss(tmp_path):
    """Qwen3-VL-MoE: the MoE map, adapters on the stacked experts (grouped low-rank products) and the router
    balance loss are the language model's, as for a text MoE; a step trains them."""
    from tuneforge.data.batching import collate
    from tuneforge.data.byte_tokenizer import build_byte_tokenizer
    from tuneforge.data.tokenize import TokenizedData
    from tuneforge.model.fresh_vision import fresh_vision_config, vision_tokenizer
    from tuneforge.model.router_balance import attach_router_balance

    from conftest import accumulate, single_engine

    tokenizer = vision_tokenizer(build_byte_tokenizer(), "qwen3_vl_moe")
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        fresh_vision_config("qwen3_vl_moe", TINY_SIZES["qwen3_vl_moe"], tokenizer)
    )
    moe = find_moe(model)
    assert len(moe) == 2
    cfg = ModelConfig(architecture="qwen3_vl_moe", tokenizer="bytes", lora={"r": 4, "experts": True, "dropout": 0.1})
    model, notes = make_trainable(model, cfg, False, moe)
    assert "experts.gate_up_proj x2" in notes[0] and "grouped low-rank products" in notes[0]
    balance, note = attach_router_balance(moe, model.config, 0.01)
    assert "over 2 MoE layers, top-2" in note
    ids = tokenizer("say something about experts", add_special_tokens=False)["input_ids"]
    data = TokenizedData.from_samples([(ids, ids, "a")])
    engine = single_engine(model)
    accumulate(engine, [collate(data, [[0]], tokenizer.pad_token_id, False)], balance=balance)
    # B starts at zero, so A's first gradients are zero; every expert adapter's B trains from the first step.
    expert_grads = [p.grad for n, p in model.named_parameters() if "experts" in n and "lora_B" in n]
    assert len(expert_grads) == 4 and all(g is not None and g.abs().sum() > 0 for g in expert_grads)


def test_the_cache_key_follows_the_processors_rule(llava_dir):
    """Two LLaVA processors with the same image processor but other patch sizes give other tokens per image: the
    prepared data of one is never reused for the other."""
    import copy

    from tuneforge.data.byte_tokenizer import build_byte_tokenizer
    from tuneforge.model.fresh_vision import fresh_vlm

    size = copy.deepcopy(TINY_SIZES["llava"])
    _, coarse = fresh_vlm("llava", size, build_byte_tokenizer())
    size["vision_config"]["patch_size"] = 7
    _, fine = fresh_vlm("llava", size, build_byte_tokenizer())
    assert coarse.image_processor.to_dict() == fine.image_processor.to_dict()
    assert ImageTokens(coarse).fingerprint() != ImageTokens(fine).fingerprint()
