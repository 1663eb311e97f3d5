"""The shipped recipes: each validates, names its launch line, and fits the GPU it was sized for on its model's
published shapes (the doctor's estimate; a recipe that stops fitting fails here). `tuneforge recipes` lists,
copies without overwriting, and shows one with the doctor's verdict."""

from __future__ import annotations

import pytest

from tuneforge.cli import GPU_CHOICES, main
from tuneforge.config import load_config
from tuneforge.config.data_sections import TemplateConfig
from tuneforge.doctor import FAIL, PASS
from tuneforge.doctor_report import doctor_checks
from tuneforge.recipes import all_recipes

RECIPES = all_recipes()


def test_the_catalogue_covers_the_models_people_train():
    names = {recipe.name for recipe in RECIPES}
    assert {
        "deepseek-v2-lite-qlora-ddp-8gpu",  # the original report's job
        "deepseek-v2-lite-lora-fsdp-8gpu",
        "llama-3-8b-lora-1gpu",
        "llama-3-8b-qlora-24gb",
        "llama-3-8b-full-fsdp-8gpu",
        "qwen3-30b-a3b-lora-fsdp-8gpu",
        "mixtral-8x7b-qlora-1gpu",
        "qwen2.5-7b-qlora-24gb",
        "llama-3-8b-dpo-lora-1gpu",
        "llama-3-8b-dpo-full-fsdp-8gpu",
        "qwen3-30b-a3b-full-ep-8gpu",  # expert parallelism
        "qwen2.5-7b-grpo-lora-1gpu",  # online RL
        "qwen2.5-7b-grpo-full-fsdp-8gpu",
        # vision-language models
        "qwen2.5-vl-7b-lora-1gpu",
        "qwen3-vl-30b-a3b-lora-fsdp-8gpu",
        "internvl3-8b-lora-1gpu",
        "gemma-3-12b-lora-1gpu",
        "llava-1.5-7b-stage1-1gpu",
        "llava-1.5-7b-stage2-lora-1gpu",
    } <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=[recipe.name for recipe in RECIPES])
def test_each_recipe_fits_the_gpu_it_names_on_its_models_real_shapes(recipe):
    assert recipe.gpu in GPU_CHOICES and recipe.shapes.is_file()
    assert recipe.launch.startswith(f"tuneforge train {recipe.path.name}")
    assert (recipe.gpus > 1) == ("--nproc-per-node" in recipe.launch)
    load_config(recipe.path)  # validates
    checks = {check.name: check for check in doctor_checks(recipe.path, [], recipe.gpus, 1, recipe.gpu, recipe.shapes)}
    memory = checks["memory estimate"]
    assert memory.status == PASS and "skipped" not in memory.detail, memory.detail
    assert not [check for check in checks.values() if check.status == FAIL], checks


def test_recipes_are_listed_copied_without_overwriting_and_shown_with_the_doctor(tmp_path, capsys, monkeypatch):
    assert main(["recipes"]) == 0
    listed = capsys.readouterr().out
    assert all(recipe.name in listed for recipe in RECIPES) and "8 x h100" in listed

    monkeypatch.chdir(tmp_path)
    assert main(["recipes", "copy", "llama-3-8b-lora-1gpu"]) == 0
    copied = tmp_path / "llama-3-8b-lora-1gpu.yaml"
    assert copied.read_text() == next(r for r in RECIPES if r.name == "llama-3-8b-lora-1gpu").path.read_text()
    assert f"tuneforge train {copied}" in capsys.readouterr().out
    assert main(["recipes", "copy", "llama-3-8b-lora-1gpu"]) == 2  # never over an existing file
    assert f"error: {copied} exists; name another file" in capsys.readouterr().err
    assert main(["recipes", "copy", "llama-3-8b-lora-1gpu", "mine.yaml"]) == 0 and (tmp_path / "mine.yaml").is_file()

    assert main(["recipes", "copy", "lama-3-8b-lora"]) == 2
    assert "no recipe 'lama-3-8b-lora'; did you mean llama-3-8b-lora-1gpu" in capsys.readouterr().err

    assert main(["recipes", "show", "llama-3-8b-qlora-24gb", "--gpu", "h100"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("# recipe: Llama-3-8B-Instruct QLoRA")
    assert "doctor, for 1 x h100 on the published shapes of its model (llama-3-8b.config.json):" in shown
    assert "PASS  memory estimate" in shown and "of 80 per GPU (H100 80GB)" in shown


def test_recipes_copy_never_writes_through_a_symbolic_link(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    elsewhere = tmp_path / "elsewhere.yaml"  # where a dangling link points: must stay absent
    (tmp_path / "dangling.yaml").symlink_to(elsewhere)
    assert main(["recipes", "copy", "llama-3-8b-lora-1gpu", "dangling.yaml"]) == 2
    err = capsys.readouterr().err
    assert err == "error: dangling.yaml is a symbolic link; name another file, or remove the link first\n"
    assert not elsewhere.exists() and (tmp_path / "dangling.yaml").is_symlink()

    kept = tmp_path / "kept.yaml"
    kept.write_text("mine\n")
    (tmp_path / "link.yaml").symlink_to(kept)  # a link to an existing file: refused the same, the file untouched
    assert main(["recipes", "copy", "llama-3-8b-lora-1gpu", "link.yaml"]) == 2
    assert "link.yaml is a symbolic link" in capsys.readouterr().err and kept.read_text() == "mine\n"
    assert main(["recipes", "copy", "llama-3-8b-lora-1gpu", "kept.yaml"]) == 2  # a regular file: never overwritten
    assert "kept.yaml exists" in capsys.readouterr().err and kept.read_text() == "mine\n"


def test_vision_language_recipes_are_sized_with_their_tower_and_images(capsys):
    """The doctor builds a recipe's vision-language model from its published shapes and counts the tower and the
    images: Qwen2.5-VL's pixel budget gives 1,280 tokens (5,120 patches) an image, 3 to a packed row."""
    assert main(["recipes", "show", "qwen2.5-vl-7b-lora-1gpu", "--gpu", "h100"]) == 0
    shown = capsys.readouterr().out
    assert "PASS  memory estimate" in shown
    assert (
        "vision: tower 0.63B (frozen), projector 44.6M (frozen), language model lora; 1,280 tokens per image" in shown
    )
    assert "images: 6 x 1,280 tokens, 5,120 patches" in shown and "vision tower" in shown

    recipes = {recipe.name: load_config(recipe.path) for recipe in RECIPES}
    assert not recipes["gemma-3-12b-lora-1gpu"].data.packing  # Gemma 3's image tokens attend both ways
    moe = recipes["qwen3-vl-30b-a3b-lora-fsdp-8gpu"]
    assert moe.parallel.engine == "fsdp" and moe.parallel.moe_safety and moe.model.lora.experts is False
    stage1, stage2 = recipes["llava-1.5-7b-stage1-1gpu"], recipes["llava-1.5-7b-stage2-lora-1gpu"]
    vision = stage1.model.vision
    assert stage1.model.path == "lmsys/vicuna-7b-v1.5" and vision.tower_path == "openai/clip-vit-large-patch14-336"
    assert stage1.model.lora is None and vision.language == "frozen" and vision.projector == "full"
    assert stage1.data.image_root.endswith("LLaVA-Pretrain/images")
    assert stage1.data.train_files[0].endswith("blip_laion_cc_sbu_558k.json")
    assert stage2.model.path == "work_dirs/llava-1.5-7b-stage1-1gpu/checkpoints/final"
    assert stage2.model.lora.r == 128 and stage2.data.train_files[0].endswith("llava_v1_5_mix665k.json")
    for stage in (stage1, stage2):  # Vicuna v1's format, inline: "<system> USER: ... ASSISTANT: ...</s>"
        assert isinstance(stage.data.template, TemplateConfig)
        assert stage.data.template.instruction == "USER: {input} ASSISTANT:"
        assert stage.data.system.startswith("A chat between a curious user and an artificial intelligence assistant")


def test_grpo_recipes_are_sized_by_their_rollout_rows(capsys):
    """A GRPO micro-batch of 4 prompts trains 4 x 8 rows of the prompt and a completion: the estimate counts those
    (the rollout's KV cache fits inside the update's activations, so it adds no row)."""
    assert main(["recipes", "show", "qwen2.5-7b-grpo-lora-1gpu", "--gpu", "h100"]) == 0
    shown = capsys.readouterr().out
    assert "PASS  memory estimate" in shown
    assert "activations: 4 x 8 x 1536 (a prompt's completions) tokens, checkpointed" in shown
    assert "rollout KV cache" not in shown
