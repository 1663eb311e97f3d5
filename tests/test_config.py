from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tuneforge.config import dump_config, load_config
from tuneforge.errors import UserError

BASE = """\
model:
  architecture: llama
  tokenizer: bytes
data:
  train_files: [train.jsonl]
train:
  lr: 1.0e-3
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def error_of(path: Path, overrides: list[str] = ()) -> str:
    with pytest.raises(UserError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_unknown_key_suggests_the_closest_one(tmp_path):
    message = error_of(write(tmp_path, BASE + "  lrr: 3\n"))
    assert message == f"{tmp_path / 'cfg.yaml'}:8: train.lrr: unknown key; did you mean `lr`?"


def test_unknown_section_suggests_the_closest_one(tmp_path):
    message = error_of(write(tmp_path, BASE + "chekpoint: {every_steps: 3}\n"))
    assert message == f"{tmp_path / 'cfg.yaml'}:8: chekpoint: unknown key; did you mean `checkpoint`?"


def test_wrong_type_names_key_line_and_value(tmp_path):
    message = error_of(write(tmp_path, BASE + "  micro_batch_size: lots\n"))
    assert message.startswith(f"{tmp_path / 'cfg.yaml'}:8: train.micro_batch_size: ")
    assert "integer" in message and "'lots'" in message


@pytest.mark.parametrize(
    ("line", "key", "words"),
    [
        ("  lr: -1.0", "train.lr", "greater than 0"),
        ("  warmup_ratio: 1.5", "train.warmup_ratio", "less than or equal to 1"),
        ("  gradient_accumulation: 0", "train.gradient_accumulation", "greater than or equal to 1"),
    ],
)
def test_impossible_values(tmp_path, line, key, words):
    text = BASE.replace("  lr: 1.0e-3\n", "") + line + "\n"
    message = error_of(write(tmp_path, text))
    assert message.startswith(f"{tmp_path / 'cfg.yaml'}:7: {key}: ")
    assert words in message
    assert len(message.splitlines()) == 1


def test_cross_field_rule_is_reported_on_its_section(tmp_path):
    message = error_of(write(tmp_path, BASE + "  min_lr: 1.0\n"))
    assert "train.min_lr` (1.0) must not exceed `train.lr`" in message
    assert message.startswith(f"{tmp_path / 'cfg.yaml'}:6: train: ")


def test_model_needs_exactly_one_source(tmp_path):
    message = error_of(write(tmp_path, BASE.replace("  architecture: llama\n", "")))
    assert "set exactly one of `model.path`" in message


def test_every_mistake_gets_its_own_line(tmp_path):
    text = BASE.replace("  lr: 1.0e-3\n", "  lr: -1\n  epochs: 0\n")
    assert len(error_of(write(tmp_path, text)).splitlines()) == 2


def test_a_mistake_in_an_inline_template_is_reported_on_the_template_alone(tmp_path):
    """`data.template` takes a name or a section: a section with a wrong key is not also called a bad string."""
    text = "model: {path: m}\ndata:\n  train_files: [t.jsonl]\n  template: {instruction: '{input}', colour: red}\n"
    with pytest.raises(UserError) as info:
        load_config(write(tmp_path, text))
    assert str(info.value).splitlines() == [
        f"{tmp_path / 'cfg.yaml'}:4: data.template.colour: unknown key; known keys: system, instruction, suffix, "
        "suffix_as_eos, sep, stop_words"
    ]


def test_a_data_file_in_a_symlink_loop_is_named(tmp_path):
    (tmp_path / "a.jsonl").symlink_to(tmp_path / "b.jsonl")
    (tmp_path / "b.jsonl").symlink_to(tmp_path / "a.jsonl")
    with pytest.raises(UserError, match=r"^data.train_files: .*a.jsonl cannot be resolved"):
        load_config(write(tmp_path, "model: {path: m}\ndata: {train_files: [a.jsonl]}\n"))


def test_a_yaml_alias_bomb_and_deep_nesting_are_refused_at_once(tmp_path):
    import time

    levels = ["a: &a [" + ", ".join(["lol"] * 9) + "]"]
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True):
        levels.append(f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]")
    bomb = "\n".join(levels) + "\nmodel: {path: m}\ndata: {train_files: [t.jsonl], system: *i}\n"
    started = time.monotonic()
    with pytest.raises(UserError, match=r"aliases \(&name / \*name\) expand to more than 100,000 values"):
        load_config(write(tmp_path, bomb))
    assert time.monotonic() - started < 5
    with pytest.raises(UserError, match=r"nested too deeply to read"):
        load_config(write(tmp_path, "eval: {sample_prompts: " + "[" * 50_000 + "]" * 50_000 + "}\n"))


def test_a_long_wrong_value_is_shown_cut_short(tmp_path):
    with pytest.raises(UserError) as info:
        load_config(
            write(tmp_path, f"model: {{path: m}}\ndata: {{train_files: [t.jsonl], system: {[['x'] * 5000]}}}\n")
        )
    assert "... (" in str(info.value) and len(str(info.value)) < 600


def test_overrides_apply_and_parse_yaml_values(tmp_path):
    config = load_config(write(tmp_path, BASE), ["train.lr=1e-4", "data.max_length=512", "train.betas=[0.9, 0.95]"])
    assert config.train.lr == 1e-4
    assert config.data.max_length == 512
    assert config.train.betas == (0.9, 0.95)


def test_bad_override_names_the_override(tmp_path):
    message = error_of(write(tmp_path, BASE), ["train.lr=-5"])
    assert message.startswith(f"{tmp_path / 'cfg.yaml'} (override train.lr=-5): train.lr: ")
    message = error_of(write(tmp_path, BASE), ["train.seeed=1"])
    assert "train.seeed: unknown key; did you mean `seed`?" in message
    with pytest.raises(UserError, match="expected KEY=VALUE"):
        load_config(write(tmp_path, BASE), ["train.lr"])


def test_invalid_yaml_gives_the_line(tmp_path):
    message = error_of(write(tmp_path, BASE + "  seed: [1, 2\n"))
    assert message.startswith(f"{tmp_path / 'cfg.yaml'}:")
    assert "not valid YAML" in message


def test_relative_data_paths_resolve_against_the_config(tmp_path):
    config = load_config(write(tmp_path, BASE))
    assert config.data.train_files == [str(tmp_path / "train.jsonl")]


def test_resolved_config_round_trips(tmp_path):
    config = load_config(write(tmp_path, BASE), ["train.max_steps=7", "eval.sample_prompts=[hi]"])
    dump_config(config, tmp_path / "out" / "config.yaml")
    again = load_config(tmp_path / "out" / "config.yaml")
    assert again == config


def test_demo_config_is_valid():
    config = load_config(Path(__file__).parent.parent / "configs" / "demo.yaml")
    assert config.eval.exact_match is not None and config.eval.exact_match.label == "demo"


@pytest.mark.slow
def test_cli_reports_config_errors_in_one_line_before_loading_anything(tmp_path):
    path = write(tmp_path, BASE + "  lrr: 3\n")
    work_dir = tmp_path / "wd"
    result = subprocess.run(
        [sys.executable, "-m", "tuneforge", "train", str(path), "--work-dir", str(work_dir)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {path}:8: train.lrr: unknown key; did you mean `lr`?"
    assert not work_dir.exists()


def test_a_skip_pattern_that_is_no_regular_expression_is_refused_at_load(tmp_path):
    """transformers reads skip_modules as regular expressions too: a broken one would fail deep in loading."""
    lines = "  tokenizer: bytes\n  lora: {r: 4}\n  quantization: {skip_modules: [experts, 'layers.[1']}\n"
    message = error_of(write(tmp_path, BASE.replace("  tokenizer: bytes\n", lines)))
    assert message.startswith(f"{tmp_path / 'cfg.yaml'}:5: model.quantization.skip_modules: ")
    assert "'layers.[1' is not a valid regular expression" in message and len(message.splitlines()) == 1
    # Valid alone, but not inside the group transformers puts it in.
    lines = "  tokenizer: bytes\n  lora: {r: 4}\n  quantization: {skip_modules: ['(?i)experts']}\n"
    assert "'(?i)experts' is not a valid regular expression" in error_of(
        write(tmp_path, BASE.replace("  tokenizer: bytes\n", lines))
    )


def test_a_frozen_reference_model_under_expert_parallelism_is_refused_with_the_alternatives(tmp_path):
    text = BASE + "  objective: dpo\npreference: {reference: model}\nparallel: {engine: deepspeed, zero_stage: 2}\n"
    message = error_of(write(tmp_path, text), ["parallel.expert_parallel=2"])
    assert "preference.reference: model is not built under parallel.expert_parallel" in message
    assert "use preference.reference: precompute (expert parallelism trains every weight" in message
    load_config(write(tmp_path, text), [])  # without expert parallelism it is a valid config


def test_command_line_mistakes_get_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    """A refresh interval that is no positive number, an import written where it cannot be, and a model path in
    a directory this user may not look into (Path.exists raises there): each a one-line error."""
    from pathlib import Path

    from tuneforge.cli import main
    from tuneforge.config.load import load_config

    for interval in ("-1", "nan", "soon"):
        with pytest.raises(SystemExit) as info:
            main(["watch", str(tmp_path), "--interval", interval])
        assert info.value.code == 2 and "--interval: expected a number of seconds" in capsys.readouterr().err

    from test_xtuner_import import SEED

    (tmp_path / "file").write_text("")
    assert main(["import-xtuner", str(SEED), "-o", str(tmp_path / "file" / "out.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'file' / 'out.yaml'}: cannot write the imported config (" in err
    assert "Traceback" not in err

    (tmp_path / "cfg.yaml").write_text("model: {path: private/model}\ndata: {train_files: [x.jsonl]}\n")
    real = Path.exists

    def guarded(self, *args, **kwargs):
        if "private" in str(self):
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "exists", guarded)
    assert load_config(tmp_path / "cfg.yaml").model.path == "private/model"  # left as given: a hub name, or not
