"""An objective is described once (`tuneforge.config.objectives`) and built by name (`train.objectives.BUILDERS`):
the run, the estimate and the config ask its spec. A toy objective registered by this test alone trains
through the real CLI, with what its spec says."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tuneforge.config import objectives as specs
from tuneforge.config.objectives import OBJECTIVES, ObjectiveSpec
from tuneforge.config.schema import Config
from tuneforge.objective import CrossEntropy
from tuneforge.train import objectives as builders

from conftest import TINY_LLAMA, chat, metrics, train_here, write_jsonl

SOURCE = Path(specs.__file__).parent.parent


def test_every_objective_has_a_builder_and_only_the_spec_compares_objective_names():
    assert set(builders.BUILDERS) == set(OBJECTIVES)
    compared = []
    for path in SOURCE.rglob("*.py"):
        if (path.name == "objectives.py" and path.parent.name == "config") or "xtuner" in path.parts:
            continue  # the spec itself; the xtuner import maps xtuner's own model classes
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare) and any(
                isinstance(side, ast.Attribute) and side.attr == "objective" for side in [node.left, *node.comparators]
            ):
                compared.append(f"{path.relative_to(SOURCE)}:{node.lineno}")
    assert not compared, compared


def config(objective: str = "sft", lora: bool = False, **sections) -> Config:
    model = {"architecture": "llama", "tokenizer": "bytes", **({"lora": {"r": 4}} if lora else {})}
    return Config.model_validate(
        {"model": model, "data": {"train_files": ["x.jsonl"]}, "train": {"objective": objective}, **sections}
    )


def test_the_spec_answers_for_each_objective_and_its_checks_are_the_configs():
    dpo = config("dpo")
    assert dpo.paired and dpo.reference == "precompute" and dpo.objective.reference_pass(dpo)
    assert dpo.objective.extra_forwards(dpo) == 0 and not dpo.objective.frozen_copy(dpo)
    adapters = config("dpo", lora=True)
    assert adapters.reference == "adapters" and adapters.objective.extra_forwards(adapters) == 1
    frozen = config("dpo", lora=True, preference={"reference": "model"})
    assert frozen.objective.frozen_copy(frozen) and frozen.objective.extra_forwards(frozen) == 1
    reward = config("reward", lora=True)
    assert reward.objective.scalar_head and not reward.objective.writes_answers and reward.reference is None
    sft = config()
    assert not sft.paired and sft.objective.batch_unit(True) == "rows" and sft.objective.sample_word == "samples"
    with pytest.raises(ValueError, match=r"does nothing with train\.objective: orpo"):
        config("orpo", preference={"reference": "model"})
    with pytest.raises(ValueError, match="does not write answers"):
        config("reward", eval={"sample_prompts": ["hi"]})
    with pytest.raises(ValueError, match=r"adapters needs model\.lora"):
        config("dpo", preference={"reference": "adapters"})
    with pytest.raises(ValueError, match=r"unknown objective 'dop' \(did you mean 'dpo'\?\)"):
        config("dop")


class HalfCrossEntropy(CrossEntropy):
    """A toy: half the answers' cross-entropy."""

    def evaluate(self, batch, prepared):
        loss, metrics = super().evaluate(batch, prepared)
        return loss / 2, metrics


@pytest.mark.slow
def test_a_toy_objective_registered_here_alone_trains_through_the_cli(tmp_path, monkeypatch):
    toy = ObjectiveSpec("half_sft", data="chats", unit="target tokens", description="half the cross-entropy")
    monkeypatch.setitem(OBJECTIVES, toy.name, toy)
    monkeypatch.setitem(
        builders.BUILDERS,
        toy.name,
        lambda given: HalfCrossEntropy(given.forward, given.balance, given.engine.sum_tensor_across_ranks),
    )
    write_jsonl(tmp_path / "train.jsonl", [chat(f"question {i}", f"answer {i * 7}") for i in range(8)])
    (tmp_path / "cfg.yaml").write_text(
        TINY_LLAMA
        + "data: {train_files: [train.jsonl], cache_dir: null}\n"
        + "train: {lr: 1.0e-3, micro_batch_size: 2, max_steps: 1, precision: fp32}\n"
        + "checkpoint: {every_steps: 0, save_final: false}\nlog: {progress: lines}\n"
    )
    losses = {}
    for objective in ("sft", "half_sft"):
        result = train_here(tmp_path / "cfg.yaml", tmp_path / objective, f"train.objective={objective}")
        assert result.returncode == 0, result.stderr[-3000:]
        losses[objective] = metrics(tmp_path / objective)[0]["loss"]
    assert losses["half_sft"] == pytest.approx(losses["sft"] / 2, rel=1e-6)


def test_building_a_model_inside_forked_rng_leaves_the_runs_stream_as_it_was():
    import random

    import numpy
    import torch

    from tuneforge.forked_rng import forked_rng
    from tuneforge.train.run import seed_everything

    seed_everything(7)
    numpy.random.seed(7)
    expected = (random.random(), torch.rand(3), numpy.random.rand())
    seed_everything(7)
    numpy.random.seed(7)
    with forked_rng(torch.device("cpu")):
        torch.nn.Linear(64, 64)  # initialisation draws from the generator
        random.random()
        numpy.random.seed(0)  # as vLLM does when it starts
    after = (random.random(), torch.rand(3), numpy.random.rand())
    assert after[0] == expected[0] and torch.equal(after[1], expected[1]) and after[2] == expected[2]
