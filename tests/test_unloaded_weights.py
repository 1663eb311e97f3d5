"""Weights transformers does not load (multi-token-prediction layers, extra heads) survive training, checkpoints
and merged exports bit for bit, and a GGUF that would drop them is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tuneforge.errors import UserError
from tuneforge.model.unloaded_weights import (
    INDEX_FILE,
    UNLOADED_FILE,
    load_keeping_unloaded,
    recall,
)
from tuneforge.train.checkpoint import write_model_files

from conftest import REPO, adapter_checkpoint, demo_tokenizer, tiny_deepseek_v2, tiny_llama, train_here

EXTRAS = {
    "mtp.0.eh_proj.weight": torch.randn(8, 16).to(torch.bfloat16),
    "mtp.0.norm.weight": torch.rand(8),
    "model.layers.2.self_attn.q_proj.weight": torch.randn(32, 32),  # a layer past num_hidden_layers
}


def with_extras(directory: Path) -> Path:
    """Add tensors transformers has no place for to a saved model's weights."""
    weights = load_file(directory / "model.safetensors")
    save_file({**weights, **EXTRAS}, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def saved_model(directory: Path, model) -> Path:
    model.save_pretrained(directory)
    demo_tokenizer().save_pretrained(directory)
    return with_extras(directory)


def assert_carried(directory: Path) -> None:
    index = json.loads((directory / INDEX_FILE).read_text())
    assert {name: index["weight_map"][name] for name in EXTRAS} == dict.fromkeys(EXTRAS, UNLOADED_FILE)
    with safe_open(str(directory / UNLOADED_FILE), framework="pt") as handle:
        for name, tensor in EXTRAS.items():
            copied = handle.get_tensor(name)
            assert copied.dtype == tensor.dtype and torch.equal(copied, tensor), name


@pytest.mark.parametrize("build", [tiny_llama, tiny_deepseek_v2], ids=["llama", "deepseek_v2"])
def test_what_transformers_does_not_load_is_found_and_written_back(build, tmp_path):
    source = saved_model(tmp_path / "source", build(demo_tokenizer()))
    model = load_keeping_unloaded(AutoModelForCausalLM, source)
    # DeepseekV2's experts are stored one per key and loaded fused: converted, not unloaded.
    assert recall(model).names == tuple(sorted(EXTRAS))
    write_model_files(model, demo_tokenizer(), tmp_path / "saved", {"template": "deepseek_coder", "system": None})
    assert_carried(tmp_path / "saved")
    again = load_keeping_unloaded(AutoModelForCausalLM, tmp_path / "saved")  # through the index this time
    assert recall(again).names == tuple(sorted(EXTRAS))
    for name, tensor in again.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    write_model_files(again, demo_tokenizer(), tmp_path / "twice", {"template": "deepseek_coder", "system": None})
    assert_carried(tmp_path / "twice")


def test_merged_exports_keep_them_and_gguf_refuses_to_drop_them(tmp_path):
    from tuneforge.export import export
    from tuneforge.gguf_export.export import export_gguf

    checkpoint = adapter_checkpoint(tmp_path / "run", trained=True)
    with_extras(tmp_path / "run" / "base")
    lines = export(checkpoint, tmp_path / "merged", merge=True, dtype_name=None)
    assert_carried(tmp_path / "merged")
    assert any(line.startswith("kept 3 weight(s) transformers does not load") for line in lines), lines
    adapter = export(checkpoint, tmp_path / "adapter", merge=False, dtype_name=None)
    assert not (tmp_path / "adapter" / UNLOADED_FILE).exists(), adapter  # the base keeps them
    with pytest.raises(UserError, match=r"holds 3 weight\(s\) transformers does not load \(model\.layers\.2"):
        export_gguf(checkpoint, tmp_path / "gguf", "f16")
    assert not (tmp_path / "gguf").exists()


@pytest.mark.slow
def test_full_fine_tuning_carries_them_into_every_checkpoint(tmp_path):
    source = saved_model(tmp_path / "source", tiny_llama(demo_tokenizer()))
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config["model"] = {"path": str(source)}
    config["train"].update(max_steps=4, warmup_steps=1, precision="fp32", micro_batch_size=4)
    config["checkpoint"] = {"every_steps": 2, "keep_last": 2}
    config["eval"] = {"sample_prompts": []}
    config["data"]["train_files"] = [str(REPO / "configs" / "data" / "hex_rgb_train.jsonl")]
    config["log"] = {"plot": False}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    trained = train_here(tmp_path / "run.yaml", tmp_path / "work")
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    assert "3 weight(s) transformers does not load" in trained.stdout
    for name in ("step-2", "step-4", "final"):
        assert_carried(tmp_path / "work" / "checkpoints" / name)
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "work" / "checkpoints" / "final")
    start = AutoModelForCausalLM.from_pretrained(source)
    changed = [n for n, t in final.state_dict().items() if not torch.equal(t, start.state_dict()[n])]
    assert changed, "the model trained"


@pytest.mark.parametrize("extras", [True, False])
@pytest.mark.parametrize("build", [tiny_llama, tiny_deepseek_v2], ids=["llama", "deepseek_v2"])
def test_the_doctor_names_the_weights_that_will_not_train(build, extras, tmp_path):
    from tuneforge.config.schema import Config
    from tuneforge.doctor import PASS, WARN, check_unloaded_weights, model_skeleton

    source = tmp_path / "source"
    build(demo_tokenizer()).save_pretrained(source)
    demo_tokenizer().save_pretrained(source)
    if extras:
        with_extras(source)
    cfg = Config.model_validate({"model": {"path": str(source)}, "data": {"train_files": ["x.jsonl"]}})
    check = check_unloaded_weights(cfg, model_skeleton(cfg, demo_tokenizer()))
    if extras:
        assert check.status == WARN
        assert check.detail.startswith("3 weight(s) of model.path have no place")
        assert "model.layers.2.self_attn.q_proj.weight, mtp.0.eh_proj.weight, mtp.0.norm.weight" in check.detail
    else:  # DeepseekV2's per-expert keys load into its fused experts: in place, not unloaded
        assert check.status == PASS, check.detail


def test_a_hub_model_is_read_from_the_snapshot_it_was_downloaded_into(tmp_path, monkeypatch):
    """`model.path: org/name`: the weights transformers skips are found in the hub cache's snapshot, as they are
    in a local directory (a hub cache laid out as huggingface_hub writes it; nothing is fetched)."""
    import huggingface_hub.constants

    # Offline: transformers would otherwise ask the hub for an adapter config of this id (and wait on it).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cache, commit = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--tiny--with-mtp"
    saved_model(repo / "snapshots" / commit, tiny_llama(demo_tokenizer()))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    model = load_keeping_unloaded(AutoModelForCausalLM, "tiny/with-mtp", cache_dir=str(cache), local_files_only=True)
    assert recall(model).names == tuple(sorted(EXTRAS))
    assert recall(model).source == repo / "snapshots" / commit
    write_model_files(model, demo_tokenizer(), tmp_path / "saved", {"template": "deepseek_coder", "system": None})
    assert_carried(tmp_path / "saved")
