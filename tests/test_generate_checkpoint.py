"""Generation with left padding, and Hugging Face checkpoints written atomically and pruned."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoTokenizer

from tuneforge.checkpoint_records import read_chat_meta
from tuneforge.data.conversation import prompt_conversation
from tuneforge.data.templates import get_template
from tuneforge.generate import generate_replies
from tuneforge.train.checkpoint import prune_checkpoints, save_checkpoint, step_checkpoints

from conftest import tiny_llama

TEMPLATE = get_template("deepseek_coder")
PROMPTS = ["Hi", "A much longer prompt than the first one", "Mid-sized prompt"]


def histories():
    return [prompt_conversation([], p) for p in PROMPTS]


def test_batched_generation_equals_one_prompt_at_a_time(tokenizer):
    model = tiny_llama(tokenizer, seed=3)
    together = generate_replies(model, tokenizer, TEMPLATE, histories(), None, 12, batch_size=3)
    alone = [generate_replies(model, tokenizer, TEMPLATE, [h], None, 12)[0] for h in histories()]
    assert together == alone
    assert any(reply for reply in together)


def test_checkpoint_loads_back_with_identical_replies(tokenizer, tmp_path):
    model = tiny_llama(tokenizer, seed=4)
    path = save_checkpoint(model, tokenizer, tmp_path / "checkpoints" / "step-1", {"template": "deepseek_coder"})
    assert (path / "model.safetensors").exists() and (path / "tokenizer.json").exists()
    assert read_chat_meta(path) == {"template": "deepseek_coder"}
    assert not any(p.name.startswith(".tmp") for p in path.parent.iterdir())
    loaded = AutoModelForCausalLM.from_pretrained(path)
    loaded_tokenizer = AutoTokenizer.from_pretrained(path)
    before = generate_replies(model, tokenizer, TEMPLATE, histories(), None, 10)
    after = generate_replies(loaded, loaded_tokenizer, TEMPLATE, histories(), None, 10)
    assert before == after


def test_saving_again_replaces_and_pruning_keeps_the_newest(tokenizer, tmp_path):
    model = tiny_llama(tokenizer)
    root = tmp_path / "checkpoints"
    for step in (5, 10, 15, 10):
        save_checkpoint(model, tokenizer, root / f"step-{step}", {"step": step})
    assert [s for s, _ in step_checkpoints(root)] == [5, 10, 15]
    removed = prune_checkpoints(root, keep_last=2)
    assert [p.name for p in removed] == ["step-5"]
    assert [s for s, _ in step_checkpoints(root)] == [10, 15]
    assert sorted(p.name for p in root.iterdir()) == ["step-10", "step-15"]
