"""Bad input of every kind gets one message naming the file, line or key and the fix, before any model loads:
configs, data files, model and tokenizer paths, the work dir and the launcher's flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuneforge.cli import main
from tuneforge.config import load_config
from tuneforge.data.conversation import SampleError
from tuneforge.data.formats import detect_format, to_conversation
from tuneforge.data.sources import read_records
from tuneforge.errors import UserError
from tuneforge.train.inputs import check_inputs

from conftest import TINY_LLAMA, chat, write_jsonl

CONFIG = TINY_LLAMA + "data: {train_files: [train.jsonl], cache_dir: null}\n"


def user_error(function, *args, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        function(*args, **kwargs)
    return str(info.value)


def config_in(tmp_path: Path, text: str = CONFIG, overrides: tuple[str, ...] = ()):
    (tmp_path / "cfg.yaml").write_text(text, encoding="utf-8")
    return load_config(tmp_path / "cfg.yaml", list(overrides))


# --- configs -------------------------------------------------------------------------------------------------


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    text = CONFIG + "train:\n  lr: 1.0e-3\n  max_steps: 5\n  lr: 1.0e-4\n"
    message = user_error(config_in, tmp_path, text)
    assert message == (
        f"{tmp_path / 'cfg.yaml'}:6: train.lr: given twice (lines 4 and 6); YAML would keep the last one silently: "
        "delete one"
    )


def test_a_config_with_a_byte_order_mark_reads_and_one_in_latin_1_is_located(tmp_path):
    (tmp_path / "cfg.yaml").write_bytes(b"\xef\xbb\xbf" + CONFIG.encode())
    assert load_config(tmp_path / "cfg.yaml").data.cache_dir is None
    (tmp_path / "cfg.yaml").write_bytes(CONFIG.encode() + "# r\xe9sum\xe9\n".encode("latin-1"))
    message = user_error(load_config, tmp_path / "cfg.yaml")
    assert message == f"{tmp_path / 'cfg.yaml'}:3: not UTF-8 text; save the config as UTF-8"


@pytest.mark.parametrize(
    ("instruction", "words"),
    [
        ("### Instruction:\n", "has no `{input}`: every user message would be left out"),
        ("{input} {user}", "unknown placeholder {user}; the placeholders are {input}, {round}"),
        ('{"q": {input}}', 'unknown placeholder {"q"}'),
        ("{input", "the placeholders are {input}, {round}, and {{ }} write literal braces"),
    ],
)
def test_a_custom_template_without_its_placeholder_or_with_a_stray_brace_is_refused(tmp_path, instruction, words):
    text = CONFIG.replace(
        "cache_dir: null}", "cache_dir: null, template: {instruction: " + json.dumps(instruction) + "}}"
    )
    message = user_error(config_in, tmp_path, text)
    assert "data.template.instruction" in message and words in message


def test_an_override_that_makes_an_unknown_section_is_blamed_on_the_override(tmp_path):
    message = user_error(config_in, tmp_path, CONFIG, ("trian.lr=1e-4",))
    assert "trian.lr=1e-4" in message and "train" in message


# --- data files --------------------------------------------------------------------------------------------


def test_a_jsonl_byte_order_mark_is_not_part_of_the_first_record(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps(chat("q", "a")) + "\n").encode())
    records = list(read_records(str(path)))
    assert [r.value for r in records] == [chat("q", "a")]


def test_a_line_that_is_not_utf8_is_located_or_counted_when_skipping(tmp_path):
    path = tmp_path / "mixed.jsonl"
    good = (json.dumps(chat("q", "a")) + "\n").encode()
    path.write_bytes(good + '{"messages": "caf\xe9"}\n'.encode("latin-1") + good)
    message = user_error(lambda: list(read_records(str(path))))
    assert message.startswith(f"{path}:2: not UTF-8 text (byte 0xe9 at column 18); re-encode the file as UTF-8")
    assert "data.on_error=skip" in message
    records = list(read_records(str(path), on_error="skip"))
    assert [(r.origin, r.error) for r in records if r.error] == [(f"{path}:2", "not UTF-8 text")]
    assert sum(r.value is not None for r in records) == 2


def test_a_json_file_that_is_not_utf8_and_a_parquet_file_that_is_not_parquet(tmp_path):
    json_path = tmp_path / "d.json"
    json_path.write_bytes(b'[\n{"instruction": "x",\n "output": "\xff"}]')
    assert user_error(lambda: list(read_records(str(json_path)))).startswith(f"{json_path}:3: not UTF-8 text")
    fake = tmp_path / "d.parquet"
    fake.write_text("id,text\n1,hello\n")
    message = user_error(lambda: list(read_records(str(fake))))
    assert message.startswith(f"{fake}: not a readable parquet file (") and "give it its real suffix" in message


@pytest.mark.parametrize(
    ("content", "reason", "words"),
    [
        (None, "missing content", "has no content"),
        (5, "missing content", "content is int 5, not text; write it as a string"),
        (
            [{"type": "text", "text": "see"}, {"type": "input_audio", "input_audio": "x.wav"}],
            "non-text content",
            "content parts of type input_audio; only text and image parts are trained",
        ),
    ],
)
def test_content_that_is_not_text_says_what_it_is(content, reason, words):
    record = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "a"}]}
    with pytest.raises(SampleError) as info:
        to_conversation(record, detect_format(record), "f.jsonl:7")
    assert info.value.reason == reason and words in str(info.value)


def test_data_check_and_preview_say_why_nothing_trains(tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text("\n\n")
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    assert main(["data", "check", str(tmp_path / "cfg.yaml")]) == 1
    assert "error: data: no records in " in capsys.readouterr().err
    write_jsonl(tmp_path / "train.jsonl", [chat("q", "a"), {"messages": []}])
    assert main(["data", "preview", str(tmp_path / "cfg.yaml"), "data.max_length=4"]) == 1
    out, err = capsys.readouterr()
    assert "2 records read" in out and "error: data: all 2 records of " in err and "data.max_length" in err


# --- paths before the model loads ----------------------------------------------------------------------------


def test_every_missing_input_is_listed_in_one_message(tmp_path):
    text = (
        CONFIG.replace("cache_dir: null}", "cache_dir: null, validation_files: [val.jsonl]}")
        + "eval: {exact_match: {file: held.jsonl, label: x}}\n"
    )
    message = user_error(check_inputs, config_in(tmp_path, text), tmp_path / "run")
    lines = message.splitlines()
    assert lines == [
        f"data.train_files: {tmp_path / 'train.jsonl'} not found (relative paths are read from the config file's "
        "directory)",
        f"data.validation_files: {tmp_path / 'val.jsonl'} not found (relative paths are read from the config file's "
        "directory)",
        f"eval.exact_match.file: {tmp_path / 'held.jsonl'} not found (relative paths are read from the config "
        "file's directory)",
    ]


def test_model_paths_that_hold_no_model_are_named_with_a_hint(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [chat("q", "a")])
    (tmp_path / "models" / "base" / "v1").mkdir(parents=True)
    (tmp_path / "models" / "base" / "v1" / "config.json").write_text("{}")
    text = f"model: {{path: {tmp_path / 'models' / 'base'}, tokenizer: bytes}}\n" + CONFIG.split("\n", 1)[1]
    message = user_error(check_inputs, config_in(tmp_path, text), tmp_path / "run")
    assert message == (
        f"model.path: {tmp_path / 'models' / 'base'} has no config.json: not a Hugging Face directory; its "
        "subdirectories v1 have one"
    )
    text = f"model: {{path: {tmp_path / 'nowhere'}, tokenizer: bytes}}\n" + CONFIG.split("\n", 1)[1]
    assert user_error(check_inputs, config_in(tmp_path, text), tmp_path / "run") == (
        f"model.path: {tmp_path / 'nowhere'} does not exist"
    )


def test_a_hub_id_that_is_not_cached_offline_says_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    write_jsonl(tmp_path / "train.jsonl", [chat("q", "a")])
    text = "model: {path: some-org/some-model-7b}\n" + CONFIG.split("\n", 1)[1]
    message = user_error(check_inputs, config_in(tmp_path, text), tmp_path / "run")
    assert message.startswith("model.path: some-org/some-model-7b is not found locally and HF_HUB_OFFLINE is set")
    assert "hf download some-org/some-model-7b --local-dir DIR" in message
    assert message.count("\n") == 0  # the tokenizer of a missing model is not reported again


def test_a_work_dir_under_a_file_and_a_length_beyond_the_context_are_refused(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [chat("q", "a")])
    (tmp_path / "taken").write_text("a file")
    message = user_error(check_inputs, config_in(tmp_path), tmp_path / "taken" / "run")
    assert message == f"--work-dir {tmp_path / 'taken' / 'run'}: {tmp_path / 'taken'} is a file, not a directory; " + (
        "choose another path"
    )
    sized = CONFIG.replace("num_attention_heads: 4}", "num_attention_heads: 4, max_position_embeddings: 128}")
    long = sized.replace("cache_dir: null}", "cache_dir: null, max_length: 512}")
    message = user_error(check_inputs, config_in(tmp_path, long), tmp_path / "run")
    assert message.startswith("data.max_length: 512 is beyond the model's context (128 positions")
    allowed = long.replace("max_length: 512}", "max_length: 512, allow_beyond_context: true}")
    check_inputs(config_in(tmp_path, allowed), tmp_path / "run")  # extending the context on purpose


def test_a_work_dir_without_room_for_one_checkpoint_is_refused_and_for_a_few_warned(tmp_path):
    import shutil

    from tuneforge.train.inputs import checkpoint_bytes, disk_room_problems

    # A full fine-tune of 1B bf16 weights: 2 GB of weights and 12 GB of fp32 weights and AdamW moments.
    assert checkpoint_bytes(10**9, 10**9, 2, adapter=False) == 14 * 10**9
    assert checkpoint_bytes(10**9, 10**6, 2, adapter=True) == 16 * 10**6
    free = shutil.disk_usage(tmp_path).free
    errors, warnings = disk_room_problems(tmp_path / "run", free * 2, 2)
    assert errors[0].startswith(f"--work-dir {tmp_path / 'run'}: ") and "one checkpoint of this run takes" in errors[0]
    errors, warnings = disk_room_problems(tmp_path / "run", free // 2, 2)
    assert not errors and "holds 2 checkpoint(s) of about" in warnings[0]
    assert disk_room_problems(tmp_path / "run", 1024, 2) == ([], [])


@pytest.mark.slow
def test_train_refuses_missing_inputs_before_writing_anything(tmp_path, capsys):
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    assert main(["train", str(tmp_path / "cfg.yaml"), "--work-dir", str(tmp_path / "run")]) == 2
    assert "data.train_files: " in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# --- the launcher's flags ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--nproc-per-node", "0"], "argument --nproc-per-node: must be at least 1, got 0"),
        (["--nproc-per-node", "two"], "argument --nproc-per-node: expected a whole number, got 'two'"),
        (["--master-port", "70000"], "argument --master-port: must be from 1 to 65535, got 70000"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is beyond --nnodes 2: node ranks go 0..1"),
    ],
)
def test_launcher_flags_out_of_range_are_refused_by_name(tmp_path, capsys, flags, words):
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    with pytest.raises(SystemExit) as info:
        main(["train", str(tmp_path / "cfg.yaml"), *flags])
    assert info.value.code == 2 and words in capsys.readouterr().err
