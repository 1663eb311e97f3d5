"""GRPO learns: a tiny model warmed up by SFT to partial accuracy raises its held-out exact match under GRPO.

The task is rot13 of four-letter words. The warm start imitates demonstrations that shift every vowel one letter
too far more often than not (60%), so its greedy answer is wrong wherever a vowel appears (held-out exact match
about 0.45) while its samples are sometimes right there; the exact-match reward alone has to find and keep those.
configs/demo_grpo.yaml shows the same on the hex-colour demo, where the warm start takes minutes, not seconds.
"""

from __future__ import annotations

import importlib.util
import json
import random
import string
from pathlib import Path

import pytest
import torch

from conftest import REPO, chat, metrics, train_here, write_jsonl

LETTERS = string.ascii_lowercase
VOWELS = "aeiou"
TEMPLATE = '{instruction: "{input}\\n", sep: "\\n"}'

SFT = f"""\
model: {{architecture: llama, tokenizer: bytes, size: {{hidden_size: 64, intermediate_size: 172, num_hidden_layers: 2,
  num_attention_heads: 4, num_key_value_heads: 4, max_position_embeddings: 64}}}}
data: {{train_files: [sft.jsonl], template: {TEMPLATE}, max_length: 32, group_by_length: false}}
train: {{lr: 3.0e-3, min_lr: 1.0e-4, warmup_steps: 10, micro_batch_size: 32, max_steps: 150, seed: {{seed}}}}
checkpoint: {{every_steps: 0}}
eval: {{exact_match: {{file: heldout.jsonl, label: before, max_new_tokens: 8, batch_size: 200}}}}
log: {{every_steps: 50, progress: lines}}
"""

GRPO = f"""\
model: {{path: {{warm_start}}}}
data: {{train_files: [prompts.jsonl], template: {TEMPLATE}, max_length: 32}}
train: {{objective: grpo, lr: 1.0e-3, schedule: constant, warmup_steps: 0, micro_batch_size: 16, max_steps: 30,
  seed: {{seed}}}}
rl: {{generations: 8, max_completion_tokens: 8, temperature: 1.0, rewards: [{{kind: exact_match}}]}}
checkpoint: {{every_steps: 0}}
eval: {{exact_match: {{file: heldout.jsonl, label: after, max_new_tokens: 8, batch_size: 200}}}}
log: {{every_steps: 10, progress: lines}}
"""


def rot13(word: str, shift_vowels: bool = False) -> str:
    return "".join(LETTERS[(LETTERS.index(c) + 13 + (shift_vowels and c in VOWELS)) % 26] for c in word)


def write_task(directory: Path) -> None:
    rng = random.Random(0)
    words: set[str] = set()
    while len(words) < 6200:
        words.add("".join(rng.choice(LETTERS) for _ in range(4)))
    shuffled = sorted(words)
    rng.shuffle(shuffled)
    heldout, train = shuffled[:200], shuffled[200:]
    # Each demonstration shifts its vowels one letter too far with probability 0.6, so the wrong letter is the
    # mode the warm start learns.
    write_jsonl(directory / "sft.jsonl", [chat(w, rot13(w, shift_vowels=rng.random() < 0.6)) for w in train])
    write_jsonl(directory / "heldout.jsonl", [chat(w, rot13(w)) for w in heldout])
    write_jsonl(directory / "prompts.jsonl", [{"prompt": w, "answer": rot13(w)} for w in train])


@pytest.fixture
def one_thread():
    """One intra-op thread: on a busy 2-core machine torch's second thread spin-waits for a core, and these
    runs took 90 s instead of 15 (see `make test-fast`); tiny models lose nothing by it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def accuracy(work_dir: Path) -> float:
    return json.loads((work_dir / "eval.json").read_text())["accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_raises_the_held_out_exact_match_of_a_partly_trained_model(tmp_path, seed, one_thread):
    write_task(tmp_path)
    (tmp_path / "sft.yaml").write_text(SFT.replace("{seed}", str(seed)))
    warm = train_here(tmp_path / "sft.yaml", tmp_path / "sft")
    assert warm.returncode == 0, warm.stderr[-3000:]
    before = accuracy(tmp_path / "sft")
    assert 0.25 <= before <= 0.7, f"the warm start should be partly right, not {before}"

    warm_start = tmp_path / "sft" / "checkpoints" / "final"
    (tmp_path / "grpo.yaml").write_text(GRPO.replace("{warm_start}", str(warm_start)).replace("{seed}", str(seed)))
    result = train_here(tmp_path / "grpo.yaml", tmp_path / "grpo")
    assert result.returncode == 0, result.stderr[-3000:]
    after = accuracy(tmp_path / "grpo")
    assert after >= before + 0.3, f"held-out exact match {before:.3f} -> {after:.3f}"
    rewards = [r["reward"] for r in metrics(tmp_path / "grpo")]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.15, rewards


def test_the_demo_configs_chain_the_warm_start_into_grpo():
    from tuneforge.config.load import load_config

    warm, grpo = (load_config(REPO / "configs" / f"{name}.yaml") for name in ("demo_grpo_sft", "demo_grpo"))
    assert warm.train.objective == "sft" and grpo.train.objective == "grpo"
    # `tuneforge train configs/demo_grpo_sft.yaml` writes work_dirs/demo_grpo_sft, where the GRPO run starts.
    assert grpo.model.path == "work_dirs/demo_grpo_sft/checkpoints/final"
    assert grpo.data.template == warm.data.template
    assert grpo.eval.exact_match.file == warm.eval.exact_match.file
    assert (warm.eval.exact_match.label, grpo.eval.exact_match.label) == ("before GRPO", "after GRPO")


def test_the_prompt_generator_reproduces_the_bundled_prompts_and_keeps_heldout_apart(tmp_path):
    data = REPO / "configs" / "data"
    spec = importlib.util.spec_from_file_location("make_hex_rgb_prompts", data / "make_hex_rgb_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make(tmp_path, source=data)
    for name in ("hex_rgb_prompts_train.jsonl", "hex_rgb_prompts_heldout.jsonl"):
        assert (tmp_path / name).read_text() == (data / name).read_text()
    train, heldout = (
        [json.loads(line) for line in (data / name).open()]
        for name in ("hex_rgb_prompts_train.jsonl", "hex_rgb_prompts_heldout.jsonl")
    )
    assert len(train) == module.TRAIN_SIZE and len(heldout) == 200
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
    for record in train[:50] + heldout[:50]:
        colour = record["prompt"].removeprefix("#")
        assert record["answer"] == str(tuple(int(colour[i : i + 2], 16) for i in (0, 2, 4)))
